"""FSDP-QLoRA: a 4-bit base sharded over ranks with FSDP2, filled one block at a time.

Why bitsandbytes with a float `quant_storage` (measurements in docs/qlora.md): bitsandbytes packs
two 4-bit values per byte; with `quant_storage=float32` (or bf16) those bytes are *viewed* as a
float tensor of shape (out * in / (2 * itemsize), 1), which `fully_shard` splits on dim 0 like any
other parameter. FSDP2 all-gathers the bytes back before each block's forward, and the matmul
dequantizes the whole weight with its quantisation state (absmax, code, shape), which stays with
the module and always describes the *whole* weight. Two rules keep the bytes intact:
`MixedPrecisionPolicy(param_dtype=...)` must equal the storage dtype (any cast rewrites the packed
bytes as numbers), and nothing may ever add to or scale the weight (it is frozen).

The same `bnb.functional.quantize_4bit` call quantises here and in the one-GPU path
(`from_pretrained(quantization_config=...)`), so the sharded forward equals the unsharded one
exactly (tests/distributed/test_qlora_fsdp.py).

Loading never holds the model: the architecture is built on the meta device with 4-bit layers of
the packed shape (the layers are the model's: model/quant.py `to_4bit_layers`; this module fills
them), LoRA is attached, FSDP2 shards it, `to_empty` allocates only this rank's shards,
and then each transformer block is read from the safetensors files tensor by tensor, quantised
(every rank the same, deterministic), this rank's slice copied into its shard, and the rest freed.
Peak: this rank's shards + the quantisation states + one tensor in the compute dtype and its
packed copy (measured by `load_peak` in the same test). Fused MoE experts are packed stacks split
along experts, filled one expert at a time (sharded_experts.py, which one process and DDP use too).
"""

from __future__ import annotations

import gc
import logging
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from homelab_ft.distributed.sharded_loading import copy_into_shard
from homelab_ft.errors import UserError
from homelab_ft.model import moe_experts, quant
from homelab_ft.model.checkpoint_keys import CheckpointKeys, base_name, is_adapter

log = logging.getLogger(__name__)


def check_recipe(recipe, *, compute_dtype: torch.dtype) -> None:
    """The recipe-level refusals of the sharded 4-bit base (one line each, before anything is made)."""
    if recipe.quant.bits != 4:
        raise UserError("quant.bits=8 with a sharded strategy: LLM.int8 weights (int8 rows + fp16 outliers) cannot "
                        "be split by FSDP2; use quant.bits=4, or sharding.strategy=no_shard")
    if compute_dtype == torch.float16:
        # One-GPU QLoRA upcasts fp16's non-quantized weights to fp32 (quant.prepare_for_training); FSDP2's
        # single param_dtype, which must be the 4-bit storage dtype, would run them all in fp16.
        raise UserError("quant.compute_dtype=float16 with a sharded strategy: every weight would be gathered "
                        "in fp16, whose range overflows on LLM activations; use quant.compute_dtype=bfloat16 (or auto)")
    if recipe.sharding.param_dtype != "auto" and getattr(torch, recipe.sharding.param_dtype) != compute_dtype:
        raise UserError(f"sharding.param_dtype={recipe.sharding.param_dtype} with method=qlora: the sharded 4-bit "
                        f"weights are bytes stored as {str(compute_dtype).removeprefix('torch.')} and a cast would "
                        "destroy them; set sharding.param_dtype=auto")


def check_model(model_config: dict, recipe, *, rung, device_type: str) -> None:
    """Everything the sharded 4-bit build would refuse, checked from config.json on a meta skeleton (no weights,
    ~1 s for a 70B config) before any file is written or process launched."""
    compute = quant.compute_dtype(recipe.quant, device=device_type)
    check_recipe(recipe, compute_dtype=compute)
    if model_config.get("quantization_config"):
        raise UserError("model.path: this checkpoint is stored quantized; the sharded 4-bit base quantizes the "
                        "full-precision weights block by block, so point model.path at the original (bf16/fp16) model")
    skeleton = quant.meta_skeleton(quant.as_pretrained_config(model_config), images=rung.images)
    if skeleton is None:
        raise UserError("method=qlora with sharding needs an architecture transformers knows (no remote code); "
                        "use sharding.strategy=no_shard")
    storage_bytes = torch.empty((), dtype=compute).element_size()
    shapes = {n: (m.in_features, m.out_features)
              for n, m in quant.quantized_linears(skeleton, images=rung.images).items()}
    quant.check_shardable(shapes, storage_bytes=storage_bytes, shard_size=rung.shard_size)
    moe_experts.check_shardable(skeleton, storage_bytes=storage_bytes, shard_size=rung.shard_size)


