"""4-bit MoE experts in the meta-built 4-bit base: packed stacks filled block by block from the
safetensors, whole on one process and DDP, split along experts by FSDP2.

Why a meta build and a fill for every rung, one process included: bitsandbytes' `from_pretrained`
quantizes `nn.Linear` layers only, so the fused 3-D experts (97% of Qwen3-30B-A3B's block weights,
~57 GB in bf16) arrived whole in the compute dtype on the device before `moe_experts.quantize`
packed them: an OOM at load on the 24 GB card whose plan says 19.3 GiB. Keeping `from_pretrained`
for the dense part and the experts out of it has no hook in transformers 5.24 (a checkpoint key it
does not load leaves the parameter to be initialised at full size, as a missing weight). So a
model with fused experts is built as the sharded 4-bit base is (sharded_qlora.py, which calls
this module): the architecture on meta, linears as 4-bit layers and each expert projection as an
empty packed stack `<name>_4bit` [E, n, 1] (`moe_experts.pack_meta`), `to_empty`, then each block
read through checkpoint_keys (which stacks transformers' per-expert checkpoint keys into the fused
projection), quantized one expert at a time (`moe_experts.quantize_stack`, bitsandbytes' own
`quantize_4bit` on each [out, in] slice, the bytes of the quantize-after-load path exactly) and
copied into this rank's shard: the whole stack where nothing shards. One code path for 1 process,
DDP and FSDP2; only the storage dtype differs: uint8 where nothing shards (the dtype of the
quantize-after-load path), the compute dtype under FSDP2, so that `fully_shard` splits the stack
along experts and all-gathers it before each block (MixedPrecisionPolicy.param_dtype = storage
dtype, sharded_qlora.check_recipe: a cast would rewrite the bytes as numbers).

Held during the fill beyond the packed model: one projection's stacked experts as the checkpoint
stores them (transformers' converter stacks gate and up, so about twice gate_up for a moment), on
the host, one expert's matrix in the compute dtype on the compute device, and the projection's
packed stack. Every expert's QuantState stays whole on the module on every rank: it describes the
whole expert, which the gathered stack holds whole.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from homelab_ft.distributed.sharded_loading import copy_into_shard
from homelab_ft.errors import UserError
from homelab_ft.model import moe_experts

log = logging.getLogger(__name__)

PACKED_SUFFIX = "_4bit"
"""moe_experts' packed stack of projection `<name>` is the parameter `<name>_4bit`."""


def check_shardable(model: nn.Module, *, storage_bytes: int, shard_size: int) -> None:
    """UserError, before anything is loaded, for an expert projection the packed stack cannot hold:
    one expert's 4-bit bytes must fill whole storage elements (bitsandbytes' bytes are viewed as
    that dtype), and FSDP2 splits the stack along experts, so every rank needs at least one."""
    for module_name, module in moe_experts.fused_experts(model).items():
        for name in moe_experts.projections(module):
            experts, fan_in, fan_out = moe_experts.expert_shape(module, name)
            nbytes = (fan_in * fan_out + 1) // 2
            if nbytes % storage_bytes:
                raise UserError(f"method=qlora with sharding: {module_name}.{name} ({fan_in} x {fan_out} per expert) packs "
                                f"into {nbytes} bytes, not a multiple of the {storage_bytes}-byte storage element; use "
                                "sharding.strategy=no_shard or method=lora")
            if experts < shard_size:
                raise UserError(f"method=qlora with sharding: {module_name} has {experts} experts, fewer than the "
                                f"{shard_size} ranks FSDP2 splits them over; use fewer processes or sharding.strategy=no_shard")


def pack(model: nn.Module, quant_cfg, *, storage_dtype: torch.dtype) -> int:
    """Every fused-experts module of a meta-device model to empty packed stacks (moe_experts.pack_meta)."""
    found = moe_experts.fused_experts(model)
    for module in found.values():
        moe_experts.pack_meta(module, quant_type=quant_cfg.quant_type, double_quant=quant_cfg.double_quant,
                              storage_dtype=storage_dtype)
    if found:
        log.info("4-bit experts: %d fused-experts modules packed (%s)", len(found), quant_cfg.quant_type)
    return len(found)


def is_packed_stack(module: nn.Module, attr: str) -> bool:
    return moe_experts.is_packed(module) and attr.endswith(PACKED_SUFFIX)


def checkpoint_attr(module: nn.Module, attr: str) -> str:
    """The parameter name the checkpoint (through checkpoint_keys) holds for `module.attr`: the
    fused projection for a packed stack, else `attr` itself."""
    return attr.removesuffix(PACKED_SUFFIX) if is_packed_stack(module, attr) else attr


def fill(module: nn.Module, attr: str, full: torch.Tensor, *, compute_device: torch.device) -> int:
    """Quantize the read projection `full` (its 3-D checkpoint layout, on the host) expert by expert,
    keep every expert's QuantState, copy this rank's experts into the shard. Returns the bytes of
    temporaries held at once (the read stack, one expert in the compute dtype, the packed stack)."""
    name = attr.removesuffix(PACKED_SUFFIX)
    param = getattr(module, attr)
    stack, states = moe_experts.quantize_stack(module, full, name=name, device=compute_device)
    moe_experts.set_states(module, name, states)
    copy_into_shard(param, stack)
    return _nbytes(full) + moe_experts.matrix_nbytes(module, name) + _nbytes(stack)


def state_nbytes(module: nn.Module, attr: str) -> int:
    """Bytes of one projection's QuantStates (absmax, code, and the nested ones): replicated on every rank."""
    total = 0
    for state in moe_experts.states(module, attr.removesuffix(PACKED_SUFFIX)):
        tensors = [state.absmax, state.code]
        if state.state2 is not None:
            tensors += [state.state2.absmax, state.state2.code, state.offset]
        total += sum(_nbytes(t) for t in tensors)
    return total


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()
