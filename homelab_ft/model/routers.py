"""`lora.train_router: true`: the routers of an MoE model train in full beside the adapters.

Which modules are routers is homelab_ft/rules/moe_routers.py's rule (the planner prices the same ones).
No LoRA goes on them (a router is [experts, hidden], 128 x 2048 on Qwen3-30B-A3B: an adapter would
save nothing); they train as plain parameters in the adapters' dtype, as PEFT keeps adapters
(fp32, or bf16 with `lora.dtype: compute` on a bf16 base), never below the dtype transformers
loaded them in (DeepSeek-V3's and GLM-4-MoE's gates are kept in fp32 by `_keep_in_fp32_modules`).
The base around them computes in its own dtype, so a router this module moved to fp32 casts its
input up and its floating outputs (logits, routing weights) back, as PEFT's LoRA layers cast around
their adapters: the experts then see routing weights in the compute dtype, as with a frozen router.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from homelab_ft.rules import moe_routers

log = logging.getLogger(__name__)

_INPUT_DTYPE = "_homelab_router_input_dtype"


def train_routers(model: nn.Module, *, dtype: torch.dtype) -> int:
    """Make every router's own parameters trainable in `dtype` (or fp32 where loaded so); returns
    how many parameters that is. A model without routers is refused in one line."""
    found = moe_routers.routers(model)
    if not found:
        raise moe_routers.refuse_dense(f"({getattr(model.config, 'model_type', type(model).__name__)})")
    count = 0
    for module in found.values():
        recast = False
        for param in module.parameters(recurse=False):
            if param.dtype not in (torch.float32, dtype):
                param.data, recast = param.data.to(dtype), True
            param.requires_grad_(True)
            count += param.numel()
        if recast:  # a router transformers keeps in fp32 already casts for itself
            module.register_forward_pre_hook(_cast_input)
            module.register_forward_hook(_cast_output)
    log.info("lora.train_router: %d routers trained in full (%d parameters, %s)", len(found), count,
             ", ".join(sorted({str(p.dtype).removeprefix("torch.") for m in found.values()
                               for p in m.parameters(recurse=False)})))
    return count


def _cast_input(module: nn.Module, args: tuple) -> tuple:
    weight = next(module.parameters(recurse=False))
    floating = [a for a in args if isinstance(a, torch.Tensor) and a.is_floating_point()]
    setattr(module, _INPUT_DTYPE, floating[0].dtype if floating else None)
    return tuple(a.to(weight.dtype) if isinstance(a, torch.Tensor) and a.is_floating_point() else a for a in args)


def _cast_output(module: nn.Module, args: tuple, output):
    dtype = getattr(module, _INPUT_DTYPE, None)
    if dtype is None:
        return output

    def cast(value):
        return value.to(dtype) if isinstance(value, torch.Tensor) and value.is_floating_point() else value

    return tuple(cast(v) for v in output) if isinstance(output, tuple) else cast(output)
