"""Activation offload (`train.activation_offload`): what autograd saves for backward waits in host RAM.

With activation checkpointing, what a forward leaves on the GPU is mostly one tensor per block:
the block's input, saved by the non-reentrant checkpoint (`_NoopSaveInputs`) for the recompute.
That is layers x tokens x hidden in the activation dtype: 1.07 GB for Llama-3.1-8B at 2 x 2048
tokens in bf16 (docs/ladder.md), 8.6 GB at 16k tokens. Under these saved-tensor hooks each such
tensor is copied to host memory as it is saved (pinned on CUDA, so the copy is an asynchronous DMA)
and copied back when backward first needs it, one block at a time.

torch's `save_on_cpu` does the same but also copies parameters that ops save (a LoRA base weight,
the LM head), which are on the GPU anyway; here parameters and small tensors (< 1 MiB: masks,
RoPE tables, scalars) stay where they are.
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn

MIN_OFFLOAD_BYTES = 1 << 20


@contextlib.contextmanager
def activations_on_host(*, enabled: bool, pin_memory: bool):
    """Around a forward: saved activations go to host memory and come back in backward."""
    if not enabled:
        yield
        return

    def pack(tensor: torch.Tensor):
        if isinstance(tensor, nn.Parameter) or tensor.numel() * tensor.element_size() < MIN_OFFLOAD_BYTES:
            return tensor
        host = torch.empty(tensor.size(), dtype=tensor.dtype, layout=tensor.layout, pin_memory=pin_memory)
        host.copy_(tensor, non_blocking=pin_memory)
        return tensor.device, host

    def unpack(packed):
        if isinstance(packed, torch.Tensor):
            return packed
        device, host = packed
        return host.to(device, non_blocking=pin_memory)

    with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
        yield
