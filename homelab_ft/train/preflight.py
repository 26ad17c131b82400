"""Every check of a run's inputs, before anything is created, launched or loaded.

`check_inputs` runs in the `homelab-ft train` process before torchrun starts any worker and before
the run directory exists, so a typo, a half-copied model folder or a refused combination costs
nothing: the user gets one line naming the path or key and the fix, exit 2, and the next attempt is
not met with "already holds a run". Where a cheap check exists it is used instead of loading:
safetensors and GGUF headers against the file sizes and tokenizer files by name (model/files.py), LoRA targets against
a meta-device skeleton of the architecture (no weights, ~1 s even for 70B).
"""

from __future__ import annotations

import difflib
import json
import logging
from dataclasses import dataclass
from pathlib import Path

from homelab_ft.errors import UserError
from homelab_ft.locate import locate
from homelab_ft.model import family, files, loading
from homelab_ft.model_facts import ModelFacts
from homelab_ft.recipe.config import Recipe
from homelab_ft.rules import refusals
from homelab_ft.rung import Rung
from homelab_ft.store import rundir
from homelab_ft.train import trackers

log = logging.getLogger(__name__)



@dataclass(frozen=True)
class Inputs:
    """What the checks resolved, handed to the trainer so nothing is looked up twice."""

    model_dir: Path
    resume_from: Path | None
    facts: ModelFacts
    """What the plan read off the model (its shape's `facts`): what the builder asks."""


def check_rewards(recipe: Recipe, *, base_dir: Path) -> None:
    """`objective: grpo`: every reward function resolves (a built-in, a file beside the recipe in
    `base_dir`, or a module) before planning, so a name that does not import is one line and no run
    directory exists yet (train/rewards.py)."""
    if recipe.objective != "grpo":
        return
    from homelab_ft.train import rewards

    rewards.resolve_rewards(recipe.grpo.reward_funcs, weights=recipe.grpo.reward_weights, recipe_dir=base_dir)


def check_inputs(recipe: Recipe, *, rung: Rung, facts: ModelFacts, device_type: str) -> Inputs:
    """Recipe-level and file-level checks of everything a run reads, in the order a user fixes them.
    `facts`: the plan's (`plan.shape.facts`), handed on to the builder with the checked inputs.

    The data is checked by `data.prepare_data` (rows are validated while tokenising), which the
    caller runs after this and still before the run directory is created.
    """
    if why := refusals.kto_batch(rung, objective=recipe.objective, loss=recipe.dpo.loss,
                                 micro_batch_size=recipe.train.micro_batch_size,
                                 grad_accum_steps=recipe.train.grad_accum_steps):
        raise UserError(why)
    trackers.check_available(recipe.output.trackers)
    if recipe.train.compile:
        from homelab_ft.model import compiling

        compiling.check_available(device_type=device_type)
    resume_from = rundir.check_run_dir(recipe)
    if resume_from is not None:  # before anything is built or written (the run's recipe.yaml included)
        from homelab_ft.store import checkpoint

        checkpoint.check_settings(resume_from, settings=checkpoint.built_from(recipe, method=rung.method),
                                  adapters=rung.adapters_enabled)
    where = locate(recipe.model.path)
    model_dir = loading.resolve_model_dir(where)  # converts a GGUF once; a damaged one is refused
    files.check_model_files(model_dir, converted=where.is_gguf)
    files.check_tokenizer(recipe.model.tokenizer, model_dir)
    config = json.loads((model_dir / "config.json").read_text(encoding="utf-8"))
    hf_config = family.config_of(model_dir, trust_remote_code=recipe.model.trust_remote_code)
    family.check(hf_config, attn_implementation=recipe.model.attn_implementation,
                 activation_checkpointing=rung.activation_checkpointing, sharded=rung.fsdp_enabled, images=rung.images)
    if rung.images:
        check_images(model_dir, hf_config, recipe)
    if rung.quantized_enabled:
        from homelab_ft.model import quant

        quant.check_quantizable(config, recipe.quant, device=device_type, images=rung.images)
        if rung.fsdp_enabled:
            from homelab_ft.distributed import sharded_qlora

            sharded_qlora.check_model(config, recipe, rung=rung, device_type=device_type)
    if rung.adapters_enabled:
        check_lora_targets(model_dir, recipe, images=rung.images)
    check_attention(recipe.model.attn_implementation, device_type=device_type)
    if rung.adapters_enabled and recipe.lora.use_dora and (rung.quantized_enabled or rung.fsdp_enabled):
        # loading.initial_adapters draws every adapter from one seed on CPU, which DoRA's magnitude
        # vector (the norm of the whole base weight) cannot be: refused here, before the run exists.
        raise UserError(f"lora.use_dora: DoRA is not supported with {rung.label} (its magnitude needs the whole base "
                        "weight at init); set lora.use_dora=false, or use method=lora with sharding.strategy=no_shard")
    if rung.pipeline_enabled:
        from homelab_ft.distributed import stages

        # only 4-bit experts are refused in a stage (refusals.four_bit_experts): the plan's facts tell
        stages.check_recipe(recipe, rung=rung, config=config,
                            moe_experts=rung.quantized_enabled and facts.has_fused_experts)
    return Inputs(model_dir=model_dir, resume_from=resume_from, facts=facts)


