"""What the parameters cost: bytes of the base weights (quantized or not), the adapters, the
quantisation constants, the optimizer state and the optimizer step's temporaries. Pure
arithmetic, no torch, no I/O.

memory.estimate spreads these over the ranks of a rung; diskspace.py prices a checkpoint from
them. Every formula says where it comes from; bench/plan_vs_measured.py checks the weights,
gradients and optimizer state against real runs.
"""

from __future__ import annotations

import functools
import math

from homelab_ft.plan.inputs import Cluster, PlanRequest
from homelab_ft.plan.shape.shapes import BlockShape, Linear, ModelShape
from homelab_ft.rung import Rung


def weight_bytes(request: PlanRequest, cluster: Cluster) -> int:
    """Bytes per base weight: `auto` is bf16 on GPUs and fp32 on CPUs (config.ModelConfig.dtype)."""
    if request.model.dtype == "auto":
        return 2 if cluster.device == "cuda" else 4
    return 4 if request.model.dtype == "float32" else 2


def qlora_compute_bytes(request: PlanRequest, cluster: Cluster) -> int:
    """Bytes of QLoRA's non-quantized weights and activations: the compute dtype (`auto`: bf16 on
    GPUs, fp32 on CPUs). fp16 counts as fp32: quant.prepare_for_training upcasts non-quantized
    fp16 weights, since fp16's range overflows on LLM activation outliers."""
    if request.quant.compute_dtype == "auto":
        return 2 if cluster.device == "cuda" else 4
    return 2 if request.quant.compute_dtype == "bfloat16" else 4


@functools.cache
def quantized_linear_bytes(in_features: int, out_features: int, *, bits: int, double_quant: bool) -> int:
    """Bytes of one bitsandbytes-quantized nn.Linear weight, quantization constants included.

    4-bit (bitsandbytes functional.quantize_4bit): two values per byte, one absmax per block of 64
    values; fp32 absmax, or with double quantization (QLoRA sec. 3) uint8 absmax re-quantized in
    blocks of 256 with fp32 second-level absmax plus one fp32 offset; and the QuantState's own
    codes (`quant_code_bytes`).
    8-bit (LLM.int8, Linear8bitLt): one byte per value plus an fp32 scale per output row (SCB).

    Cached: a function of four ints, asked for every linear of every block in each option's
    estimate (~600k times in test_rung's grid), for a model's handful of distinct shapes.
    """
    n = in_features * out_features
    if bits == 8:
        return n + 4 * out_features
    blocks = math.ceil(n / 64)
    if double_quant:
        return math.ceil(n / 2) + blocks + 4 * math.ceil(blocks / 256) + 4 + quant_code_bytes(double_quant=True)
    return math.ceil(n / 2) + 4 * blocks + quant_code_bytes(double_quant=False)


FOUR_BIT_CODE_VALUES = 16
"""bitsandbytes' get_4bit_type: the 16 fp32 values of NF4 (or FP4), made anew by every quantize_4bit call."""
DYNAMIC_CODE_VALUES = 256
"""bitsandbytes' quantize_blockwise: the 256 fp32 values of its dynamic map, copied into every nested state."""


def quant_code_bytes(*, double_quant: bool) -> int:
    """Bytes of the codes one 4-bit QuantState holds: each has its own tensors (quantize_4bit and
    quantize_blockwise copy them per call), ~1 KB per matrix nested, which on Qwen3-30B-A3B's
    ~12.5k expert and attention matrices is ~13 MB."""
    return 4 * (FOUR_BIT_CODE_VALUES + DYNAMIC_CODE_VALUES * double_quant)


def adapter_bytes(rung: Rung, request: PlanRequest, cluster: Cluster) -> int:
    """Bytes per adapter parameter: fp32, or with lora.dtype=compute bf16 when the base computes in
    bf16 (fp16 bases keep fp32 adapters)."""
    if request.lora.dtype != "compute":
        return 4
    name = request.quant.compute_dtype if rung.quantized_enabled else request.model.dtype
    bf16 = name == "bfloat16" or (name == "auto" and cluster.device == "cuda")
    return 2 if bf16 else 4


def quant_state_bytes(shape: ModelShape, request: PlanRequest) -> int:
    """Bytes of the 4-bit quantisation constants (absmax, nested absmax, offset, codes) of all blocks.

    They are module attributes (bitsandbytes' QuantState on a Linear4bit, moe_experts' per-expert
    states), not parameters: FSDP2 neither shards nor offloads them, so every rank keeps them whole
    on its device (`device_kept_bytes`), and the kernel dequantizes the all-gathered weight with
    them. With double quantization that is ~1/64 byte per weight (Llama-3.1-70B: 1.04 GiB per rank;
    Qwen3-30B-A3B: 0.45 GiB; 4x that without). So do the packed MoE experts' (sharded_experts.py:
    FSDP2 splits the stack along experts, every expert's QuantState stays on every rank).
    """
    return sum(block.num_blocks * _block_constant_bytes(block, request) for block in shape.blocks)


