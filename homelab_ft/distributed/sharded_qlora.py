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
the packed shape, LoRA is attached, FSDP2 shards it, `to_empty` allocates only this rank's shards,
and then each transformer block is read from the safetensors files tensor by tensor, quantised
(every rank the same, deterministic), this rank's slice copied into its shard, and the rest freed.
Peak: this rank's shards + the quantisation states + one tensor in the compute dtype and its
packed copy (measured by `load_peak` in the same test). Fused MoE experts are packed stacks split
along experts, filled one expert at a time (sharded_experts.py, which one process and DDP use too).
"""

from __future__ import annotations

import functools
import gc
import logging
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from homelab_ft.distributed.sharded_loading import copy_into_shard
from homelab_ft.errors import UserError
from homelab_ft.model.checkpoint_keys import CheckpointKeys, base_name, is_adapter

log = logging.getLogger(__name__)


def packed_numel(in_features: int, out_features: int, *, storage_bytes: int) -> int | None:
    """Elements of the packed 4-bit weight stored as `storage_bytes`-wide floats, or None when the
    layer's 4-bit bytes do not fill whole storage elements (bitsandbytes' `view(quant_storage)` fails)."""
    nbytes = (in_features * out_features + 1) // 2
    return None if nbytes % storage_bytes else nbytes // storage_bytes


def check_shardable(linear_shapes: dict[str, tuple[int, int]], *, storage_bytes: int, shard_size: int) -> None:
    """UserError, before anything is loaded, for a layer the sharded 4-bit base cannot store.

    `linear_shapes`: name -> (in_features, out_features) of every layer to quantise. A packed
    weight that does not fill whole storage elements cannot be viewed as floats; one with fewer
    elements than ranks would leave ranks without a shard (FSDP2 pads uneven splits, so any other
    length works: the padding is at most shard_size - 1 elements per layer).
    """
    for name, (fan_in, fan_out) in linear_shapes.items():
        numel = packed_numel(fan_in, fan_out, storage_bytes=storage_bytes)
        if numel is None:
            raise UserError(
                f"method=qlora with sharding: layer {name} ({fan_in} x {fan_out}) packs into {(fan_in * fan_out + 1) // 2} "
                f"bytes, not a multiple of the {storage_bytes}-byte storage element; use sharding.strategy=no_shard or method=lora"
            )
        if numel < shard_size:
            raise UserError(
                f"method=qlora with sharding: layer {name} ({fan_in} x {fan_out}) is too small to split over {shard_size} "
                "ranks; use fewer processes, sharding.strategy=no_shard, or method=lora"
            )


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
    from homelab_ft.model import quant

    compute = quant.compute_dtype(recipe.quant, device=device_type)
    check_recipe(recipe, compute_dtype=compute)
    if model_config.get("quantization_config"):
        raise UserError("model.path: this checkpoint is stored quantized; the sharded 4-bit base quantizes the "
                        "full-precision weights block by block, so point model.path at the original (bf16/fp16) model")
    skeleton = quant.meta_skeleton(quant.as_pretrained_config(model_config))
    if skeleton is None:
        raise UserError("method=qlora with sharding needs an architecture transformers knows (no remote code); "
                        "use sharding.strategy=no_shard")
    from homelab_ft.distributed import sharded_experts

    storage_bytes = torch.empty((), dtype=compute).element_size()
    shapes = {n: (m.in_features, m.out_features) for n, m in quantized_linears(skeleton).items()}
    check_shardable(shapes, storage_bytes=storage_bytes, shard_size=rung.shard_size)
    sharded_experts.check_shardable(skeleton, storage_bytes=storage_bytes, shard_size=rung.shard_size)


# --------------------------------------------------------------------------------------------
# the layer


@functools.cache
def _linear4bit_class():
    import bitsandbytes as bnb

    class ShardedLinear4bit(bnb.nn.Linear4bit):
        """A `Linear4bit` whose weight FSDP2 shards: plain float-typed packed bytes, with the
        quantisation state of the whole weight kept on the module (`quant_state`).

        bitsandbytes' own forward looks for the state on the weight and would re-wrap FSDP's
        unsharded parameter in a `Params4bit` (setattr on the module behind FSDP's back); this
        one reads the module's state and leaves FSDP's parameter alone. It never takes the CPU
        inference repack (see quant.py), so no `after_load` guard is needed.
        """

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            inp_dtype = x.dtype
            x = x.to(self.compute_dtype)
            bias = None if self.bias is None else self.bias.to(self.compute_dtype)
            return bnb.matmul_4bit(x, self.weight, bias=bias, quant_state=self.quant_state).to(inp_dtype)

    return ShardedLinear4bit


# --------------------------------------------------------------------------------------------
# building


def quantized_linears(model: nn.Module) -> dict[str, nn.Linear]:
    """The `nn.Linear` layers transformers' bitsandbytes integration would quantise: all but the
    output embedding (LM head), which stays in the compute dtype."""
    head = model.get_output_embeddings()
    return {name: m for name, m in model.named_modules() if type(m) is nn.Linear and m is not head}


def replace_linears(model: nn.Module, *, quant_type: str, double_quant: bool, compute_dtype: torch.dtype,
                    storage_dtype: torch.dtype) -> None:
    """Swap every quantisable `nn.Linear` of a meta-device model for a 4-bit layer whose weight
    has the packed shape (a meta tensor: nothing is allocated)."""
    import bitsandbytes as bnb

    cls = _linear4bit_class()
    storage_bytes = torch.empty((), dtype=storage_dtype).element_size()
    for name, linear in quantized_linears(model).items():
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name)
        layer = cls(linear.in_features, linear.out_features, bias=linear.bias is not None, compute_dtype=compute_dtype,
                    compress_statistics=double_quant, quant_type=quant_type, quant_storage=storage_dtype, device="meta")
        numel = packed_numel(linear.in_features, linear.out_features, storage_bytes=storage_bytes)
        # A Params4bit for now, so PEFT dispatches its 4-bit LoRA layer (it reads quant_type and
        # compress_statistics off the weight); `plain_weights` swaps it for a plain Parameter.
        layer.weight = bnb.nn.Params4bit(torch.empty((numel, 1), dtype=storage_dtype, device="meta"), requires_grad=False,
                                         compress_statistics=double_quant, quant_type=quant_type,
                                         quant_storage=storage_dtype, module=layer, bnb_quantized=True)
        if linear.bias is not None:
            layer.bias = nn.Parameter(torch.empty(linear.out_features, dtype=compute_dtype, device="meta"),
                                      requires_grad=False)
        layer.quant_state = None  # set by fill_from_safetensors: the state of the whole weight
        layer.quant_type_4bit, layer.double_quant = quant_type, double_quant
        layer.support_avx512bf16_for_cpu = False
        setattr(parent, child, layer)


def plain_weights(model: nn.Module) -> None:
    """Params4bit -> plain frozen Parameters (same meta shape and dtype) before `fully_shard`, which
    would otherwise chunk through Params4bit's `__torch_function__` and carry its attributes."""
    cls = _linear4bit_class()
    for module in model.modules():
        if isinstance(module, cls) and not module.weight.is_meta:
            raise AssertionError("plain_weights runs on the meta-device build only")
        if isinstance(module, cls):
            module.weight = nn.Parameter(torch.empty_like(module.weight.data, device="meta"), requires_grad=False)


def to_4bit_layers(model: nn.Module, quant_cfg, *, compute_dtype: torch.dtype, shard_size: int,
                   storage_dtype: torch.dtype | None = None) -> None:
    """Turn a meta-device architecture into the shardable 4-bit base: refuse a layer it cannot
    store, swap the quantisable linears for 4-bit ones of the packed shape and the fused experts for
    packed stacks (sharded_experts.py), freeze everything. The packed bytes are stored as
    `storage_dtype` (default `compute_dtype`: what FSDP2 gathers, so the run's
    MixedPrecisionPolicy.param_dtype must equal it, check_recipe; uint8 where nothing shards)."""
    from homelab_ft.distributed import sharded_experts
    from homelab_ft.model import quant

    storage_dtype = compute_dtype if storage_dtype is None else storage_dtype
    storage_bytes = torch.empty((), dtype=storage_dtype).element_size()
    shapes = {n: (m.in_features, m.out_features) for n, m in quantized_linears(model).items()}
    check_shardable(shapes, storage_bytes=storage_bytes, shard_size=shard_size)
    sharded_experts.check_shardable(model, storage_bytes=storage_bytes, shard_size=shard_size)
    quant.raise_if_unquantizable(model)
    replace_linears(model, quant_type=quant_cfg.quant_type, double_quant=quant_cfg.double_quant,
                    compute_dtype=compute_dtype, storage_dtype=storage_dtype)
    sharded_experts.pack(model, quant_cfg, storage_dtype=storage_dtype)
    for param in model.parameters():
        param.requires_grad_(False)


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
    from homelab_ft.distributed import sharded_experts
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
            name = base_name(f"{module_name}.{sharded_experts.checkpoint_attr(module, attr)}")
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

    cls = _linear4bit_class()
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
            if sharded_experts.is_packed_stack(module, attr):
                held = max(held, sharded_experts.fill(module, attr, full, compute_device=compute_device))
                state_bytes += sharded_experts.state_nbytes(module, attr)
            elif isinstance(module, cls) and attr == "weight":
                weight = full.to(device=compute_device, dtype=module.compute_dtype)
                packed, state = quantize_4bit(weight, quant_type=module.quant_type_4bit,
                                              double_quant=module.double_quant, storage_dtype=param.dtype)
                held = max(held, _nbytes(full) + (_nbytes(weight) if weight is not full else 0) + _nbytes(packed))
                del weight
                module.quant_state = state
                state_bytes += _state_nbytes(state)
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


QUANT_CHUNK_VALUES = 1 << 18
"""Values quantised per call. bitsandbytes' CPU quantiser (backends/default/ops.py) holds ~8 fp32
temporaries per value (abs, scaled, clamp, bucketize indices ...): measured +130 MB of RSS for one
4M-value tensor, twice that tensor's own 16 MB. Chunks of 256k values cap it at ~8 MB; on CUDA
the fused kernel needs no temporaries and 70B's largest layer is ~900 chunks, a few ms."""


CUDA_QUANT_CHUNK_VALUES = 1 << 24


def quantize_4bit(weight: torch.Tensor, *, quant_type: str, double_quant: bool, storage_dtype: torch.dtype):
    """`bnb.functional.quantize_4bit(weight, blocksize=64, ...)`, bit for bit, in chunks.

    NF4/FP4 quantise each block of 64 values on its own, so quantising 1M-value chunks (a multiple
    of 64; only the last chunk has the short block, as in one call) and concatenating gives the same
    packed bytes and absmax; double quantisation then runs once over the whole absmax, exactly as
    bitsandbytes does (offset = mean, blockwise 8-bit in blocks of 256).
    """
    import bitsandbytes.functional as bnbf

    flat = weight.reshape(-1)
    # CUDA's fused kernel has no temporaries to cap: big chunks, ~15 calls for 70B's widest layer
    chunk = QUANT_CHUNK_VALUES if weight.device.type == "cpu" else CUDA_QUANT_CHUNK_VALUES
    packed, absmax = [], []
    for start in range(0, flat.numel(), chunk):
        part, state = bnbf.quantize_4bit(flat[start:start + chunk], blocksize=64, compress_statistics=False,
                                         quant_type=quant_type, quant_storage=torch.uint8)
        packed.append(part.reshape(-1))
        absmax.append(state.absmax)
    packed_bytes = torch.cat(packed)
    absmax_all = torch.cat(absmax)
    code = bnbf.get_4bit_type(quant_type, device=weight.device)
    if double_quant:
        offset = absmax_all.mean()
        qabsmax, state2 = bnbf.quantize_blockwise(absmax_all - offset, blocksize=256)
        state = bnbf.QuantState(absmax=qabsmax, shape=weight.shape, dtype=weight.dtype, blocksize=64, code=code,
                                quant_type=quant_type, offset=offset, state2=state2)
    else:
        state = bnbf.QuantState(absmax=absmax_all, shape=weight.shape, dtype=weight.dtype, blocksize=64, code=code,
                                quant_type=quant_type)
    return packed_bytes.view(storage_dtype).unsqueeze(1), state


def hf_name_of(model: nn.Module, module: nn.Module) -> str:

    for name, m in model.named_modules():
        if m is module:
            return base_name(f"{name}.weight")
    raise AssertionError("module not in model")


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _state_nbytes(state) -> int:
    tensors = [state.absmax, state.code]
    if state.state2 is not None:
        tensors += [state.state2.absmax, state.state2.code]
    return sum(_nbytes(t) for t in tensors)
