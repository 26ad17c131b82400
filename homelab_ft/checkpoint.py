"""Resumable checkpoints: one format for one process and for many.

A checkpoint is a directory `checkpoints/step_000123/` holding
- `state/`: model (trainable parameters only: the adapters for LoRA) and optimizer, written with
  torch.distributed.checkpoint (DCP), where every rank writes only the shards it holds and a load
  on another number of ranks reshards;
- `adapter/`: for LoRA runs, the adapter as PEFT safetensors (what export and serving read);
- `rng/rank_<r>.pt`: each rank's RNG states (dropout), read back with weights_only=True;
- `trainer_state.json`: step, scheduler, data position, model identity. Written last.

All of it is written under `.tmp-step_000123` and renamed when complete, so a crash mid-write
leaves nothing that `latest()` would pick.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict

from homelab_ft.errors import UserError

_STEP_DIR = re.compile(r"^step_(\d{6,})$")


@dataclass(frozen=True)
class TrainerState:
    step: int
    scheduler: dict
    sampler: dict
    model_fingerprint: str
    world_size: int


def checkpoints_dir(run_dir: Path) -> Path:
    return Path(run_dir) / "checkpoints"


def latest(run_dir: Path) -> Path | None:
    """The newest complete checkpoint (temporary and incomplete directories are ignored)."""
    root = checkpoints_dir(run_dir)
    if not root.is_dir():
        return None
    complete = [
        (int(m.group(1)), p)
        for p in root.iterdir()
        if (m := _STEP_DIR.match(p.name)) and (p / "trainer_state.json").is_file()
    ]
    return max(complete)[1] if complete else None


def _barrier() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.barrier()


def _rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def save(run_dir: Path, *, model, optimizer, state: TrainerState, keep_last: int) -> Path:
    """Write a checkpoint for `state.step` on every rank; returns its final path."""
    root = checkpoints_dir(run_dir)
    final = root / f"step_{state.step:06d}"
    tmp = root / f".tmp-step_{state.step:06d}"
    rank = _rank()
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)  # left by a crash at this very step
        tmp.mkdir(parents=True)
    _barrier()

    with _single_process_ok():
        dcp.save(
            {"model": trainable_state(model), "optim": get_optimizer_state_dict(model, _optimizers(optimizer))},
            checkpoint_id=tmp / "state",
        )
    (tmp / "rng").mkdir(exist_ok=True)
    torch.save(_rng_state(), tmp / "rng" / f"rank_{rank}.pt")
    save_adapter(model, tmp / "adapter")
    _barrier()

    if rank == 0:
        # trainer_state.json last: its presence is what marks a checkpoint complete.
        (tmp / "trainer_state.json").write_text(json.dumps(state.__dict__, indent=1))
        if final.exists():  # a re-run of the same step after a resume from an earlier one
            shutil.rmtree(final)
        os.replace(tmp, final)
        _prune(root, keep_last=keep_last)
    _barrier()
    return final


def load(path: Path, *, model, optimizer, model_fingerprint: str) -> TrainerState:
    """Restore model, optimizer and this rank's RNG from `path`; returns the trainer state."""
    state = TrainerState(**json.loads((path / "trainer_state.json").read_text()))
    if state.model_fingerprint != model_fingerprint:
        raise UserError(
            f"{path} was written for another model or method ({state.model_fingerprint}), "
            f"not {model_fingerprint}; use a new output.dir or set output.overwrite=true"
        )
    # The model's tensors are loaded in place (each rank its own shards, resharded by DCP when the
    # number of ranks changed); a trainable tensor missing from the checkpoint fails the load.
    target = {"model": trainable_state(model), "optim": get_optimizer_state_dict(model, _optimizers(optimizer))}
    with _single_process_ok(), torch.no_grad():
        dcp.load(target, checkpoint_id=path / "state")
    set_optimizer_state_dict(model, _optimizers(optimizer), target["optim"])
    rng_file = path / "rng" / f"rank_{_rank()}.pt"
    if rng_file.is_file():  # absent when resuming on more ranks than the run was written with
        _set_rng_state(torch.load(rng_file, weights_only=True))
    return state


def _optimizers(optimizer):
    """DCP takes a list of optimizers and keys their state by parameter name: optim_backward.py's
    per-parameter optimizers save and load in the same layout as one optimizer."""
    return getattr(optimizer, "optimizers", optimizer)


def trainable_state(model) -> dict[str, torch.Tensor]:
    """The trainable parameters by their un-wrapped names (sharded DTensors under FSDP2).

    Only what training changes is checkpointed: the frozen base is reloaded from the model. This
    reads parameters directly instead of calling `state_dict()`, whose hooks in quantized layers
    add packed quantization state (and, for bitsandbytes' 8-bit layers, fail on a missing `SCB`).
    """
    inner = getattr(model, "module", model)  # DDP wraps; FSDP2 does not
    return {name: p for name, p in inner.named_parameters() if p.requires_grad}


def save_adapter(model, out_dir: Path) -> None:
    """For PEFT models, gather the adapter to rank 0 and write it in PEFT's own format."""
    from peft import PeftModel
    from peft.utils import get_peft_model_state_dict
    from safetensors.torch import save_file
    from torch.distributed.tensor import DTensor

    inner = getattr(model, "module", model)
    if not isinstance(inner, PeftModel):
        return
    # full_tensor() is a collective: every rank gathers, rank 0 writes.
    full = {
        name: (p.full_tensor() if isinstance(p, DTensor) else p).detach().cpu()
        for name, p in trainable_state(model).items()
    }
    if _rank() != 0:
        return
    adapter = get_peft_model_state_dict(inner, state_dict=full)
    out_dir.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in adapter.items()}, out_dir / "adapter_model.safetensors")
    inner.peft_config["default"].save_pretrained(out_dir)


@contextlib.contextmanager
def _single_process_ok():
    """DCP warns on every single-process save/load; one process is a supported case here."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def _prune(root: Path, *, keep_last: int) -> None:
    steps = sorted(p for p in root.iterdir() if _STEP_DIR.match(p.name) and (p / "trainer_state.json").is_file())
    for old in steps[:-keep_last]:
        shutil.rmtree(old, ignore_errors=True)


def _rng_state() -> dict:
    state = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["cpu"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