def _block_constant_bytes(block: BlockShape, request: PlanRequest) -> int:
    """`quant_state_bytes` of one block: its 4-bit bytes beyond the packed ones (0 unless 4-bit)."""
    if request.quant.bits != 4:
        return 0
    matrices = [(1, lin.in_features, lin.out_features) for lin in block.linears] + list(block.expert_stacks)
    return sum(count * (quantized_linear_bytes(i, o, bits=4, double_quant=request.quant.double_quant) - math.ceil(i * o / 2))
               for count, i, o in matrices)


def expert_scratch_bytes(shape: ModelShape, request: PlanRequest, cluster: Cluster) -> int:
    """The one expert's weight that bnb.matmul_4bit dequantizes at a time (moe_experts._project), in
    the compute dtype, on the device: a temporary of the running block, the same size on every
    rank whatever FSDP2 shards (it splits the stack along experts, the matmul takes one whole)."""
    if request.quant.bits != 4:
        return 0
    return qlora_compute_bytes(request, cluster) * max((i * o for b in shape.blocks for _, i, o in b.expert_stacks), default=0)


def device_kept_bytes(shape: ModelShape, rung: Rung, request: PlanRequest, cluster: Cluster) -> int:
    """Bytes of a 4-bit base that stay whole on every rank's device on every rung, sharded or not,
    CPU-offloaded or not: the quantisation constants (`quant_state_bytes`: not parameters, so
    FSDP2's CPUOffloadPolicy leaves them on the GPU) and one expert's dequantized scratch."""
    if not rung.quantized_enabled:
        return 0
    return quant_state_bytes(shape, request) + expert_scratch_bytes(shape, request, cluster)


def one_process_loading_bytes(shape: ModelShape, rung: Rung, request: PlanRequest, cluster: Cluster) -> int:
    """Host RAM one unsharded process holds while it loads: a 4-bit base with fused MoE experts
    takes the meta build and the per-block fill (train/build.py, sharded_experts.py), so it holds
    what a sharded 4-bit rank holds (`sharded_qlora_loading_bytes`: one projection's stacked experts
    as read, ~1.6 GB on Qwen3-30B-A3B); every other one-process load streams safetensors from the
    page cache (`from_pretrained`)."""
    has_experts = any(b.expert_stacks for b in shape.blocks)
    if not rung.quantized_enabled or request.quant.bits != 4 or not has_experts:
        return 0
    return sharded_qlora_loading_bytes(shape, request, cluster)


def sharded_qlora_loading_bytes(shape: ModelShape, request: PlanRequest, cluster: Cluster) -> int:
    """Host RAM one rank holds while it fills its 4-bit shards (sharded_qlora.fill_from_safetensors):
    one tensor at a time as read from disk (bf16 assumed, 2 B) plus its compute-dtype copy. The
    largest is the embedding (vocab x hidden), the widest linear layer, or one projection's stacked
    experts (read whole, bf16, and held twice while transformers' converter concatenates gate and up;
    quantized one expert at a time, sharded_experts.py); never the whole model."""
    largest = max([shape.vocab_size * shape.hidden_size] + [lin.in_features * lin.out_features
                                                             for b in shape.blocks for lin in b.linears])
    stacks = max((e * i * o for b in shape.blocks for e, i, o in b.expert_stacks), default=0)
    return max(largest * (2 + qlora_compute_bytes(request, cluster)), stacks * 2 * 2)


def lora_params_per_block(shape: ModelShape, request: PlanRequest, block_index: int) -> int:
    """Adapter parameters of one block: r x (in + out) per targeted linear (A: r x in, B: out x r).

    `all-linear` is PEFT's every nn.Linear except the LM head, and every expert of the fused MoE
    stacks (model/moe_experts.py: A [E, r, in], B [E, out, r] per projection).
    """
    block = shape.blocks[block_index]
    r = request.lora.r
    linears = sum(r * (lin.in_features + lin.out_features) for lin in targeted_linears(block, request))
    experts = sum(e * r * (i + o) for e, i, o in block.expert_stacks) if "all-linear" in request.lora.targets else 0
    return linears + experts


