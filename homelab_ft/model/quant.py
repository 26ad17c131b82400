"""Everything bitsandbytes-specific: the 4/8-bit load config, the CPU guard, k-bit preparation,
the 4-bit layers of the meta-built base (`to_4bit_layers`: packed bytes in a float storage FSDP2 can
shard, distributed/sharded_qlora.py says why, filled there block by block) and the 8-bit / paged AdamW
optimizers. `train/build.py` calls this for `method: qlora`.

The CPU trap (bitsandbytes 0.50.2, read in bitsandbytes/nn/modules.py `Linear4bit.forward`):
on a CPU with AVX512-BF16, the first forward of a `Linear4bit` that runs in eval mode on an
input without grad (an eval loop, `generate`) repacks its weight in place into a bf16 layout for
a fused inference kernel (`functional._convert_weight_packed_for_cpu`). Every later forward,
training ones included, then goes through `torch.ops.bitsandbytes.gemv_4bit`, which has no
autograd kernel: backward passes no gradient to the layer input through the base weight (torch
warns "an autograd kernel was not registered ... silently incorrect behavior"), so the LoRA
gradients of every earlier layer are wrong. Measured on this project's 2-core AMD EPYC with
avx512_bf16, tiny Llama (hidden 64, 2 layers, LoRA r=8 on all linear layers): gradient relative
error 0 before an eval pass, 0.30 after it. Saving after the repack round-trips the weights
through a lossy inverse: 0.5% max relative weight error with double quantization, 48% without
(the non-nested absmax is never transposed back). The repack also asserts out_features % 32 == 0
and in_features even, so a model with, say, 16 key/value features crashes on its first eval.

`after_load` turns the repack off on every layer (`support_avx512bf16_for_cpu = False`, the flag
`forward` checks); with it, the same layers compute through the dequantize + matmul path in
train and eval alike, gradients match an fp32 model holding the dequantized weights exactly, any
layer shape works, and saves are lossless. tests/unit/model/test_quant.py checks all of this.
"""

from __future__ import annotations

import functools
import logging
import re
from typing import Any

import torch
from torch import nn

from homelab_ft.errors import UserError
from homelab_ft.recipe.config import QuantConfig, TrainConfig
from homelab_ft.rules.quant_rule import MAX_UNQUANTIZABLE_FRACTION, unquantizable_fraction

log = logging.getLogger(__name__)

# --------------------------------------------------------------------------------------------
# availability and the load config


def require_bitsandbytes(*, device: torch.device | str):
    """Import bitsandbytes and check its native library loaded; a UserError otherwise."""
    device = torch.device(device)
    try:
        import bitsandbytes as bnb
        from bitsandbytes import cextension
    except ImportError as err:
        raise UserError(
            f"method: qlora needs bitsandbytes ({err}); install it with pip install 'bitsandbytes>=0.45', "
            "or set method: lora"
        ) from None
    mock = getattr(cextension, "ErrorHandlerMockBNBNativeLibrary", None)  # absent in older releases
    if mock is not None and isinstance(getattr(cextension, "lib", None), mock):
        # bitsandbytes imports without its compiled library (e.g. no build for this CUDA version)
        # and only fails on the first kernel call, deep inside a forward.
        raise UserError(
            f"bitsandbytes {bnb.__version__} found no native library for this machine; run "
            "python -m bitsandbytes to see why, or set method: lora"
        )
    if device.type not in ("cpu", "cuda"):
        raise UserError(f"method: qlora runs on cpu or cuda here, not {device.type}; set train.device")
    return bnb


def compute_dtype(quant_cfg: QuantConfig, *, device: torch.device | str) -> torch.dtype:
    """Dtype 4-bit weights are dequantized to for each matmul, and of the non-quantized weights.

    `auto`: bf16 on GPUs that have it (fp32's range, half the activation memory), fp32 elsewhere
    (CPU bf16 matmuls are slower than fp32 on most CPUs and round the activations).
    """
    if quant_cfg.compute_dtype != "auto":
        return getattr(torch, quant_cfg.compute_dtype)
    device = torch.device(device)
    if device.type == "cuda" and torch.cuda.is_bf16_supported():
        return torch.bfloat16
    return torch.float32


