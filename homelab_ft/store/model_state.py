"""What of a model a checkpoint holds: its trainable tensors, the optimizer's state in DCP's layout,
and the PEFT adapter written beside them (checkpoint.py saves and loads these)."""

from __future__ import annotations

from pathlib import Path

import torch
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

from homelab_ft import fsio
from homelab_ft.rules.moe_routers import router_parameters
from homelab_ft.store import ranks

NESTED_KEY = "optim.param_groups.0.lr"
"""In a checkpoint whose optimizer state is nested (param groups by index); a flattened one keys
them `optim.param_groups.<parameter name>.lr`."""


EXPERT_ADAPTERS = "expert_adapters.safetensors"
"""Beside PEFT's adapter file: the adapters on MoE experts (model/moe_experts.py), which PEFT does
not know; keyed `<experts module>.expert_lora.<projection>.lora_A|lora_B` ([E, r, in], [E, out, r]),
scaled as the adapter_config's alpha / r. PEFT's own loader never reads this file."""

EXPERT_LORA = ".expert_lora."
"""In the parameter names of moe_experts' adapters."""

ROUTERS = "router_weights.safetensors"
"""Beside PEFT's adapter file, with `lora.train_router`: the trained routers' own parameters in
full (moe_routers.router_parameters), keyed by the transformers model's parameter names
(`model.layers.0.mlp.gate.weight`). The merged export writes them in place of the base's."""

PEFT_PREFIX = "base_model.model."


def optimizer_state(model, optimizer, *, flat: bool) -> dict:
    """The optimizer's state for DCP; `flat` keys the param-group settings by parameter name.

    Pipeline stages hold different parameters in their group 0, and DCP kept one rank's
    `param_groups.0` for all (measured: a resume lost `lr` on stage 0); by name every stage's
    entries are its own and a 2-stage checkpoint loads on one process (torchtitan saves so). Only
    then: each setting of each parameter is an entry of its own, ~1.4 KB apiece (measured: a
    40-parameter AdamW state grew from 0.24 to 0.85 MB), which the other layouts do not need."""
    return get_optimizer_state_dict(model, optimizers(optimizer),
                                    options=StateDictOptions(flatten_optimizer_state_dict=flat))


def differs_across_ranks(names: list[str]) -> bool:
    """Whether ranks hold different trainable tensors (pipeline stages), from their names only."""
    parts = ranks.all_gather(names)
    return any(part != parts[0] for part in parts)


def optimizers(optimizer):
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
    experts = {name.removeprefix(PEFT_PREFIX): full.pop(name) for name in list(full) if EXPERT_LORA in name}
    routers = {name.removeprefix(PEFT_PREFIX): full.pop(name) for name in router_parameters(inner) if name in full}
    adapter = get_peft_model_state_dict(inner, state_dict=full)
    if differs_across_ranks(sorted(adapter)):  # pipeline stages: each rank holds its own blocks' adapters
        adapter = {name: t for part in ranks.all_gather(adapter) for name, t in part.items()}
    if ranks.rank() != 0:
        return
    out_dir.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in adapter.items()}, out_dir / "adapter_model.safetensors")
    if experts:
        save_file({k: v.contiguous() for k, v in experts.items()}, out_dir / EXPERT_ADAPTERS)
    if routers:
        save_file({k: v.contiguous() for k, v in routers.items()}, out_dir / ROUTERS)
    inner.peft_config["default"].save_pretrained(out_dir)
    fsio.as_folder_files(*(p for p in out_dir.iterdir() if p.suffix == ".safetensors"))  # what export copies
