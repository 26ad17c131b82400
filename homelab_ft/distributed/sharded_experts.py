"""4-bit MoE experts in the meta-built 4-bit base: packed stacks filled block by block from the
safetensors, whole on one process and DDP, split along experts by FSDP2.

Why a meta build and a fill for every rung, one process included: bitsandbytes' `from_pretrained`
quantizes `nn.Linear` layers only, so the fused 3-D experts (97% of Qwen3-30B-A3B's block weights,
~57 GB in bf16) arrived whole in the compute dtype on the device before `moe_experts.quantize`
packed them: an OOM at load on the 24 GB card whose plan says 19.3 GiB. Keeping `from_pretrained`
for the dense part and the experts out of it has no hook in transformers 5.24 (a checkpoint key it
does not load leaves the parameter to be initialised at full size, as a missing weight). So a
model with fused experts is built as the sharded 4-bit base is (sharded_qlora.py, which calls
this module's `fill`): the architecture on meta, linears as 4-bit layers and each expert projection
as an empty packed stack `<name>_4bit` [E, n, 1] (model/quant.py `to_4bit_layers`, through
`moe_experts.pack_meta`; the layers are the model's, this module fills them), `to_empty`, then each block
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

import torch
from torch import nn

from homelab_ft.distributed.sharded_loading import copy_into_shard
from homelab_ft.model import moe_experts


def fill(module: nn.Module, attr: str, full: torch.Tensor, *, compute_device: torch.device) -> int:
    """Quantize the read projection `full` (its 3-D checkpoint layout, on the host) expert by expert,
    keep every expert's QuantState, copy this rank's experts into the shard. Returns the bytes of
    temporaries held at once (the read stack, one expert in the compute dtype, the packed stack)."""
    name = attr.removesuffix(moe_experts.PACKED_SUFFIX)
    param = getattr(module, attr)
    stack, states = moe_experts.quantize_stack(module, full, name=name, device=compute_device)
    moe_experts.set_states(module, name, states)
    copy_into_shard(param, stack)
    return _nbytes(full) + moe_experts.matrix_nbytes(module, name) + _nbytes(stack)


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()