# --------------------------------------------------------------------------------------------
# the model folder


def check_attention(implementation: str, *, device_type: str) -> None:
    """FlashAttention 2 needs its package and a CUDA device; without them transformers raises from
    inside `from_pretrained`, after the run directory exists. Refused here instead, with the fix."""
    if implementation != "flash_attention_2":
        return
    from transformers.utils import is_flash_attn_2_available

    if device_type != "cuda":
        raise UserError(f"model.attn_implementation: flash_attention_2 runs on CUDA GPUs only, not {device_type}; "
                        "use sdpa (the default) or eager")
    if not is_flash_attn_2_available():
        raise UserError("model.attn_implementation: flash_attention_2 needs the flash-attn package, which is not "
                        "installed (pip install flash-attn --no-build-isolation); or use sdpa (the default)")


def check_host_ram(*, device_type: str, available_bytes: int, offloaded_bytes: int = 0,
                   table_bytes: int = 0) -> None:
    """What the run keeps in host RAM for its GPUs, over every local rank (the planner's figures):
    the checkpointed block inputs of activation offload (`offloaded_bytes`) and the input embedding
    table of train.embedding_offload (`table_bytes`). Refused when this machine has not that much
    available now, instead of letting the kernel's OOM killer end the run mid-step; the line names
    each part and its switch. On the CPU nothing is offloaded."""
    if device_type != "cuda" or not available_bytes or offloaded_bytes + table_bytes <= available_bytes:
        return
    parts = [f"{what} {nbytes / 2**30:.1f} GiB" for what, nbytes in
             (("the checkpointed block inputs (train.activation_offload)", offloaded_bytes),
              ("the input embedding table (train.embedding_offload)", table_bytes)) if nbytes]
    fixes = [fix for fix, nbytes in (("train.activation_offload=false", offloaded_bytes),
                                     ("train.embedding_offload=false", table_bytes)) if nbytes]
    raise UserError(f"host RAM: the run keeps {' + '.join(parts)} in host RAM on this node, but only "
                    f"{available_bytes / 2**30:.1f} GiB is available; set {' or '.join(fixes)}, free host memory, "
                    "or lower micro_batch_size/max_length")


def check_images(model_dir: Path, config, recipe: Recipe) -> None:
    """An image run (data.images): transformers builds an image-text model for the checkpoint
    (rules/vision.py) and its processor loads from the folder, offline (model/processor.py)."""
    from homelab_ft.model import processor
    from homelab_ft.rules import vision

    if why := vision.images_refusal(config, images=True):
        raise UserError(why)
    processor.load_processor(model_dir, config, trust_remote_code=recipe.model.trust_remote_code)


def check_lora_targets(model_dir: Path, recipe: Recipe, *, images: bool = False) -> None:
    """Every name in `lora.target_modules` matches a module of the architecture.

    PEFT only complains when *no* target matches, so one misspelt name in a list silently trains
    fewer layers; here each must match (PEFT's rule: the module's name equals it or ends with
    `.name`). Checked on a meta-device skeleton built from config.json: no weights are read.
    """
    targets = recipe.lora.target_modules
    if isinstance(targets, str):
        return  # all-linear
    import torch
    from transformers import AutoConfig

    from homelab_ft.rules import vision

    config = AutoConfig.from_pretrained(model_dir, trust_remote_code=recipe.model.trust_remote_code)
    with torch.device("meta"):
        skeleton = vision.auto_class(config, images=images).from_config(
            config, trust_remote_code=recipe.model.trust_remote_code)
    names = [name for name, _ in skeleton.named_modules() if name]
    leaves = sorted({name.rsplit(".", 1)[-1] for name, module in skeleton.named_modules()
                     if isinstance(module, torch.nn.Linear)})
    for target in targets:
        if not any(name == target or name.endswith("." + target) for name in names):
            near = difflib.get_close_matches(target, leaves, n=1, cutoff=0.6)
            fix = f"did you mean {near[0]}?" if near else f"linear layers here: {', '.join(leaves)}"
            raise UserError(f"lora.target_modules: {target!r} matches no module of {config.model_type}; {fix}")