def targeted_linears(block: BlockShape, request: PlanRequest) -> tuple[Linear, ...]:
    """The block's linears that LoRA wraps: `all-linear` as PEFT resolves it on this model (derive.py
    asks PEFT), else `lora.target_modules` matched by name suffix, as PEFT does."""
    return linears_for(block, request.lora.targets)


def linears_for(block: BlockShape, targets: tuple[str, ...]) -> tuple[Linear, ...]:
    """`targeted_linears` for a `lora.target_modules` list (`all-linear` in it: the resolved set)."""
    if "all-linear" in targets:
        return tuple(lin for lin in block.linears if lin.all_linear)
    return tuple(lin for lin in block.linears if any(lin.name.endswith(t) for t in targets))


def vision_linears_for(shape: ModelShape, targets: tuple[str, ...]) -> tuple[Linear, ...]:
    """An image-text model's vision linears that a `lora.target_modules` entry names, matched as
    `linears_for` matches; `all-linear` never wraps them (rules/lora_targets.py)."""
    named = [t for t in targets if t != "all-linear"]
    if shape.vision is None or not named:
        return ()
    return tuple(lin for lin in shape.vision.linears if any(lin.name.endswith(t) for t in named))


def adapter_params(shape: ModelShape, request: PlanRequest) -> int:
    """Every adapter's parameters: the blocks', and a vision tower's where the targets name its layers."""
    vision = sum(request.lora.r * (lin.in_features + lin.out_features)
                 for lin in vision_linears_for(shape, request.lora.targets))
    return vision + sum(b.num_blocks * lora_params_per_block(shape, request, i) for i, b in enumerate(shape.blocks))


def router_params(shape: ModelShape, request: PlanRequest) -> int:
    """The routers' parameters when lora.train_router trains them (moe_routers.router_parameters)."""
    return sum(b.num_blocks * b.router_params for b in shape.blocks) if request.lora.train_router else 0


def trainable_params(shape: ModelShape, request: PlanRequest) -> int:
    """What an adapter rung trains, as loading.count_params counts it: the adapters, and the routers
    with lora.train_router."""
    return adapter_params(shape, request) + router_params(shape, request)


def base_weight_bytes(shape: ModelShape, rung: Rung, request: PlanRequest, cluster: Cluster) -> tuple[int, int]:
    """(total bytes, the largest block's bytes FSDP2 all-gathers) of the unsharded base weights;
    a 4-bit block gathers its parameters only, not the constants every rank already keeps.

    QLoRA: the blocks' linear weights quantized, and in 4 bits each expert of the fused MoE stacks
    as its own matrix (moe_experts.quantize: packed bytes and constants as `quantized_linear_bytes`);
    every other parameter
    (embeddings, norms, biases, router, LM head) in the compute dtype (quant.prepare_for_training
    keeps bf16 as bf16, unlike PEFT's blanket fp32 upcast). The one expert the matmul dequantizes
    at a time is not a weight FSDP2 shards: `expert_scratch_bytes`.

    An image-text checkpoint's vision tower and projector (`shape.vision_params`, loaded beside the
    text decoder and frozen) are base weights of the root: in the compute dtype, also under QLoRA,
    where bitsandbytes quantizes their linear layers too (so the price is an upper bound there).
    """
    if not rung.quantized_enabled:
        per_param = weight_bytes(request, cluster)
        return (shape.total_params + shape.vision_params) * per_param, shape.max_block_params * per_param
    other = qlora_compute_bytes(request, cluster)
    block_bytes = []
    for block in shape.blocks:
        quantized = sum(
            quantized_linear_bytes(lin.in_features, lin.out_features, bits=request.quant.bits, double_quant=request.quant.double_quant)
            for lin in block.linears
        )
        stacks = block.expert_stacks if request.quant.bits == 4 else ()
        quantized += sum(e * quantized_linear_bytes(i, o, bits=4, double_quant=request.quant.double_quant) for e, i, o in stacks)
        kept = block.params - block.linear_weight_params - sum(e * i * o for e, i, o in stacks)
        block_bytes.append(quantized + other * kept)
    total = other * (shape.root_params + shape.vision_params) + sum(
        b.num_blocks * nbytes for b, nbytes in zip(shape.blocks, block_bytes, strict=True))
    return total, max(nbytes - _block_constant_bytes(b, request) for b, nbytes in zip(shape.blocks, block_bytes, strict=True))


def host_embedding_bytes(shape: ModelShape, *, rung: Rung, request: PlanRequest, cluster: Cluster) -> int:
    """Bytes of the input embedding table that train.embedding_offload keeps in host RAM instead of
    on the GPU (0 where the one rule, homelab_ft/rules/embedding_offload.py, leaves it there): vocab x
    hidden in the dtype the base keeps its unquantized ends in (`base_weight_bytes`). The rung says
    whether (`Rung.embedding_offload`, which embedding_offload.placed set where the rung was built)."""
    if not rung.embedding_offload:
        return 0
    per_param = qlora_compute_bytes(request, cluster) if rung.quantized_enabled else weight_bytes(request, cluster)
    return shape.vocab_size * shape.hidden_size * per_param