def bnb_config(quant_cfg: QuantConfig, *, device: torch.device | str, skip: list[str] | None = None):
    """The `quantization_config` for `from_pretrained`: NF4/FP4 (double quant on) or LLM.int8; `skip`:
    the modules left in the compute dtype when transformers' own choice (the head) is not all (`skipped`)."""
    from transformers import BitsAndBytesConfig

    require_bitsandbytes(device=device)
    if quant_cfg.bits == 8:
        # LLM.int8 (Dettmers et al. 2022): int8 rows plus fp16 outlier columns above the threshold
        # (6.0, the paper's value and transformers' default). quant_type/double_quant are 4-bit only.
        return BitsAndBytesConfig(load_in_8bit=True, llm_int8_skip_modules=skip)
    return BitsAndBytesConfig(
        load_in_4bit=True,
        llm_int8_skip_modules=skip,
        bnb_4bit_quant_type=quant_cfg.quant_type,
        bnb_4bit_use_double_quant=quant_cfg.double_quant,
        bnb_4bit_compute_dtype=compute_dtype(quant_cfg, device=device),
    )


def skipped(config, *, images: bool) -> list[str] | None:
    """What an image run keeps out of bitsandbytes: transformers' own skips (the output embedding and
    what is tied to it, `get_keys_to_not_convert`, which it drops once a list is given) and the vision
    side (rules/vision.quant_skip: the tower stays 16-bit). None for a text run: transformers decides, as before."""
    from transformers.quantizers.base import get_keys_to_not_convert

    from homelab_ft.rules import vision

    skeleton = meta_skeleton(config, images=images) if images else None
    if skeleton is None:
        return None
    return sorted({*get_keys_to_not_convert(skeleton), *vision.quant_skip(skeleton)})


# --------------------------------------------------------------------------------------------
# what can be quantized


def check_quantizable(model_config, quant_cfg: QuantConfig, *, device: torch.device | str,
                      images: bool = False) -> None:
    """Refuse, before loading any weight, a model that bitsandbytes cannot (or should not) quantize.

    `model_config` is a `transformers.PretrainedConfig` or the dict of a config.json. Checks:
    bitsandbytes is usable; the checkpoint is not already quantized another way (GPTQ, AWQ, FP8:
    transformers would keep that and ignore ours) nor with bitsandbytes at another bit width; and
    most block weights are `nn.Linear` layers bitsandbytes replaces (checked on a meta-device
    skeleton: no memory, ~1 s for an 8B config). Layer shapes need no check once `after_load`
    has run: with the guard every shape works on CPU, and CUDA falls back to dequantize + matmul
    when in_features is not a multiple of the 64-value block.
    """
    require_bitsandbytes(device=device)
    config = as_pretrained_config(model_config)
    existing = getattr(config, "quantization_config", None)
    if existing is not None:
        existing = existing if isinstance(existing, dict) else existing.to_dict()
        method = str(existing.get("quant_method", "unknown"))
        if method != "bitsandbytes":
            raise UserError(
                f"model.path: this checkpoint is already quantized with {method}; method: qlora re-quantizes "
                "a full-precision checkpoint with bitsandbytes, so point model.path at the original (bf16/fp16) model"
            )
        stored_bits = 4 if existing.get("load_in_4bit") else 8
        if stored_bits != quant_cfg.bits:
            raise UserError(
                f"model.path: this checkpoint is stored in bitsandbytes {stored_bits}-bit; set quant.bits={stored_bits} "
                "or use the full-precision original"
            )
    skeleton = meta_skeleton(config, images=images)
    if skeleton is not None:
        refuse_8bit_experts(skeleton, quant_cfg)
        raise_if_unquantizable(skeleton)