@dataclass(frozen=True)
class FromSafetensors4bit:
    """`sharded_loading.build_sharded`'s source for the 4-bit base: every block read from
    `model_dir`'s safetensors, quantised on `compute_device` and sliced into this rank's shards
    (`fill_from_safetensors`), then the adapters from `loading.initial_adapters(seed=adapter_seed)`,
    the values every QLoRA rung starts from."""

    model_dir: Path
    adapter_seed: int
    compute_device: torch.device

    def fill(self, model: nn.Module, env) -> None:
        from homelab_ft.model import loading

        fill_from_safetensors(model, load_groups(model), Path(self.model_dir), compute_device=self.compute_device)
        params = dict(model.named_parameters())
        for name, full in loading.initial_adapters(model, seed=self.adapter_seed).items():
            copy_into_shard(params[name], full.to(params[name].dtype))


# --------------------------------------------------------------------------------------------
# filling


def _release_freed_memory() -> None:
    """Hand freed heap memory back to the OS after each block (glibc's `malloc_trim`).

    glibc keeps freed chunks below its mmap threshold (up to 32 MB, raised dynamically) in the
    heap; without this the RSS of a rank grew by ~20 MB per 63 MB block beyond its shards
    (measured on the 4-block test model). A no-op where libc has no malloc_trim (musl, macOS).
    """
    import ctypes
    import ctypes.util

    gc.collect()
    name = ctypes.util.find_library("c")
    libc = ctypes.CDLL(name) if name else None
    if libc is not None and hasattr(libc, "malloc_trim"):
        libc.malloc_trim(0)


def load_groups(model: nn.Module) -> list[list[tuple[str, nn.Module, str]]]:
    """(checkpoint name, module, attribute) of every base parameter, one group per transformer
    block and one for everything outside the blocks; a tied parameter appears once."""
    from homelab_ft.model.blocks import transformer_blocks

    blocks = transformer_blocks(model)
    owner = {id(m): i for i, block in enumerate(blocks) for m in block.modules()}
    groups: list[list] = [[] for _ in range(len(blocks) + 1)]
    seen: set[int] = set()
    for module_name, module in model.named_modules():
        for attr, param in module.named_parameters(recurse=False):
            if is_adapter(f".{module_name}.{attr}") or id(param) in seen:  # PEFT's and moe_experts' adapters
                continue
            seen.add(id(param))
            name = base_name(f"{module_name}.{moe_experts.checkpoint_attr(module, attr)}")
            groups[owner.get(id(module), len(blocks))].append((name, module, attr))
    return groups


def fill_from_safetensors(model: nn.Module, groups: list, model_dir: Path, *, compute_device: torch.device, peak: dict | None = None) -> None:
    """Fill every base shard from the checkpoint, one block at a time (see the module docstring),
    each tensor found through transformers' key conversion (`checkpoint_keys.CheckpointKeys`).

    A tied parameter stored only under another name (a tied LM head) is read under the name the
    file has. `peak`, when given, receives the largest number of bytes of temporaries (read
    tensor + its packed copy + quantisation states built so far) held at once.
    """
    from homelab_ft.distributed import sharded_experts

    cls = quant.linear4bit_class()
    keys = CheckpointKeys(model, model_dir)
    available = keys.names()
    state_bytes = 0
    held = 0
    for group in groups:
        names = []
        for name, module, attr in group:
            if name not in available and attr == "weight" and module is model.get_output_embeddings():
                name = hf_name_of(model, model.get_input_embeddings())  # tied head stored once
            names.append(name)
        lookup = {n: (module, attr) for n, (_, module, attr) in zip(names, group, strict=True)}
        for name, full in keys.tensors(names):
            module, attr = lookup[name]
            param = getattr(module, attr)
            if moe_experts.is_packed_stack(module, attr):
                held = max(held, sharded_experts.fill(module, attr, full, compute_device=compute_device))
                state_bytes += moe_experts.state_nbytes(module, attr)
            elif isinstance(module, cls) and attr == "weight":
                weight = full.to(device=compute_device, dtype=module.compute_dtype)
                packed, state = quant.quantize_4bit(weight, quant_type=module.quant_type_4bit,
                                              double_quant=module.double_quant, storage_dtype=param.dtype)
                held = max(held, _nbytes(full) + (_nbytes(weight) if weight is not full else 0) + _nbytes(packed))
                del weight
                module.quant_state = state
                state_bytes += quant.state_nbytes(state)
                copy_into_shard(param, packed.reshape(param.shape))
                del packed
            else:
                converted = full.to(dtype=param.dtype)
                held = max(held, _nbytes(full) + (_nbytes(converted) if converted is not full else 0))
                copy_into_shard(param, converted)
                del converted
            del full
        _release_freed_memory()
    if peak is not None:
        peak["temporaries"] = held
        peak["quant_states"] = state_bytes


def hf_name_of(model: nn.Module, module: nn.Module) -> str:

    for name, m in model.named_modules():
        if m is module:
            return base_name(f"{name}.weight")
    raise AssertionError("module not in model")


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()
