"""The memory model behind the planner: pure arithmetic, no torch, no I/O.

For one option (method x sharding strategy x CPU offload) on one cluster, `estimate` returns the
bytes each device holds at peak, broken into the items that decide whether a run OOMs, and the
host RAM per node; network.py adds the bytes each rank sends per optimizer step and the seconds
of compute and communication per step. Every formula says where it comes from; docs/ladder.md
walks through a worked example and bench/plan_vs_measured.py checks the model-state bytes against
real runs.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from homelab_ft.plan.inputs import Cluster, PlanRequest
from homelab_ft.plan.network import (
    OFFLOAD_BYTES_PER_S,
    communication,
    compute_s,
    offload_s,
    prepass_s_per_pair,
)
from homelab_ft.plan.shapes import ModelShape
from homelab_ft.rung import DEFER_SYNC_TRAINABLE_FRACTION, Rung

GiB = 1024**3

# CUDA context + cuBLAS/cuDNN workspaces: ~0.5-0.8 GiB per process with torch 2.x on Ampere/Ada
# (nvidia-smi after `torch.zeros(1, device="cuda")` and one bf16 matmul).
CUDA_CONTEXT_BYTES = int(0.75 * GiB)
# What the caching allocator holds in fragmented blocks during a training step (reserved minus
# allocated at the peak, ~0.5 GiB for 8B-class steps). Spikes above that are what the planner's
# headroom fraction is for.
CUDA_FRAGMENTATION_BYTES = int(0.5 * GiB)
# A CPU training process before any tensor: python + torch + transformers + peft resident set.
CPU_PROCESS_BYTES = int(0.6 * GiB)
# Host RAM a CUDA training process keeps besides tensors (CUDA runtime, kernels, python heap).
CUDA_HOST_PROCESS_BYTES = 2 * GiB



@dataclass(frozen=True)
class Memory:
    """Peak bytes on one device, by item."""

    weights: int
    gradients: int
    optimizer: int
    activations: int
    logits: int
    gathered: int
    """Unsharded parameters (and one block's gradients) FSDP holds while computing."""
    context: int
    """The process before any tensor: the CUDA context and library workspaces (on the CPU the
    python + torch resident set)."""
    fragmentation: int = 0
    """What the CUDA caching allocator reserves beyond the allocated peak."""
    pageable: int = 0
    """The part of `optimizer` that paged_adamw_8bit keeps in CUDA unified memory: the driver moves
    it to host RAM when the GPU runs out (planner: spilled)."""
    recomputed: int = 0
    """The part of `activations` that is one block recomputed by activation checkpointing: it
    never coexists with the logits, which backward frees before it reaches the blocks."""
    gradients_in_backward: int = 0
    """Gradients alive at the activation peak (the start of backward): the LM head's, made by the
    first backward op while every activation is still held, and with gradient accumulation the
    sums of the earlier micro-batches. The others appear as backward frees activations."""
    step_temporary: int = 0
    """What the optimizer step allocates besides its state (optimizer_step_bytes)."""
    step_in_backward: bool = False
    """train.optimizer_in_backward: the step's temporaries appear inside backward, one parameter at
    a time, after the loss has freed its logits."""

    @property
    def overhead(self) -> int:
        return self.context + self.fragmentation

    @property
    def model_state(self) -> int:
        return self.weights + self.gradients + self.optimizer

    @property
    def forward_backward(self) -> int:
        """Bytes held during forward and backward: activations, the loss's logits (or, later, a
        recomputed block) and gathered units at their largest, next to weights and optimizer state."""
        in_backward = self.step_temporary if self.step_in_backward else 0
        return (self.weights + self.optimizer + self.gradients_in_backward + self.activations - self.recomputed
                + max(self.recomputed, self.logits, in_backward) + self.gathered)

    @property
    def optimizer_step(self) -> int:
        """Bytes held by the optimizer step: every gradient exists, activations are gone."""
        return self.model_state + (0 if self.step_in_backward else self.step_temporary)

    @property
    def total(self) -> int:
        """The peak is the larger phase, not the sum of all items: by the time every gradient
        exists, backward has freed the activations and logits they were computed from."""
        return max(self.forward_backward, self.optimizer_step) + self.overhead


@dataclass(frozen=True)
class Estimate:
    method: str
    """One of rung.METHODS."""
    strategy: str
    """One of rung.STRATEGIES."""
    cpu_offload: bool
    memory: Memory
    """Peak bytes per device, by item."""
    host_bytes: int
    """Peak host RAM on the busiest node (node 0, which also loads the weights)."""
    trainable_params: int
    comm_bytes: int
    """Bytes each rank sends per optimizer step."""
    comm_s: float
    """Seconds of communication per optimizer step: every collective's bytes and latency."""
    comm_hidden_s: float
    """The part of `comm_s` that runs while the device computes (FSDP2 prefetch, DDP buckets)."""
    compute_s: float
    offload_s: float
    prepass_s_per_pair: float
    """DPO of a full fine-tune: the one no-grad forward per pair (both answers) that caches the
    reference's log-probabilities before step 1; 0 otherwise (adapters run the reference in every step)."""
    spilled_bytes: int
    """Paged optimizer state the planner expects in host RAM because the GPU is full (see
    `with_paged_spill`); counted in `host_bytes` and, as PCIe traffic, in `offload_s`."""

    @property
    def step_s(self) -> float:
        """Compute plus the communication that compute does not hide (see network.communication);
        offload copies and the CPU optimizer step are not overlapped."""
        return self.compute_s + self.comm_s - self.comm_hidden_s + self.offload_s


# --------------------------------------------------------------------------------------------
# bytes per parameter


def weight_bytes(request: PlanRequest, cluster: Cluster) -> int:
    """Bytes per base weight: `auto` is bf16 on GPUs and fp32 on CPUs (config.ModelConfig.dtype)."""
    if request.dtype == "auto":
        return 2 if cluster.device == "cuda" else 4
    return 4 if request.dtype == "float32" else 2


def qlora_compute_bytes(request: PlanRequest, cluster: Cluster) -> int:
    """Bytes of QLoRA's non-quantized weights and activations: the compute dtype (`auto`: bf16 on
    GPUs, fp32 on CPUs). fp16 counts as fp32: quant.prepare_for_training upcasts non-quantized
    fp16 weights, since fp16's range overflows on LLM activation outliers."""
    if request.quant_compute_dtype == "auto":
        return 2 if cluster.device == "cuda" else 4
    return 2 if request.quant_compute_dtype == "bfloat16" else 4


def quantized_linear_bytes(in_features: int, out_features: int, *, bits: int, double_quant: bool) -> int:
    """Bytes of one bitsandbytes-quantized nn.Linear weight, quantization constants included.

    4-bit (bitsandbytes functional.quantize_4bit): two values per byte, one absmax per block of 64
    values; fp32 absmax, or with double quantization (QLoRA sec. 3) uint8 absmax re-quantized in
    blocks of 256 with fp32 second-level absmax plus one fp32 offset.
    8-bit (LLM.int8, Linear8bitLt): one byte per value plus an fp32 scale per output row (SCB).
    """
    n = in_features * out_features
    if bits == 8:
        return n + 4 * out_features
    blocks = math.ceil(n / 64)
    if double_quant:
        return math.ceil(n / 2) + blocks + 4 * math.ceil(blocks / 256) + 4
    return math.ceil(n / 2) + 4 * blocks


def adapter_bytes(method: str, request: PlanRequest, cluster: Cluster) -> int:
    """Bytes per adapter parameter: fp32, or with lora.dtype=compute bf16 when the base computes in
    bf16 (fp16 bases keep fp32 adapters)."""
    if request.lora_dtype != "compute":
        return 4
    name = request.quant_compute_dtype if method == "qlora" else request.dtype
    bf16 = name == "bfloat16" or (name == "auto" and cluster.device == "cuda")
    return 2 if bf16 else 4


def quant_state_bytes(shape: ModelShape, request: PlanRequest) -> int:
    """Bytes of the 4-bit quantisation constants (absmax, nested absmax, offset) of all blocks.

    A sharded 4-bit base (sharded_qlora.py) splits the packed weights over ranks but keeps each
    layer's constants whole on every rank: the kernel dequantizes the all-gathered weight with
    them. With double quantization that is ~1/64 byte per weight (Llama-3.1-70B: ~1.0 GiB per rank).
    """
    if request.quant_bits != 4:
        return 0
    total = 0
    for block in shape.blocks:
        per_block = 0
        for lin in block.linears:
            n = lin.in_features * lin.out_features
            per_block += quantized_linear_bytes(lin.in_features, lin.out_features, bits=4,
                                                double_quant=request.double_quant) - math.ceil(n / 2)
        total += block.num_blocks * per_block
    return total


def sharded_qlora_loading_bytes(shape: ModelShape, request: PlanRequest, cluster: Cluster) -> int:
    """Host RAM one rank holds while it fills its 4-bit shards (sharded_qlora.fill_from_safetensors):
    one tensor at a time as read from disk (bf16 assumed, 2 B) plus its compute-dtype copy. The
    largest is the embedding (vocab x hidden) or the widest linear layer; never the whole model."""
    largest = max([shape.vocab_size * shape.hidden_size] + [lin.in_features * lin.out_features
                                                             for b in shape.blocks for lin in b.linears])
    return largest * (2 + qlora_compute_bytes(request, cluster))


def lora_params_per_block(shape: ModelShape, request: PlanRequest, block_index: int) -> int:
    """Adapter parameters of one block: r x (in + out) per targeted linear (A: r x in, B: out x r).

    `all-linear` is PEFT's every nn.Linear except the LM head; MoE experts are nn.Parameters in
    transformers 5 and are not reached by it.
    """
    block = shape.blocks[block_index]
    return sum(request.lora_r * (lin.in_features + lin.out_features) for lin in _targeted(block, request))


def _targeted(block, request: PlanRequest):
    if "all-linear" in request.lora_targets:
        return block.linears
    return tuple(lin for lin in block.linears if any(lin.name.endswith(t) for t in request.lora_targets))


def adapter_params(shape: ModelShape, request: PlanRequest) -> int:
    return sum(b.num_blocks * lora_params_per_block(shape, request, i) for i, b in enumerate(shape.blocks))


def base_weight_bytes(shape: ModelShape, method: str, request: PlanRequest, cluster: Cluster) -> tuple[int, int]:
    """(total bytes, largest block's bytes) of the unsharded base weights.

    QLoRA: the blocks' linear weights quantized; every
    other parameter (embeddings, norms, biases, LM head, MoE experts) in the compute dtype
    (quant.prepare_for_training keeps bf16 as bf16, unlike PEFT's blanket fp32 upcast).
    """
    if method != "qlora":
        per_param = weight_bytes(request, cluster)
        return shape.total_params * per_param, shape.max_block_params * per_param
    other = qlora_compute_bytes(request, cluster)
    block_bytes = []
    for block in shape.blocks:
        quantized = sum(
            quantized_linear_bytes(lin.in_features, lin.out_features, bits=request.quant_bits, double_quant=request.double_quant)
            for lin in block.linears
        )
        block_bytes.append(quantized + other * (block.params - block.linear_weight_params))
    total = other * shape.root_params + sum(b.num_blocks * nbytes for b, nbytes in zip(shape.blocks, block_bytes, strict=True))
    return total, max(block_bytes)


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
    """Elements of the largest single parameter: the embedding for any vocabulary of 32k and up,
    else a block's widest linear or half of its stacked MoE experts (gate_up and down tensors)."""
    biggest = shape.embedding_params
    for block in shape.blocks:
        biggest = max(biggest, *(lin.weight_params for lin in block.linears), block.expert_params // 2)
    return biggest


def optimizer_step_bytes(request: PlanRequest, cluster: Cluster, *, params: int, largest: int,
                         state_bytes: int) -> int:
    """Temporaries of one optimizer step over `params` parameters (largest tensor: `largest`).

    torch's AdamW (torch/optim/adamw.py) on GPUs takes the multi-tensor path, whose
    `_foreach_sqrt(exp_avg_sqs)` copies every second moment at once (1 x the states' dtype per
    parameter); on the CPU it loops over tensors, and `exp_avg_sq.sqrt() / bias_correction2_sqrt`
    holds two temporaries of the largest one (measured: bench/memory.py). bitsandbytes' 8-bit
    AdamW updates each tensor in place in one kernel.
    """
    if request.optimizer != "adamw":
        return 0
    if cluster.device == "cuda":
        return params * state_bytes
    return 2 * largest * state_bytes


# bitsandbytes' Optimizer8bit.get_state_buffer pages only the state of tensors with >= 1e5 elements.
PAGED_MIN_NUMEL = 100_000


def pageable_optimizer_bytes(shape: ModelShape, method: str, request: PlanRequest, cluster: Cluster) -> int:
    """Optimizer state that paged_adamw_8bit allocates in CUDA unified memory (0 otherwise).

    The driver migrates such pages to host RAM when the GPU is oversubscribed and back when the
    step touches them, so this state may spill instead of failing the run. Only tensors of at
    least PAGED_MIN_NUMEL elements are paged: every large weight of a full fine-tune; of LoRA's
    A (r x in) and B (out x r) only those that big (r=16 on a 4096-wide model: A and B of the
    14336-wide MLP projections, not the attention ones). On the CPU paged AdamW is plain 8-bit.
    """
    if request.optimizer != "paged_adamw_8bit" or cluster.device != "cuda":
        return 0
    per_param = optimizer_bytes_per_param(request, 0)
    if method == "full":
        big = shape.embedding_params + shape.vocab_size * shape.hidden_size * (not shape.tie_word_embeddings)
        for block in shape.blocks:
            linears = sum(n for lin in block.linears if (n := lin.in_features * lin.out_features) >= PAGED_MIN_NUMEL)
            experts = block.params - block.linear_weight_params if shape.is_moe else 0
            big += block.num_blocks * (linears + experts)
        return int(big * per_param)
    r = request.lora_r
    big = sum(block.num_blocks * sum(n for lin in _targeted(block, request)
                                     for n in (r * lin.in_features, r * lin.out_features) if n >= PAGED_MIN_NUMEL)
              for block in shape.blocks)
    return int(big * per_param)


def with_paged_spill(est: Estimate, *, budget: int) -> Estimate:
    """`est` with the paged optimizer state that does not fit under `budget` moved to host RAM.

    The driver pages the state out when the GPU is full and in again when the optimizer step reads
    and writes it: each spilled byte crosses PCIe twice per step, unoverlapped. An estimate that
    would still not fit with all of it spilled is returned unchanged.
    """
    over = est.memory.total - budget
    if over <= 0 or over > est.memory.pageable:
        return est
    return dataclasses.replace(est, spilled_bytes=over, host_bytes=est.host_bytes + over,
                               offload_s=est.offload_s + 2 * over / OFFLOAD_BYTES_PER_S)


def optimizer_bytes_per_param(request: PlanRequest, state_bytes: int) -> float:
    """AdamW keeps exp_avg and exp_avg_sq in the parameter's dtype (torch.optim.AdamW). bitsandbytes'
    8-bit AdamW keeps each as uint8 with an fp32 absmax per block of 256 (optim/optimizer.py)."""
    if request.optimizer == "adamw":
        return 2 * state_bytes
    return 2 * (1 + 4 / 256)


# --------------------------------------------------------------------------------------------
# activations


def activation_bytes(shape: ModelShape, method: str, request: PlanRequest, act_bytes: int, *,
                     offloaded: bool = False) -> int:
    """Tensors autograd keeps for backward on one device, for one micro-batch.

    Per block and token, in elements (HF Llama-style block with SDPA attention, which keeps no
    seq x seq score matrix; after Korthikanti et al. 2022, "Reducing Activation Recomputation"):
      6h     two RMSNorms: input (kept in fp32 by the HF norm = 2h in 16-bit units) + normed output
      3q     attention output, its reshaped copy fed to o_proj, and q after RoPE
      2kv    k and v after RoPE (kept by SDPA)
      4i     MLP: gate output (for SiLU), SiLU output and up output (for the product), down input
    LoRA adds, per targeted linear, its dropout's copy of the input plus a 1-byte mask (dropout > 0)
    and lora_A's r outputs. With activation checkpointing only each block's input (h) is kept, plus
    one block recomputed in full during its backward; with activation offload (`offloaded`) those
    block inputs wait in host RAM and only the running block's input is back on the device.
    """
    tokens = request.seq_len * request.rows_per_micro_batch
    per_block = _block_activation_bytes(shape, method, request, act_bytes)
    if request.activation_checkpointing and offloaded:
        per_token = shape.hidden_size * act_bytes + max(per_block)
    elif request.activation_checkpointing:
        per_token = shape.num_layers * shape.hidden_size * act_bytes + max(per_block)
    else:
        per_token = sum(b.num_blocks * nbytes for b, nbytes in zip(shape.blocks, per_block, strict=True))
    return tokens * per_token


def recomputed_block_bytes(shape: ModelShape, method: str, request: PlanRequest, act_bytes: int) -> int:
    """The part of `activation_bytes` that one block recomputed by activation checkpointing holds:
    it exists only once backward has reached the blocks, after the loss has freed its logits."""
    if not request.activation_checkpointing:
        return 0
    return request.seq_len * request.rows_per_micro_batch * max(_block_activation_bytes(shape, method, request, act_bytes))


def _block_activation_bytes(shape: ModelShape, method: str, request: PlanRequest, act_bytes: int) -> list[int]:
    """Bytes per token that autograd keeps for each block kind (see activation_bytes)."""
    per_block = []
    for block in shape.blocks:
        q = shape.num_attention_heads * shape.head_dim
        kv = shape.num_kv_heads * shape.head_dim
        nbytes = (6 * shape.hidden_size + 3 * q + 2 * kv + 4 * block.mlp_width) * act_bytes
        if method != "full":
            targets = _targeted(block, request)
            if request.lora_dropout > 0:
                nbytes += sum(lin.in_features for lin in targets) * (act_bytes + 1)
            nbytes += len(targets) * request.lora_r * act_bytes
        per_block.append(nbytes)
    return per_block


def offloaded_activation_bytes(shape: ModelShape, request: PlanRequest, act_bytes: int) -> int:
    """Host bytes per rank of activation offload: every block's input, and the final norm's."""
    return request.seq_len * request.rows_per_micro_batch * (shape.num_layers + 1) * shape.hidden_size * act_bytes


def activation_dtype_bytes(method: str, request: PlanRequest, cluster: Cluster) -> int:
    """Bytes per activation element: the weights' dtype, or for QLoRA the 4-bit base's compute dtype."""
    return qlora_compute_bytes(request, cluster) if method == "qlora" else weight_bytes(request, cluster)


def activation_offload_host_bytes(shape: ModelShape, *, rung: Rung, request: PlanRequest, cluster: Cluster) -> int:
    """Host bytes per rank the rung's activation offload holds (0 when off, or without a GPU to
    offload from); preflight refuses a run whose node has not that much RAM available."""
    if not (rung.activation_offload and rung.activation_checkpointing and cluster.device == "cuda"):
        return 0
    return offloaded_activation_bytes(shape, request, activation_dtype_bytes(rung.method, request, cluster))


# train.compile (compiling.py) is priced as eager, on purpose. Its fused kernels only free
# intermediates: the compiled cross-entropy stores no fp32 log-softmax (bench/compile.py: a loss
# chunk peaks at 8.2 B per logit instead of 12.3), and AOTAutograd's min-cut partitioner picks
# what a compiled block saves for backward to keep it small, recomputing cheap elementwise results
# instead of storing them; so the eager figures below are an upper bound (tests/gpu/
# test_cuda_compile.py checks a compiled step's peak against eager's). Its speed (1.1-1.2x tokens
# per CPU-second, bench/compile.py) is not credited to step time either, and the first step's
# compiling (seconds to minutes per distinct block graph) is a one-off that step time leaves out.
def logits_bytes(shape: ModelShape, request: PlanRequest, act_bytes: int) -> int:
    """The loss's peak: logits of `rows` tokens x vocab, often the largest single item without
    chunking. Per row and vocab entry: the LM head output (activation dtype); its fp32 copy
    (`logits.float()`, a no-op in fp32); cross-entropy's fp32 log-softmax kept for backward, and
    backward's fp32 gradient of the same size while that is alive. Gemma 2's tanh soft-capping
    keeps one more copy. Rows are the micro-batch's tokens, or with the chunked loss (loss.py) one
    chunk, plus the trained rows of the hidden states it gathers and their gradient
    (2 x tokens x hidden). DPO's answer log-probabilities (preference.sequence_logps) take the
    full logits of twice the rows (the chunked loss does not serve them yet); the reference's
    no-grad forward runs before the policy's and leaves only one number per row behind."""
    tokens = request.seq_len * request.rows_per_micro_batch
    per_entry = act_bytes + (4 if act_bytes != 4 else 0) + 4 + 4 + (4 if shape.logit_softcapping else 0)
    if not request.chunked_loss:
        return tokens * shape.vocab_size * per_entry
    rows = min(request.loss_chunk_tokens, tokens)
    return rows * shape.vocab_size * per_entry + 2 * tokens * shape.hidden_size * act_bytes


# --------------------------------------------------------------------------------------------
# one option


@dataclass(frozen=True)
class _Sizes:
    """The unsharded byte counts an option's items are made of (see `_sizes`)."""

    w_bytes: int
    """Per base weight (weight_bytes)."""
    act_bytes: int
    """Per activation element, and per element of the unquantized ends (embeddings, norms, head)."""
    base_bytes: int
    """The whole model's weights, adapters included."""
    block_bytes: int
    """The largest block's base weights."""
    trainable: int
    """Trainable parameters."""
    state_bytes: int
    """Per trainable parameter: its gradient's, and each AdamW moment's."""


def _sizes(shape: ModelShape, method: str, request: PlanRequest, cluster: Cluster) -> _Sizes:
    w_bytes = weight_bytes(request, cluster)
    # activations, and the unquantized ends (embeddings, norms, head), are in the compute dtype
    act_bytes = activation_dtype_bytes(method, request, cluster)
    base_bytes, block_bytes = base_weight_bytes(shape, method, request, cluster)
    if method == "full":
        trainable, state_bytes = shape.total_params, w_bytes
    else:
        # PEFT creates adapters in fp32 even on a 16-bit base (get_peft_model's
        # autocast_adapter_dtype=True), so their gradients and AdamW states are fp32 too, unless
        # lora.dtype=compute keeps them in bf16 (modeling.attach_lora).
        trainable, state_bytes = adapter_params(shape, request), adapter_bytes(method, request, cluster)
        base_bytes += trainable * state_bytes
    return _Sizes(w_bytes=w_bytes, act_bytes=act_bytes, base_bytes=base_bytes, block_bytes=block_bytes,
                  trainable=trainable, state_bytes=state_bytes)


def estimate(shape: ModelShape, *, rung: Rung, request: PlanRequest, cluster: Cluster) -> Estimate:
    """Peak memory per device, host RAM, traffic and time per step for one option: the `rung` the
    trainer would run (rung.py), whose properties say how parameters are spread."""
    method, cpu_offload, shards = rung.method, rung.cpu_offload, rung.shard_size
    # The request may leave the savers to the planner (`auto`); the rung carries what runs.
    request = dataclasses.replace(request, activation_checkpointing=rung.activation_checkpointing,
                                  activation_offload=rung.activation_offload)
    sizes = _sizes(shape, method, request, cluster)
    act_host = activation_offload_host_bytes(shape, rung=rung, request=request, cluster=cluster)
    device, resident = _device_memory(shape, sizes, rung=rung, request=request, cluster=cluster, act_host=act_host)
    offloaded = resident if cpu_offload else 0
    loading = _loading_bytes(shape, method, request, cluster, base_bytes=sizes.base_bytes,
                             sharded=shards > 1 or cpu_offload)
    host = _host_bytes(device, offloaded=int(offloaded) + act_host, loading=loading, cluster=cluster)
    compute = compute_s(shape, method, request, cluster)
    comm = communication(shape, sizes.base_bytes, sizes.trainable, rung=rung, request=request, cluster=cluster,
                         root_bytes=shape.root_params * sizes.act_bytes, grad_bytes=sizes.state_bytes,
                         sync_deferred=sync_deferred(shape, rung=rung, trainable=sizes.trainable))
    offload = offload_s(sizes.base_bytes / shards, sizes.trainable / shards, sizes.w_bytes, request) if cpu_offload else 0.0
    return Estimate(
        method=method, strategy=rung.strategy, cpu_offload=cpu_offload, memory=device, host_bytes=host,
        trainable_params=sizes.trainable, comm_bytes=comm.sent_bytes, comm_s=comm.seconds,
        comm_hidden_s=comm.hidden_s(compute), compute_s=compute,
        # each micro-batch's block inputs go to the host in forward and come back in backward
        offload_s=offload + 2 * act_host * request.grad_accum_steps / OFFLOAD_BYTES_PER_S,
        prepass_s_per_pair=prepass_s_per_pair(shape, method, request, cluster), spilled_bytes=0,
    )


def sync_deferred(shape: ModelShape, *, rung: Rung, trainable: int) -> bool:
    """FSDP2 reduce-scatters gradients once per step, not on every micro-batch: SHARD_GRAD_OP keeps
    its blocks gathered anyway, and the trainer defers the sync when few parameters train
    (DEFER_SYNC_TRAINABLE_FRACTION; a deferred sync keeps a whole unsharded gradient per rank)."""
    return not rung.reshard_after_forward or trainable < DEFER_SYNC_TRAINABLE_FRACTION * shape.total_params


def _device_memory(shape: ModelShape, sizes: _Sizes, *, rung: Rung, request: PlanRequest, cluster: Cluster,
                   act_host: int) -> tuple[Memory, float]:
    """(peak bytes on one device by item, the model state a rank holds, on the device or offloaded)."""
    method, cpu_offload, shards = rung.method, rung.cpu_offload, rung.shard_size
    trainable, state_bytes, act_bytes = sizes.trainable, sizes.state_bytes, sizes.act_bytes
    # A sharded 4-bit base splits the packed bytes; the quantisation constants stay whole per rank.
    replicated = quant_state_bytes(shape, request) if method == "qlora" and shards > 1 else 0
    weights = (sizes.base_bytes - replicated) / shards + replicated
    gradients = trainable * state_bytes / shards
    in_backward = request.optimizer_in_backward and method == "full"
    if in_backward:
        # optim_backward.py: a gradient lives from its hook to its parameter's step; the largest
        # one alone bounds what is left of the optimizer phase.
        gradients = largest_param(shape) * state_bytes / shards
    optimizer = trainable * optimizer_bytes_per_param(request, state_bytes) / shards
    # The LM head's gradient is the first one backward makes (with FSDP2 unsharded until the head
    # unit's post-backward right after the loss, a tied head's in the root unit until backward
    # ends); a tied head's is the embedding's. Adapters' are negligible.
    head_grads = shape.vocab_size * shape.hidden_size * state_bytes if method == "full" else 0
    step_temp = _step_temporary_bytes(shape, method, request, cluster, trainable=trainable, state_bytes=state_bytes,
                                      in_backward=in_backward) // shards
    device = Memory(
        weights=int(0 if cpu_offload else weights),
        gradients=int(0 if cpu_offload else gradients),
        optimizer=int(0 if cpu_offload else optimizer),
        activations=activation_bytes(shape, method, request, act_bytes, offloaded=act_host > 0),
        recomputed=recomputed_block_bytes(shape, method, request, act_bytes),
        logits=logits_bytes(shape, request, act_bytes),
        gathered=int(_gathered_bytes(shape, sizes, rung=rung, request=request)),
        context=CUDA_CONTEXT_BYTES if cluster.device == "cuda" else CPU_PROCESS_BYTES,
        fragmentation=CUDA_FRAGMENTATION_BYTES if cluster.device == "cuda" else 0,
        pageable=int(0 if cpu_offload else pageable_optimizer_bytes(shape, method, request, cluster) / shards),
        gradients_in_backward=int(gradients if request.grad_accum_steps > 1 and not cpu_offload and not in_backward else 0)
        + (head_grads if shards > 1 or cpu_offload or request.grad_accum_steps == 1 else 0),
        step_temporary=int(0 if cpu_offload else step_temp),
        step_in_backward=in_backward,
    )
    return device, weights + gradients + optimizer


def _gathered_bytes(shape: ModelShape, sizes: _Sizes, *, rung: Rung, request: PlanRequest) -> float:
    """Unsharded parameters FSDP holds while computing (Memory.gathered)."""
    if rung.shard_size == 1 and not rung.cpu_offload:
        return 0
    # In backward FSDP holds one block's unsharded gradients in the param dtype plus their copy in
    # the reduce dtype for the reduce-scatter (full fine-tuning; adapter gradients are tiny).
    block_grads = shape.max_block_params * (sizes.w_bytes + request.reduce_bytes) if rung.method == "full" else 0
    if not rung.reshard_after_forward:
        # SHARD_GRAD_OP: every block stays gathered from its forward to its backward; untied
        # embeddings are resharded after theirs (distributed.shard_ends).
        return sizes.base_bytes - (shape.root_params - gathered_end_params(shape)) * sizes.act_bytes + block_grads
    # The LM head (and the root unit's final norm, or a tied embedding) gathered through the
    # loss and its backward, and the running block plus one prefetched block.
    return gathered_end_params(shape) * sizes.act_bytes + 2 * sizes.block_bytes + block_grads


def _step_temporary_bytes(shape: ModelShape, method: str, request: PlanRequest, cluster: Cluster, *,
                          trainable: int, state_bytes: int, in_backward: bool) -> int:
    """The optimizer step's temporaries before sharding: with the step in backward, one parameter
    at a time (the LM head's while activations live); else the whole step over the trainable set."""
    if in_backward:
        return optimizer_step_bytes(request, cluster, params=largest_param(shape), largest=largest_param(shape),
                                    state_bytes=state_bytes)
    if method == "full":
        largest = largest_param(shape)
    else:
        largest = max(lin.in_features + lin.out_features for b in shape.blocks for lin in _targeted(b, request)) \
            * request.lora_r if trainable else 0
    return optimizer_step_bytes(request, cluster, params=trainable, largest=largest, state_bytes=state_bytes)


def _loading_bytes(shape: ModelShape, method: str, request: PlanRequest, cluster: Cluster, *, base_bytes: int,
                   sharded: bool) -> int:
    """Host RAM of a sharded load on node 0: LoRA/full take rank 0's whole copy; QLoRA fills its
    shards tensor by tensor, on every local rank. Single-device loads stream from the page cache."""
    if not sharded:
        return 0
    if method == "qlora":
        return cluster.gpus_per_node * sharded_qlora_loading_bytes(shape, request, cluster)
    return base_bytes



def _host_bytes(device: Memory, *, offloaded: int, loading: int, cluster: Cluster) -> int:
    """Host RAM on node 0. On a CPU 'device' this is every process's memory. On GPUs: the process
    overhead, offloaded shards of every local rank, and, for sharded runs, one full copy of the
    weights that rank 0 loads before broadcasting (sharded_loading's rank-0 load), or for a sharded
    4-bit base one tensor per local rank (`loading`; single-device loads stream safetensors from
    the page cache straight to the GPU)."""
    per_node = cluster.gpus_per_node
    if cluster.device == "cpu":
        return device.total * per_node
    return per_node * (CUDA_HOST_PROCESS_BYTES + offloaded) + loading