def as_pretrained_config(model_config):
    """config.json's dict as a transformers config, so a meta skeleton can be built before any
    weight is read (also by the sharded 4-bit checks, sharded_qlora.check_model)."""
    from transformers import AutoConfig, PretrainedConfig

    if isinstance(model_config, PretrainedConfig):
        return model_config
    # transformers writes an infinite float as {"__float__": "Infinity"} (the Mamba mixers'
    # `time_step_limit: [0.0, inf]`: Falcon-H1, Granite 4, Nemotron-H) and decodes it only when it
    # reads the file itself; the raw dict failed the config's field validation before anything was
    # quantized (issue 20).
    fields = PretrainedConfig._decode_special_floats(dict(model_config))
    model_type = fields.pop("model_type", None)
    if model_type is None:
        raise UserError("model.path: config.json has no model_type; it is not a transformers model")
    try:
        return AutoConfig.for_model(model_type, **fields)
    except ValueError as err:
        raise UserError(f"model.path: {str(err).splitlines()[0]}") from None


def meta_skeleton(config, *, images: bool = False):
    """The model's module tree on the meta device, as the run builds it (rules/vision.auto_class), or
    None for architectures transformers does not know (remote code): those are checked after
    loading, by `after_load`."""
    from homelab_ft.rules import vision

    if getattr(config, "auto_map", None):
        return None
    with torch.device("meta"):
        try:
            return vision.auto_class(config, images=images).from_config(config)
        except ValueError:
            return None


def raise_if_unquantizable(model: torch.nn.Module) -> None:
    """UserError when more block weights than config.unquantizable_fraction allows are not in layers
    bitsandbytes quantizes (that function says what counts on which side).

    Works on a meta skeleton (before quantization: `nn.Linear` counts as quantizable, as it does
    for transformers' `replace_with_bnb_linear`) and on a loaded model (bnb layers count).
    Every embedding table (an `nn.Embedding`, whatever its name: Gemma 4's per-layer embeddings
    too) and the LM head are left out of both sides: transformers never quantizes them; so is an
    image-text model's vision side (rules/vision.py), which the planner prices apart from the blocks
    it counts (its share counts the text decoder's blocks alone): a tiny Gemma 3's SigLIP convolution
    and pooling head were 14% of the counted weights and refused a text-only QLoRA the plan offered.
    """
    from homelab_ft.model import moe_experts
    from homelab_ft.rules import vision

    tables = [m for m in model.modules() if isinstance(m, torch.nn.Embedding)]
    left_out = {id(p) for m in (*tables, model.get_output_embeddings()) if m is not None for p in m.parameters()}
    prefixes = vision.vision_prefixes(model)
    left_out |= {id(p) for name, p in model.named_parameters() if vision.is_vision_module(name, prefixes)}
    quantizable_types = _quantizable_types()
    quantized = 0
    kept: dict[str, int] = {}
    experts = moe_experts.fused_experts(model)
    for module in experts.values():  # 4-bit through moe_experts.quantize (quantize_experts), plain or packed
        quantized += sum(moe_experts.expert_params(module, name) for name in moe_experts.projections(module))
        left_out |= {id(p) for p in module.parameters(recurse=False)}
    for module_name, module in model.named_modules():
        for param_name, param in module.named_parameters(recurse=False):
            if id(param) in left_out or param_name == "bias":
                continue
            if isinstance(module, quantizable_types):
                # a loaded 4-bit weight stores two values per byte; count what it represents
                state = getattr(param, "quant_state", None)
                quantized += param.numel() if state is None else state.shape.numel()
            elif param.dim() >= 2:
                # layer index out of the name, so 32 layers' experts read as one line
                pattern = re.sub(r"\.\d+\.", ".*.", f"{module_name}.{param_name}")
                kept[pattern] = kept.get(pattern, 0) + param.numel()
    total = quantized + sum(kept.values())
    if total == 0 or quantized == 0:
        raise UserError(f"method: qlora: bitsandbytes finds no linear layer to quantize in {type(model).__name__}; "
                        "use method: lora or full")
    share = unquantizable_fraction(quantized_params=quantized, kept_params=sum(kept.values()))
    if share > MAX_UNQUANTIZABLE_FRACTION:
        worst = [kv for kv in sorted(kept.items(), key=lambda kv: -kv[1])[:3] if kv[1] >= 0.01 * total]
        names = ", ".join(f"{name} ({count / 1e6:.1f}M params)" for name, count in worst)
        raise UserError(
            f"method: qlora: bitsandbytes cannot quantize {share:.0%} of "
            f"{type(model).__name__}'s block weights ({names}; not nn.Linear layers, e.g. fused MoE experts), "
            "so they would stay in full precision; use method: lora or full"
        )