def gathered_end_params(shape: ModelShape) -> int:
    """Parameters outside the blocks that FSDP2 holds gathered at the activation peak (the loss and
    the start of backward), as distributed.shard_ends places them: the LM head, a unit of its own
    gathered from its forward until its post-backward right after the loss, and the root unit's
    final norm. Untied embeddings are a unit of their own, gathered only while their forward runs,
    before any activation exists, and never in backward. A tied embedding is the head: it stays in
    the root unit, gathered from the first forward to the end of backward."""
    if shape.tie_word_embeddings:
        return shape.root_params
    return shape.root_params - shape.embedding_params


def largest_param(shape: ModelShape) -> int:
    """Elements of the largest single parameter, read from the built model: the embedding for any
    vocabulary of 32k and up, else a block's widest linear or its largest stacked-experts tensor."""
    return shape.largest_param


def optimizer_step_bytes(request: PlanRequest, cluster: Cluster, *, params: int, largest: int,
                         state_bytes: int) -> int:
    """Temporaries of one optimizer step over `params` parameters (largest tensor: `largest`).

    torch's AdamW (torch/optim/adamw.py) on GPUs takes the multi-tensor path, whose
    `_foreach_sqrt(exp_avg_sqs)` copies every second moment at once (1 x the states' dtype per
    parameter); on the CPU it loops over tensors, and `exp_avg_sq.sqrt() / bias_correction2_sqrt`
    holds two temporaries of the largest one (measured: bench/memory.py). bitsandbytes' 8-bit
    AdamW updates each tensor in place in one kernel.
    """
    if request.train.optimizer != "adamw":
        return 0
    if cluster.device == "cuda":
        return params * state_bytes
    return 2 * largest * state_bytes


# bitsandbytes' Optimizer8bit.get_state_buffer pages only the state of tensors with >= 1e5 elements.
PAGED_MIN_NUMEL = 100_000


def pageable_optimizer_bytes(shape: ModelShape, rung: Rung, request: PlanRequest, cluster: Cluster) -> int:
    """Optimizer state that paged_adamw_8bit allocates in CUDA unified memory (0 otherwise).

    The driver migrates such pages to host RAM when the GPU is oversubscribed and back when the
    step touches them, so this state may spill instead of failing the run. Only tensors of at
    least PAGED_MIN_NUMEL elements are paged: every large weight of a full fine-tune; of LoRA's
    A (r x in) and B (out x r) only those that big (r=16 on a 4096-wide model: A and B of the
    14336-wide MLP projections, not the attention ones). On the CPU paged AdamW is plain 8-bit.
    """
    if request.train.optimizer != "paged_adamw_8bit" or cluster.device != "cuda":
        return 0
    per_param = optimizer_bytes_per_param(request, 0)
    if not rung.adapters_enabled:
        big = shape.embedding_params + shape.vocab_size * shape.hidden_size * (not shape.tie_word_embeddings)
        for block in shape.blocks:
            linears = sum(n for lin in block.linears if (n := lin.in_features * lin.out_features) >= PAGED_MIN_NUMEL)
            experts = block.params - block.linear_weight_params if shape.is_moe else 0
            big += block.num_blocks * (linears + experts)
        return int(big * per_param)
    r = request.lora.r
    big = sum(block.num_blocks * sum(n for lin in targeted_linears(block, request)
                                     for n in (r * lin.in_features, r * lin.out_features) if n >= PAGED_MIN_NUMEL)
              for block in shape.blocks)
    if "all-linear" in request.lora.targets:  # moe_experts' A [E, r, in] and B [E, out, r]: one tensor each
        big += sum(block.num_blocks * sum(n for e, i, o in block.expert_stacks for n in (e * r * i, e * r * o)
                                          if n >= PAGED_MIN_NUMEL) for block in shape.blocks)
    return int(big * per_param)


def optimizer_bytes_per_param(request: PlanRequest, state_bytes: int) -> float:
    """AdamW keeps exp_avg and exp_avg_sq in the parameter's dtype (torch.optim.AdamW). bitsandbytes'
    8-bit AdamW keeps each as uint8 with an fp32 absmax per block of 256 (optim/optimizer.py)."""
    if request.train.optimizer == "adamw":
        return 2 * state_bytes
    return 2 * (1 + 4 / 256)