# --------------------------------------------------------------------------------------------
# the data, the device, and torchrun's workers


def check_data(recipe: Recipe, inputs: Inputs, *, base_dir: Path | None) -> None:
    """Read, validate and tokenise the data once in the launching process: a bad row stops the run
    before any worker starts, and the workers then read the tokenised cache."""
    from homelab_ft.data import prepare_for

    check_data_unchanged(recipe, inputs, base_dir=base_dir)
    tokenizer, processor = loading.load_tokenizer_and_processor(recipe.model, inputs.model_dir, images=recipe.data.images)
    prepare_for(recipe, tokenizer, base_dir=base_dir, processor=processor)


def check_image_rows(data, *, rung: Rung, recipe: Recipe, model_dir: Path) -> None:
    """Every rank must run the vision tower together when its parameters are sharded (FSDP2 gathers
    each vision block inside the tower's forward: a rank whose micro-batch held no image would skip
    those collectives and the job would hang) or when some of them train under DDP (a replica that
    did not run them would leave their gradients unreduced and DDP stops). Then every row of both
    splits needs an image; one process, and DDP with the tower frozen, take text rows beside image rows."""
    if not (rung.images and rung.world_size > 1):
        return
    if not rung.fsdp_enabled and not _trains_vision(recipe, model_dir=model_dir):
        return
    why = ("FSDP2 runs the vision tower on every rank together" if rung.fsdp_enabled else
           "lora.target_modules trains vision layers, whose gradients every DDP replica must make")
    for split, rows in (("training", data.train), ("held-out", data.eval)):
        missing = 0 if rows is None else sum(1 for n in rows["num_images"] if n == 0)
        if missing:
            raise UserError(f"sharding.strategy={rung.strategy} with data.images: {missing} {split} row(s) hold no "
                            f"image, and {why}; give every row an image, or train text rows beside image rows "
                            "on one process or with DDP and the tower frozen")


def _trains_vision(recipe: Recipe, *, model_dir: Path) -> bool:
    """Whether `lora.target_modules` (a list) names a layer of the vision side: on a meta skeleton of
    the image-text model, by PEFT's rule (the module's name is the target or ends with `.` + it)."""
    targets = recipe.lora.target_modules
    if isinstance(targets, str):
        return False  # all-linear leaves the vision side out (rules/lora_targets.py)
    import torch
    from transformers import AutoConfig

    from homelab_ft.rules import vision

    config = AutoConfig.from_pretrained(model_dir, trust_remote_code=recipe.model.trust_remote_code)
    with torch.device("meta"):
        skeleton = vision.auto_class(config, images=True).from_config(config)
    prefixes = vision.vision_prefixes(skeleton)
    return any(vision.is_vision_module(name, prefixes) and vision.listed(name, targets) for name, _ in skeleton.named_modules())


def check_data_unchanged(recipe: Recipe, inputs: Inputs, *, base_dir: Path | None) -> dict:
    """The data's fingerprint (recorded in every checkpoint); a resume whose data differs from the
    checkpoint's is refused here, before anything runs, unless train.allow_data_change says go on."""
    from homelab_ft.data import fingerprint
    from homelab_ft.store import checkpoint

    current = fingerprint.of(recipe.data, base_dir=base_dir)
    if inputs.resume_from is not None:
        recorded = checkpoint.read_state(inputs.resume_from).data_fingerprint
        fingerprint.check_resume(recorded, current, checkpoint=inputs.resume_from,
                                 allow_change=recipe.train.allow_data_change)
    return current


def inputs_in_worker(recipe: Recipe, handoff) -> Inputs:
    """A torchrun worker's inputs, from the handoff (cluster/handoff.py) of the process that started
    it or of `homelab-ft launch` on the head node: that process checked them (including the hashes
    of the checkpoint it chose to resume from), so nothing is read again; on another node the paths
    are the head's, which docs/multi-node.md asks to be the same on every machine."""
    return Inputs(model_dir=Path(handoff.model_dir),
                  resume_from=Path(handoff.resume_from) if handoff.resume_from else None, facts=handoff.facts)