def quantize_experts(model: torch.nn.Module, quant_cfg: QuantConfig) -> int:
    """Every fused-experts module of a loaded model to packed 4-bit experts (moe_experts.quantize):
    bitsandbytes' `from_pretrained` quantizes `nn.Linear` layers only and leaves the 3-D expert
    stacks in the compute dtype (97% of Qwen3-30B-A3B's block weights). Returns how many modules.
    The router stays in the compute dtype and frozen, as every other non-linear weight of QLoRA."""
    from homelab_ft.model import moe_experts

    found = moe_experts.fused_experts(model)
    for module in found.values():
        moe_experts.quantize(module, quant_type=quant_cfg.quant_type, double_quant=quant_cfg.double_quant)
    if found:
        log.info("4-bit experts: %d fused-experts modules packed (%s)", len(found), quant_cfg.quant_type)
    return len(found)


def refuse_8bit_experts(model: torch.nn.Module, quant_cfg: QuantConfig) -> None:
    """moe_experts packs experts in 4 bits only (bitsandbytes' int8 matmul has no per-expert form here)."""
    from homelab_ft.model import moe_experts

    if quant_cfg.bits != 4 and moe_experts.fused_experts(model):
        raise UserError("quant.bits=8: MoE experts are quantized in 4 bits only; set quant.bits=4 or method: lora")


def _quantizable_types() -> tuple[type, ...]:
    import bitsandbytes as bnb
    from transformers.pytorch_utils import Conv1D

    # `type(module) is nn.Linear` in transformers; subclasses of nn.Linear are rare in decoder blocks.
    return (torch.nn.Linear, Conv1D, bnb.nn.Linear4bit, bnb.nn.Linear8bitLt)


# --------------------------------------------------------------------------------------------
# after loading


def after_load(model: torch.nn.Module) -> None:
    """The CPU guard: keep every 4-bit layer on the path whose gradients are right (see top).

    Safe on GPU and on CPUs without AVX512-BF16, where the flag is already off or never read.
    The repack happens lazily in the first eval forward, so this must run before any forward.
    """
    import bitsandbytes as bnb

    raise_if_unquantizable(model)
    for module in model.modules():
        if isinstance(module, bnb.nn.Linear4bit):
            state = module.weight.quant_state
            assert not getattr(state, "packing_format_for_cpu", False), "after_load must run before any forward"
            module.support_avx512bf16_for_cpu = False


def prepare_for_training(model: torch.nn.Module) -> torch.nn.Module:
    """Freeze the base: PEFT's `prepare_model_for_kbit_training` minus its blanket fp32 upcast and
    its activation checkpointing (model.blocks.enable_activation_checkpointing, for every rung).

    PEFT casts every non-quantized fp16/bf16 parameter to fp32. For frozen bf16 weights that buys
    no precision (the values were rounded to bf16 on disk) and costs memory: Llama-3.1-8B's
    embeddings + LM head are 2 x 525M params, +2.1 GB in fp32, and fp32 norm gains turn the whole
    residual stream fp32, doubling activation memory. bf16 has fp32's exponent range, the RMSNorm
    variance is computed in fp32 by the model, the loss upcasts logits, and PEFT keeps the LoRA
    weights themselves in fp32 (autocast_adapter_dtype), so bf16 stays bf16 here. fp16 is
    different: its range (max 65504) is exceeded by LLM activation outliers, so with an fp16
    compute dtype we do upcast the non-quantized weights to fp32, as PEFT does, and the residual
    stream runs in fp32 with only the 4-bit matmuls in fp16.
    """
    for param in model.parameters():
        param.requires_grad_(False)
    upcast_fp16(model)
    return model


