"""The adapters on MoE experts (model/moe_experts.py) in an export: PEFT's loader and merge never see
them, so they are loaded onto base + adapter here and merged into the base's own checkpoint layout.

The adapter folder keeps them beside PEFT's file (store/model_state.EXPERT_ADAPTERS), keyed
`<experts module>.expert_lora.<projection>.lora_A|lora_B`. The merge adds scaling * B_e @ A_e to
each expert's weight of the fused model tensor (`<experts module>.<projection>`, [E, out, in], or
[E, in, out] where the module is transposed: gpt-oss), then writes the checkpoint keys transformers'
`revert_weight_conversion` makes of it (checkpoint_keys.as_saved): a released Qwen3-MoE's per-expert
`experts.3.gate_proj.weight`, as `save_pretrained` would. One converter unit (one layer's stack) is
in memory at a time, as long as the file being written needs it.

Routers trained in full (`lora.train_router`, store/model_state.ROUTERS) are plain tensors of the
base: they replace its checkpoint tensor of the same parameter, one to one, and go onto base +
adapter for the logit check.
"""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import load_file
from torch import nn

from homelab_ft.model import moe_experts
from homelab_ft.store.model_state import EXPERT_ADAPTERS, EXPERT_LORA, PEFT_PREFIX, ROUTERS


def present(adapter_dir: Path) -> bool:
    return (Path(adapter_dir) / EXPERT_ADAPTERS).is_file()


def outside_peft(adapter_dir: Path) -> str | None:
    """What of this adapter PEFT's format cannot hold (for --adapter-only and the adapter GGUF), or None."""
    if present(adapter_dir):
        return "the adapters on MoE experts"
    if (Path(adapter_dir) / ROUTERS).is_file():
        return "the trained MoE routers (lora.train_router)"
    return None


def trained_routers(adapter_dir: Path) -> dict[str, torch.Tensor]:
    """lora.train_router's router parameters by model parameter name ({} when it was off)."""
    path = Path(adapter_dir) / ROUTERS
    return load_file(str(path)) if path.is_file() else {}


def attach_routers(model: nn.Module, adapter_dir: Path) -> None:
    """The trained routers into `model` (base + adapter, PEFT-wrapped), in place of the base's."""
    params = dict(model.named_parameters())
    with torch.no_grad():
        for name, tensor in trained_routers(adapter_dir).items():
            param = params.get(PEFT_PREFIX + name, params.get(name))
            if param is None or param.shape != tensor.shape:
                raise ValueError(f"a trained router {name} {tuple(tensor.shape)} the base lacks or shapes differently")
            param.copy_(tensor.to(param.dtype))


def router_keys(adapter_dir: Path, keys) -> dict[str, torch.Tensor]:
    """Base checkpoint key -> the trained router tensor that replaces it (a router is one checkpoint
    tensor, renamed or not: checkpoint_keys.sources)."""
    out = {}
    for name, tensor in trained_routers(adapter_dir).items():
        if name not in keys.names() or keys.converted(name):
            raise ValueError(f"the trained router {name} is not one tensor of the base checkpoint")
        out[keys.sources(name)[0]] = tensor
    return out


def by_projection(adapter_dir: Path) -> dict[str, dict[str, torch.Tensor]]:
    """`<experts module>.<projection>` (the fused model tensor) -> {"A": [E, r, in], "B": [E, out, r]}."""
    out: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in load_file(str(Path(adapter_dir) / EXPERT_ADAPTERS)).items():
        module, rest = key.split(EXPERT_LORA)
        projection, part = rest.split(".")
        out.setdefault(f"{module}.{projection}", {})[part.removeprefix("lora_")] = tensor
    return out


def attach(model: nn.Module, adapter_dir: Path, *, cfg: dict) -> None:
    """The saved expert adapters onto `model` (base + PEFT adapter), so its forward is base + all adapters."""
    if not present(adapter_dir):
        return
    saved = by_projection(adapter_dir)
    found = moe_experts.fused_experts(model)
    for name, module in found.items():
        moe_experts.attach_lora(module, r=cfg["r"], alpha=cfg["lora_alpha"], dropout=0.0,
                                rslora=bool(cfg.get("use_rslora")), dtype=next(module.parameters()).dtype)
        for projection in moe_experts.projections(module):
            parts = saved.pop(f"{_base(name)}.{projection}")
            with torch.no_grad():
                module.expert_lora[projection].lora_A.copy_(parts["A"])
                module.expert_lora[projection].lora_B.copy_(parts["B"])
    if saved:
        raise ValueError(f"expert adapters for modules the base lacks: {sorted(saved)[:2]}")


def merge_in_memory(model: nn.Module) -> None:
    for module in moe_experts.fused_experts(model).values():
        if hasattr(module, "expert_lora"):
            moe_experts.merge_lora(module)


def _base(name: str) -> str:
    return name.removeprefix("base_model.model.")


class MergedUnits:
    """Checkpoint key -> base + expert adapters, in the checkpoint's layout, computed per converter unit."""

    def __init__(self, adapter_dir: Path, keys, *, factor: float):
        self.keys, self.factor = keys, factor
        self.adapters = by_projection(adapter_dir) if present(adapter_dir) else {}
        self.owner = {src: name for name in self.adapters for src in keys.sources(name)}
        self.cache: dict[str, torch.Tensor] = {}

    def __contains__(self, key: str) -> bool:
        return key in self.owner

    def pop(self, key: str) -> torch.Tensor:
        if key not in self.cache:
            self.cache.update(self._unit(self.owner[key]))
        return self.cache.pop(key)

    def _unit(self, name: str) -> dict[str, torch.Tensor]:
        unit = self.keys.unit(name)
        names = sorted(n for n in self.keys.names() if self.keys.unit(n) == unit)
        tensors = dict(self.keys.tensors(names))
        for target in names:
            if target in self.adapters:
                tensors[target] = tensors[target].float() + self._delta(target)
        return self.keys.as_saved(tensors)

    def _delta(self, name: str) -> torch.Tensor:
        a, b = self.adapters[name]["A"].float(), self.adapters[name]["B"].float()
        delta = torch.einsum("eor,eri->eoi", b, a) * self.factor
        module = self.keys.model.get_submodule(name.rpartition(".")[0])
        return delta.transpose(1, 2) if module.is_transposed else delta
