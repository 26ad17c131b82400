"""`train.embedding_offload`: the frozen input embedding table in host RAM, its lookups on the host.

Whether it applies is the chosen rung's `embedding_offload`, set by homelab_ft/rules/embedding_offload.py's
rule where the planner built the rung it priced; this module does it. The table (and its module's buffers, e.g. Gemma's embed_scale) moves to host
memory; two hooks on the embedding module send the token ids to the host and the
looked-up rows ([batch, seq, hidden]) to the GPU, the only bytes that cross PCIe (8 MiB per
2048-token row at hidden 2048 in bf16, against a 0.58 GiB table for Qwen3-30B-A3B). The module
stays where it is, with its parameter under its own name, so checkpoints, parameter counts and
every caller of `get_input_embeddings` see the model they always saw; the export reads the base
from its safetensors and the adapters from the run, never this split model.

The rows' hook runs before any other forward hook on the module (prepend): activation
checkpointing's `enable_input_require_grads` then marks the GPU copy, a leaf, so backward sends
nothing back to the host (the frozen table needs no gradient).
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from homelab_ft.recipe.config import Recipe
from homelab_ft.rules import embedding_offload
from homelab_ft.rung import Rung

log = logging.getLogger(__name__)

HOST = torch.device("cpu")


def apply(model: nn.Module, recipe: Recipe, *, rung: Rung, device: torch.device) -> bool:
    """Keep `model`'s input embedding table on the host when the rung says so (the plan decided it:
    rules/embedding_offload.placed); whether it did."""
    if not rung.embedding_offload or device.type != "cuda":  # off a GPU there is no device memory to save
        return False
    base = _base(model)
    nbytes = keep_on_host(base, base.get_input_embeddings(), device=device)
    log.info("%s=%s: the input embedding table (%.2f GiB) is in host RAM; only its looked-up rows go to %s",
             embedding_offload.KEY, recipe.train.embedding_offload, nbytes / 1024**3, device)
    return True


def _base(model: nn.Module) -> nn.Module:
    """The transformers model under PEFT's wrapper."""
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def keep_on_host(model: nn.Module, embed: nn.Module, *, device: torch.device) -> int:
    """Move `embed` (a module of `model`) to host memory and hook it so it still takes ids and gives
    rows on `device`; the bytes moved. Its weight must be frozen: a trained table would need its
    gradient and optimizer state on the host too."""
    if any(p.requires_grad for p in embed.parameters()):
        raise AssertionError("embedding_offload.decide kept a trained embedding table on the host")
    pin = device.type == "cuda"
    embed.to(HOST)
    embed.register_forward_pre_hook(_ids_to_host)
    embed.register_forward_hook(lambda module, args, rows: _to_device(rows, device=device, pin=pin), prepend=True)
    _not_first(model, embed)
    if pin:
        torch.cuda.empty_cache()  # the table's old GPU block goes back to the driver, not the allocator's cache
    return sum(p.numel() * p.element_size() for p in embed.parameters())


def _to_device(rows: torch.Tensor, *, device: torch.device, pin: bool) -> torch.Tensor:
    """The looked-up rows on `device`. On CUDA they are pinned first (8 MiB per 2048-token row at
    hidden 2048, one host memcpy), so the copy is an asynchronous DMA; torch's pinned-memory
    allocator keeps the buffer until the copy is done. The table itself stays pageable: what crosses
    PCIe is the rows, never the table, so pinning its 0.58 GiB would only lock host RAM."""
    return (rows.pin_memory() if pin else rows).to(device, non_blocking=pin)


def _ids_to_host(module: nn.Module, args: tuple) -> tuple:
    ids, *rest = args
    return (ids.to(HOST), *rest)


def _not_first(model: nn.Module, embed: nn.Module) -> None:
    """Put `embed` last among its parent's children. transformers' `PreTrainedModel.device` is the first
    parameter's device, usually the input embeddings', and generate moves its inputs there
    (generation/utils.py, `prepare_inputs_for_generation`, step 6); the table on the host would send
    the sampling prompts there. The children's order is not otherwise read: forward calls them by name.
    (`PreTrainedModel.dtype`, the first floating parameter's, may then be an fp32 adapter's on a 4-bit
    base; transformers reads it only to build a static cache, which the samples do not use.)"""
    for parent in list(model.modules()):
        for key in [k for k, child in parent._modules.items() if child is embed]:
            parent._modules[key] = parent._modules.pop(key)
    first = next(model.parameters())
    if first.device.type == HOST.type and any(p.device.type != HOST.type for p in model.parameters()):
        raise AssertionError(f"{type(model).__name__}'s first parameter is still on the host")