def upcast_fp16(model: torch.nn.Module) -> None:
    """Every frozen fp16 parameter to fp32 (prepare_for_training says why); packed 4-bit bytes are
    stored as uint8 where nothing shards, so they are never touched."""
    for param in model.parameters():
        if param.dtype == torch.float16 and not param.requires_grad:
            param.data = param.data.float()


# --------------------------------------------------------------------------------------------
# the meta-built 4-bit base: layers FSDP2 can shard (distributed/sharded_qlora.py fills them)


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


@functools.cache
def linear4bit_class():
    """The 4-bit layer of the meta-built base (a class made once bitsandbytes is imported)."""
    import bitsandbytes as bnb

    class ShardedLinear4bit(bnb.nn.Linear4bit):
        """A `Linear4bit` whose weight FSDP2 shards: plain float-typed packed bytes, with the
        quantisation state of the whole weight kept on the module (`quant_state`).

        bitsandbytes' own forward looks for the state on the weight and would re-wrap FSDP's
        unsharded parameter in a `Params4bit` (setattr on the module behind FSDP's back); this
        one reads the module's state and leaves FSDP's parameter alone. It never takes the CPU
        inference repack (see the module docstring), so no `after_load` guard is needed.
        """

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            inp_dtype = x.dtype
            x = x.to(self.compute_dtype)
            bias = None if self.bias is None else self.bias.to(self.compute_dtype)
            return bnb.matmul_4bit(x, self.weight, bias=bias, quant_state=self.quant_state).to(inp_dtype)

    return ShardedLinear4bit


def quantized_linears(model: nn.Module, *, images: bool = False) -> dict[str, nn.Linear]:
    """The `nn.Linear` layers transformers' bitsandbytes integration would quantise: all but the
    output embedding (LM head), which stays in the compute dtype, and on an image run the vision side
    (`skipped`)."""
    from homelab_ft.rules import vision

    head = model.get_output_embeddings()
    keep = vision.quant_skip(model) if images else []
    return {name: m for name, m in model.named_modules()
            if type(m) is nn.Linear and m is not head and not vision.is_vision_module(name, tuple(keep))}


def replace_linears(model: nn.Module, *, quant_type: str, double_quant: bool, compute_dtype: torch.dtype,
                    storage_dtype: torch.dtype, images: bool = False) -> None:
    """Swap every quantisable `nn.Linear` of a meta-device model for a 4-bit layer whose weight
    has the packed shape (a meta tensor: nothing is allocated)."""
    import bitsandbytes as bnb

    cls = linear4bit_class()
    storage_bytes = torch.empty((), dtype=storage_dtype).element_size()
    for name, linear in quantized_linears(model, images=images).items():
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
        layer.quant_state = None  # set by sharded_qlora.fill_from_safetensors: the state of the whole weight
        layer.quant_type_4bit, layer.double_quant = quant_type, double_quant
        layer.support_avx512bf16_for_cpu = False
        setattr(parent, child, layer)


def plain_weights(model: nn.Module) -> None:
    """Params4bit -> plain frozen Parameters (same meta shape and dtype) before `fully_shard`, which
    would otherwise chunk through Params4bit's `__torch_function__` and carry its attributes."""
    cls = linear4bit_class()
    for module in model.modules():
        if isinstance(module, cls) and not module.weight.is_meta:
            raise AssertionError("plain_weights runs on the meta-device build only")
        if isinstance(module, cls):
            module.weight = nn.Parameter(torch.empty_like(module.weight.data, device="meta"), requires_grad=False)


