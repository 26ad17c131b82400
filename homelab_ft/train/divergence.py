"""The non-finite guard: a step whose loss or gradient norm is not finite never reaches the weights.

A run that diverges (a learning rate near the bound, a huge `lora.alpha` or `dpo.beta`, fp16
overflow) used to train on to NaN, exit 0, save checkpoints of NaN weights and let export merge
them. Now `trainer._optimizer_step` decides from the step's loss and gradient norm once both are
reduced over every rank (the same two numbers on every rank, so every rank decides the same in
the same step) and before the optimizer steps: a non-finite step is not applied, and neither the
weights nor AdamW's moments see its gradient. `train.skip_nonfinite_steps: N` drops up to N such
steps (each one logged, the count in metrics.jsonl); the next one, or the first with N = 0, stops
the run with `errors.Diverged` (one line, exit 3) after recording it in the run directory
(`diverged.json`, store/layout.py) for `--resume` and `export` to report. Every checkpoint written
before it is kept, and a save checks the weights themselves first (`check_weights`): a finite
update can still overflow them, and such weights are never saved.

`train.optimizer_in_backward` steps each parameter inside backward, before the step's norm exists:
there each parameter's hook checks its own gradient and does not step on a non-finite one
(optim_backward.py), but the parameters that already stepped cannot be taken back, so such a step
stops the run (skipping is refused with it).
"""

from __future__ import annotations

import json
import logging
import math
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from homelab_ft.distributed import comm
from homelab_ft.distributed.comm import DistEnv
from homelab_ft.errors import Diverged
from homelab_ft.recipe.config import Recipe
from homelab_ft.rung import Rung
from homelab_ft.store import checkpoint
from homelab_ft.store.layout import RunDir

log = logging.getLogger(__name__)


def nonfinite(*, loss: float, grad_norm: float) -> str | None:
    """What of the step is not finite ("loss", "gradient norm"), or None for a step to apply."""
    if not math.isfinite(loss):
        return "loss"
    if not math.isfinite(grad_norm):
        return "gradient norm"
    return None


@dataclass(frozen=True)
class Failure:
    """What diverged.json records: the step that stopped the run and what was left of it."""

    step: int
    what: str
    """"loss", "gradient norm" or "weights" (a save found them non-finite)."""
    value: str
    """The value as Python prints it ("nan", "inf"); JSON has no NaN."""
    skipped: int
    """Non-finite steps skipped before this one (train.skip_nonfinite_steps)."""
    checkpoint: str | None
    """The newest checkpoint, written before the step: what export and --resume read."""


def usual_causes(recipe: Recipe, *, rung: Rung, fp16: bool) -> str:
    """The settings that usually make a run diverge, with this run's values."""
    causes = [f"train.lr={recipe.train.lr:g}"]
    if rung.adapters_enabled:
        causes.append(f"lora.alpha={recipe.lora.alpha:g} (with lora.r={recipe.lora.r})")
    if recipe.objective == "dpo":
        causes.append(f"dpo.beta={recipe.dpo.beta:g}")
    if fp16:
        causes.append("float16 weights or compute (bfloat16 or float32 do not overflow at 65504)")
    return ", ".join(causes)


def stop(recipe: Recipe, *, env: DistEnv, rung: Rung, step: int, what: str, value: str, skipped: int,
         fp16: bool) -> Diverged:
    """Record the failure (rank 0) and the one line that ends the run (empty on the other ranks)."""
    if not env.is_main:
        return Diverged("")
    newest = checkpoint.latest(recipe.run_dir)
    failure = Failure(step=step, what=what, value=value, skipped=skipped,
                      checkpoint=newest.name if newest else None)
    write_failure(recipe.run_dir, failure)
    kept = (f"newest checkpoint {newest.name} is from before it (export or --resume read it)" if newest
            else "no checkpoint was written before it")
    skip = f" after skipping {skipped} (train.skip_nonfinite_steps)" if skipped else ""
    head = (f"the weights are not finite ({value}); they were not saved" if what == "weights"
            else f"the {what} is {value}{skip}; it was not applied")
    return Diverged(f"step {step}: {head}, {kept}; usual causes: "
                    f"{usual_causes(recipe, rung=rung, fp16=fp16)}; lower one and resume, or start again")


def write_failure(run_dir: Path, failure: Failure) -> None:
    RunDir(run_dir).failure_file.write_text(json.dumps(asdict(failure), indent=1))


def check_weights(model: torch.nn.Module, env: DistEnv) -> bool:
    """Whether every trainable weight on every rank is finite (collective): asked before each save.
    One pass over the trainable tensors: for LoRA ~1% of the model, for a full fine-tune the shards
    this rank holds, once per checkpoint."""
    bad = 0
    with torch.no_grad():
        for p in model.parameters():
            if p.requires_grad:
                local = p.to_local() if hasattr(p, "to_local") else p
                if local.numel() and not bool(torch.isfinite(local).all()):
                    bad = 1
                    break
    return comm.all_reduce_max(bad, env) == 0


def has_fp16(model: torch.nn.Module, recipe: Recipe) -> bool:
    """Whether the run computes in float16 anywhere: its weights, or QLoRA's compute dtype."""
    if recipe.quant.compute_dtype == "float16":
        return True
    return any(p.dtype == torch.float16 for p in model.parameters())