def to_4bit_layers(model: nn.Module, quant_cfg, *, compute_dtype: torch.dtype, shard_size: int,
                   storage_dtype: torch.dtype | None = None, images: bool = False) -> None:
    """Turn a meta-device architecture into the shardable 4-bit base: refuse a layer it cannot
    store, swap the quantisable linears for 4-bit ones of the packed shape and the fused experts for
    packed stacks (`pack_experts`), freeze everything. The packed bytes are stored as
    `storage_dtype` (default `compute_dtype`: what FSDP2 gathers, so the run's
    MixedPrecisionPolicy.param_dtype must equal it, sharded_qlora.check_recipe; uint8 where nothing shards)."""
    from homelab_ft.model import moe_experts

    storage_dtype = compute_dtype if storage_dtype is None else storage_dtype
    storage_bytes = torch.empty((), dtype=storage_dtype).element_size()
    shapes = {n: (m.in_features, m.out_features) for n, m in quantized_linears(model, images=images).items()}
    check_shardable(shapes, storage_bytes=storage_bytes, shard_size=shard_size)
    moe_experts.check_shardable(model, storage_bytes=storage_bytes, shard_size=shard_size)
    raise_if_unquantizable(model)
    replace_linears(model, quant_type=quant_cfg.quant_type, double_quant=quant_cfg.double_quant,
                    compute_dtype=compute_dtype, storage_dtype=storage_dtype, images=images)
    pack_experts(model, quant_cfg, storage_dtype=storage_dtype)
    for param in model.parameters():
        param.requires_grad_(False)


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


def state_nbytes(state) -> int:
    """Bytes of one QuantState's tensors (absmax, code, and the nested ones)."""
    tensors = [state.absmax, state.code]
    if state.state2 is not None:
        tensors += [state.state2.absmax, state.state2.code]
    return sum(_nbytes(t) for t in tensors)


def pack_experts(model: nn.Module, quant_cfg, *, storage_dtype: torch.dtype) -> int:
    """Every fused-experts module of a meta-device model to empty packed stacks (moe_experts.pack_meta)."""
    from homelab_ft.model import moe_experts

    found = moe_experts.fused_experts(model)
    for module in found.values():
        moe_experts.pack_meta(module, quant_type=quant_cfg.quant_type, double_quant=quant_cfg.double_quant,
                              storage_dtype=storage_dtype)
    if found:
        log.info("4-bit experts: %d fused-experts modules packed (%s)", len(found), quant_cfg.quant_type)
    return len(found)


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


# --------------------------------------------------------------------------------------------
# optimizers


def make_optimizer(param_groups: list[dict[str, Any]], train_cfg: TrainConfig) -> torch.optim.Optimizer:
    """`adamw_8bit` / `paged_adamw_8bit` from bitsandbytes over `param_groups` (steps.py's groups).

    8-bit AdamW keeps both moments in blockwise-quantized uint8 (2 B/param instead of 8 B;
    Dettmers et al. 2021); tensors under 4096 elements keep fp32 moments (bitsandbytes'
    min_8bit_size). bitsandbytes 0.50 runs both on CPU too (backends/cpu/ops.py registers CPU
    optimizer kernels). Paging moves optimizer state to host RAM under GPU memory pressure
    (CUDA unified memory); on CPU there is nothing to page and bitsandbytes itself falls back to
    plain buffers with a warning, so CPU gets `AdamW8bit`, the same arithmetic without the warning.
    """
    from torch.distributed.tensor import DTensor

    params = [p for group in param_groups for p in group["params"]]
    if any(isinstance(p, DTensor) for p in params):
        raise UserError(
            f"train.optimizer={train_cfg.optimizer} cannot update FSDP2-sharded parameters (bitsandbytes "
            "optimizers take plain tensors); use train.optimizer=adamw, or a no_shard/single-device run"
        )
    devices = {p.device for p in params}
    if len(devices) != 1:
        raise UserError(f"train.optimizer={train_cfg.optimizer}: parameters are spread over {sorted(map(str, devices))}; "
                        "bitsandbytes optimizers need them on one device")
    device = devices.pop()
    if train_cfg.optimizer not in ("adamw_8bit", "paged_adamw_8bit"):
        raise ValueError(f"not a bitsandbytes optimizer: {train_cfg.optimizer}")
    bnb = require_bitsandbytes(device=device)
    paged = train_cfg.optimizer == "paged_adamw_8bit" and device.type == "cuda"
    cls = bnb.optim.PagedAdamW8bit if paged else bnb.optim.AdamW8bit
    return cls(param_groups, lr=train_cfg.lr, betas=train_cfg.betas, weight_decay=train_cfg.weight_decay)
