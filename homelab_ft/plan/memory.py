"""The memory, network and time model behind the planner: pure arithmetic, no torch, no I/O.

For one option (method x sharding strategy x CPU offload) on one cluster, `estimate` returns the
bytes each device holds at peak, broken into the items that decide whether a run OOMs, the host
RAM per node, the bytes each rank sends per optimizer step, and seconds of compute and
communication per step. Every formula says where it comes from; docs/ladder.md walks through a
worked example and bench/plan_vs_measured.py checks the model-state bytes against real runs.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Literal

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

# Effective bandwidths in bytes/s. PCIe: NCCL busbw on PCIe 4.0 x16 without peer-to-peer (GeForce
# cards route through host memory) is ~10 GB/s in nccl-tests. NVLink: the 3090/A6000 bridge gives
# ~50 GB/s per direction. Ethernet: link rate x 0.9 (TCP/IP framing; NCCL socket transport reaches
# ~90% of line rate on large messages). CPU/gloo inside a machine: shared-memory copies, ~5 GB/s.
LINK_BYTES_PER_S = {"pcie": 10e9, "nvlink": 50e9, "cpu": 5e9}
ETHERNET_EFFICIENCY = 0.9
# Latency of a tiny all-reduce between two ranks when the cluster file has no measurement. Ethernet:
# ~0.2 ms for NCCL's socket transport or gloo between two homelab machines (two kernel TCP stack
# passes each way plus NIC interrupt moderation, ~25-50 us a hop on 1-10 GbE, and the library's
# own ~50 us). PCIe: NCCL's small-message all-reduce between two GPUs of one machine, ~20 us
# (nccl-tests); NVLink ~10 us. CPU/gloo on one machine: 0.38 ms measured here (2 processes over
# loopback TCP on a loaded 2-core machine, 200 tiny all-reduces).
LATENCY_S = {"ethernet": 0.2e-3, "pcie": 0.02e-3, "nvlink": 0.01e-3, "cpu": 0.38e-3}
# gloo (every CPU run) is slower at FSDP2's collectives than the ring model: its reduce_scatter_tensor
# takes as long as an all-reduce of the whole input (2 MiB per rank: 374 ms vs 358 ms for the 4 MiB
# all-reduce at 100 Mbit, 1.91 s vs 1.98 s at 20, 36 ms vs 35 ms at 1000), and its
# all_gather_into_tensor reaches ~0.7 of the all-reduce's bus bandwidth (0.62-0.75 at 0.5-2 MiB and
# 20-1000 Mbit); measured between two namespace nodes with torch 2.13 (bench/network.py's links).
# NCCL's ring collectives reach the link's bus bandwidth for all three.
GLOO_REDUCE_SCATTER_FACTOR = 2.0
GLOO_ALL_GATHER_EFFICIENCY = 0.7
# torch DDP's gradient buckets (DistributedDataParallel's bucket_cap_mb=25 and the smaller first
# bucket, dist._DEFAULT_FIRST_BUCKET_BYTES): each bucket is all-reduced as soon as its gradients
# are ready, so all but the last one overlap the rest of backward.
DDP_BUCKET_BYTES = 25 * 1024**2
DDP_FIRST_BUCKET_BYTES = 1024**2
# Small all-reduces the training loop issues every optimizer step whatever the strategy
# (trainer.py): the stop request, the global trained-token count, the loss sum and the read-token
# count; FSDP2 adds one for the global gradient norm (distributed.clip_grad_norm_).
LOOP_ALL_REDUCES = 4
# Host<->device copies of CPU offload: pinned-memory PCIe 4.0 x16 transfers reach ~12 GB/s.
OFFLOAD_BYTES_PER_S = 12e9
# torch's foreach AdamW on the CPU is memory-bound (~28 bytes read/written per fp32 parameter);
# on a desktop with ~20 GB/s of usable bandwidth that is ~0.5e9 parameters per second.
CPU_ADAM_PARAMS_PER_S = 0.5e9
# QLoRA steps are ~1.3x slower than 16-bit LoRA: every matmul first dequantizes its NF4 weight
# (QLoRA paper, appendix; bitsandbytes 0.4x benchmarks on Ampere).
QLORA_SLOWDOWN = 1.3

Method = Literal["qlora", "lora", "full"]
Strategy = Literal["no_shard", "full_shard", "shard_grad_op", "hybrid_shard"]


@dataclass(frozen=True)
class Cluster:
    """What the plan is for: nodes x devices per node, memory, links, throughput."""

    device: Literal["cuda", "cpu"]
    nodes: int
    gpus_per_node: int
    """Processes per node: one per GPU, or CPU worker processes."""
    device_bytes: int
    """Memory per device; on `cpu`, each process's share of the node's RAM."""
    host_ram_bytes: int
    """RAM per node."""
    intra_link: Literal["pcie", "nvlink"] = "pcie"
    inter_link_gbit: float = 1.0
    tflops: float = 40.0
    """Sustained training throughput per device in TFLOPS (peak x utilisation; see hardware.py)."""
    source: str = "recipe"
    """Where the description came from (recipe, flags, detected, a cluster file), shown in the plan."""
    inter_link_measured: bool = False
    """`inter_link_gbit` is a measured collective bus bandwidth (a cluster file), used as it is;
    otherwise it is the nominal Ethernet speed, of which collectives get ETHERNET_EFFICIENCY."""
    inter_latency_s: float | None = None
    """Measured tiny all-reduce between nodes; None: LATENCY_S["ethernet"]."""
    intra_link_gbit: float | None = None
    """Measured collective bus bandwidth inside a node; None: LINK_BYTES_PER_S of the link kind."""
    intra_latency_s: float | None = None
    """Measured tiny all-reduce inside a node; None: LATENCY_S of the link kind."""

    @property
    def world_size(self) -> int:
        return self.nodes * self.gpus_per_node

    @property
    def intra_kind(self) -> str:
        return "cpu" if self.device == "cpu" else self.intra_link

    @property
    def inter_bytes_per_s(self) -> float:
        """Bytes per second one rank's ring collective moves between nodes."""
        efficiency = 1.0 if self.inter_link_measured else ETHERNET_EFFICIENCY
        return self.inter_link_gbit * 1e9 / 8 * efficiency

    @property
    def intra_bytes_per_s(self) -> float:
        if self.intra_link_gbit is not None:
            return self.intra_link_gbit * 1e9 / 8
        return LINK_BYTES_PER_S[self.intra_kind]

    @property
    def inter_hop_s(self) -> float:
        """One ring step's latency between nodes: a tiny all-reduce of two ranks takes two steps
        (reduce-scatter then all-gather), so half of what doctor measures."""
        return (self.inter_latency_s if self.inter_latency_s is not None else LATENCY_S["ethernet"]) / 2

    @property
    def intra_hop_s(self) -> float:
        return (self.intra_latency_s if self.intra_latency_s is not None else LATENCY_S[self.intra_kind]) / 2


@dataclass(frozen=True)
class PlanRequest:
    """What the recipe asks for (planner.request_from_recipe). No defaults here: the recipe's live once,
    in config.py, and `planner.default_request()` is a recipe that sets nothing."""

    method: Literal["auto", "qlora", "lora", "full"]
    strategy: Literal["auto", "no_shard", "full_shard", "shard_grad_op", "hybrid_shard"]
    cpu_offload: bool
    """True forces offload. False forbids it when a strategy is named; with `auto` the planner may
    still choose it when nothing else fits."""
    seq_len: int
    micro_batch_size: int
    grad_accum_steps: int
    activation_checkpointing: bool | Literal["auto"]
    """The recipe's setting; `auto` lets the planner turn it on (planner.saver_levels). What an
    estimate prices is the rung's value."""
    activation_offload: bool | Literal["auto"]
    """With checkpointing: block inputs wait in host RAM (offload.py); no effect without a GPU."""
    loss_chunk_tokens: int
    """Tokens per LM-head/cross-entropy chunk (loss.py); 0: the full logits of the micro-batch."""
    optimizer_in_backward: bool
    """Full fine-tunes: each parameter steps from its gradient hook, its gradient freed at once."""
    lora_r: int
    lora_dtype: Literal["float32", "compute"]
    lora_dropout: float
    lora_targets: tuple[str, ...]
    quant_bits: int
    double_quant: bool
    quant_compute_dtype: Literal["auto", "bfloat16", "float16", "float32"]
    optimizer: Literal["adamw", "adamw_8bit", "paged_adamw_8bit"]
    dtype: Literal["auto", "float32", "bfloat16", "float16"]
    reduce_dtype: Literal["float32", "bfloat16"]
    headroom: float
    objective: Literal["sft", "dpo"]
    """`dpo`: every micro-batch row is a pair, run as a chosen and a rejected sequence in one batch."""

    @property
    def rows_per_micro_batch(self) -> int:
        """Sequences one forward carries: DPO concatenates each pair's chosen and rejected rows."""
        return self.micro_batch_size * (2 if self.objective == "dpo" else 1)


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
    method: Method
    strategy: Strategy
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
        """Compute plus the communication that compute does not hide (see `_communication`);
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


def adapter_bytes(method: Method, request: PlanRequest, cluster: Cluster) -> int:
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


def base_weight_bytes(shape: ModelShape, method: Method, request: PlanRequest, cluster: Cluster) -> tuple[int, int]:
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


def pageable_optimizer_bytes(shape: ModelShape, method: Method, request: PlanRequest, cluster: Cluster) -> int:
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


def activation_bytes(shape: ModelShape, method: Method, request: PlanRequest, act_bytes: int, *,
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


def recomputed_block_bytes(shape: ModelShape, method: Method, request: PlanRequest, act_bytes: int) -> int:
    """The part of `activation_bytes` that one block recomputed by activation checkpointing holds:
    it exists only once backward has reached the blocks, after the loss has freed its logits."""
    if not request.activation_checkpointing:
        return 0
    return request.seq_len * request.rows_per_micro_batch * max(_block_activation_bytes(shape, method, request, act_bytes))


def _block_activation_bytes(shape: ModelShape, method: Method, request: PlanRequest, act_bytes: int) -> list[int]:
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


def activation_dtype_bytes(method: Method, request: PlanRequest, cluster: Cluster) -> int:
    """Bytes per activation element: the weights' dtype, or for QLoRA the 4-bit base's compute dtype."""
    return qlora_compute_bytes(request, cluster) if method == "qlora" else weight_bytes(request, cluster)


def activation_offload_host_bytes(shape: ModelShape, *, rung: Rung, request: PlanRequest, cluster: Cluster) -> int:
    """Host bytes per rank the rung's activation offload holds (0 when off, or without a GPU to
    offload from); preflight refuses a run whose node has not that much RAM available."""
    if not (rung.activation_offload and rung.activation_checkpointing and cluster.device == "cuda"):
        return 0
    return offloaded_activation_bytes(shape, request, activation_dtype_bytes(rung.method, request, cluster))


def chunked_loss(request: PlanRequest) -> bool:
    """The SFT loss runs in chunks (loss.py) unless turned off; DPO's log-probabilities do not yet."""
    return request.loss_chunk_tokens > 0 and request.objective != "dpo"


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
    if not chunked_loss(request):
        return tokens * shape.vocab_size * per_entry
    rows = min(request.loss_chunk_tokens, tokens)
    return rows * shape.vocab_size * per_entry + 2 * tokens * shape.hidden_size * act_bytes


# --------------------------------------------------------------------------------------------
# one option


def estimate(shape: ModelShape, *, rung: Rung, request: PlanRequest, cluster: Cluster) -> Estimate:
    """Peak memory per device, host RAM, traffic and time per step for one option: the `rung` the
    trainer would run (rung.py), whose properties say how parameters are spread."""
    method, strategy, cpu_offload = rung.method, rung.strategy, rung.cpu_offload
    # The request may leave the savers to the planner (`auto`); the rung carries what runs.
    request = dataclasses.replace(request, activation_checkpointing=rung.activation_checkpointing,
                                  activation_offload=rung.activation_offload)
    shards = rung.shard_size  # all ranks, one node's for HYBRID_SHARD, 1 unsharded
    w_bytes = weight_bytes(request, cluster)
    # activations, and the unquantized ends (embeddings, norms, head), are in the compute dtype
    act_bytes = end_bytes = activation_dtype_bytes(method, request, cluster)
    base_bytes, block_bytes = base_weight_bytes(shape, method, request, cluster)
    if method == "full":
        trainable, state_bytes = shape.total_params, w_bytes
    else:
        # PEFT creates adapters in fp32 even on a 16-bit base (get_peft_model's
        # autocast_adapter_dtype=True), so their gradients and AdamW states are fp32 too, unless
        # lora.dtype=compute keeps them in bf16 (modeling.attach_lora).
        trainable, state_bytes = adapter_params(shape, request), adapter_bytes(method, request, cluster)
        base_bytes += trainable * state_bytes
    # A sharded 4-bit base splits the packed bytes; the quantisation constants stay whole per rank.
    replicated = quant_state_bytes(shape, request) if method == "qlora" and shards > 1 else 0
    weights = (base_bytes - replicated) / shards + replicated
    gradients = trainable * state_bytes / shards
    in_backward = request.optimizer_in_backward and method == "full"
    if in_backward:
        # optim_backward.py: a gradient lives from its hook to its parameter's step; the largest
        # one alone bounds what is left of the optimizer phase.
        gradients = largest_param(shape) * state_bytes / shards
    optimizer = trainable * optimizer_bytes_per_param(request, state_bytes) / shards

    # In backward FSDP holds one block's unsharded gradients in the param dtype plus their copy in
    # the reduce dtype for the reduce-scatter (full fine-tuning; adapter gradients are tiny).
    block_grads = shape.max_block_params * (w_bytes + _reduce_bytes(request)) if method == "full" else 0
    ends_bytes = gathered_end_params(shape) * end_bytes
    if shards == 1 and not cpu_offload:
        gathered = 0
    elif not rung.reshard_after_forward:
        # SHARD_GRAD_OP: every block stays gathered from its forward to its backward; untied
        # embeddings are resharded after theirs (distributed.shard_ends).
        gathered = base_bytes - (shape.root_params - gathered_end_params(shape)) * end_bytes + block_grads
    else:
        # The LM head (and the root unit's final norm, or a tied embedding) gathered through the
        # loss and its backward, and the running block plus one prefetched block.
        gathered = ends_bytes + 2 * block_bytes + block_grads

    resident = weights + gradients + optimizer
    offloaded = resident if cpu_offload else 0
    act_host = activation_offload_host_bytes(shape, rung=rung, request=request, cluster=cluster)
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
        gathered=int(gathered),
        context=CUDA_CONTEXT_BYTES if cluster.device == "cuda" else CPU_PROCESS_BYTES,
        fragmentation=CUDA_FRAGMENTATION_BYTES if cluster.device == "cuda" else 0,
        pageable=int(0 if cpu_offload else pageable_optimizer_bytes(shape, method, request, cluster) / shards),
        gradients_in_backward=int(gradients if request.grad_accum_steps > 1 and not cpu_offload and not in_backward else 0)
        + (head_grads if shards > 1 or cpu_offload or request.grad_accum_steps == 1 else 0),
        step_temporary=int(0 if cpu_offload else step_temp),
        step_in_backward=in_backward,
    )
    loading = _loading_bytes(shape, method, request, cluster, base_bytes=base_bytes,
                             sharded=shards > 1 or cpu_offload)
    host = _host_bytes(device, offloaded=int(offloaded) + act_host, loading=loading, cluster=cluster)
    compute_s = _compute_s(shape, method, request, cluster)
    comm = _communication(shape, base_bytes, trainable, rung=rung, request=request, cluster=cluster,
                          root_bytes=shape.root_params * end_bytes, grad_bytes=state_bytes)
    return Estimate(
        method=method, strategy=strategy, cpu_offload=cpu_offload, memory=device, host_bytes=host,
        trainable_params=trainable, comm_bytes=comm.sent_bytes, comm_s=comm.seconds,
        comm_hidden_s=comm.hidden_s(compute_s), compute_s=compute_s,
        offload_s=(_offload_s(base_bytes / shards, trainable / shards, w_bytes, request) if cpu_offload else 0.0)
        # each micro-batch's block inputs go to the host in forward and come back in backward
        + 2 * act_host * request.grad_accum_steps / OFFLOAD_BYTES_PER_S,
        prepass_s_per_pair=_prepass_s_per_pair(shape, method, request, cluster), spilled_bytes=0,
    )


def _step_temporary_bytes(shape: ModelShape, method: Method, request: PlanRequest, cluster: Cluster, *,
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


def _loading_bytes(shape: ModelShape, method: Method, request: PlanRequest, cluster: Cluster, *, base_bytes: int,
                   sharded: bool) -> int:
    """Host RAM of a sharded load on node 0: LoRA/full take rank 0's whole copy; QLoRA fills its
    shards tensor by tensor, on every local rank. Single-device loads stream from the page cache."""
    if not sharded:
        return 0
    if method == "qlora":
        return cluster.gpus_per_node * sharded_qlora_loading_bytes(shape, request, cluster)
    return base_bytes


def _reduce_bytes(request: PlanRequest) -> int:
    return 4 if request.reduce_dtype == "float32" else 2


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


@dataclass(frozen=True)
class Communication:
    """One option's collectives per optimizer step, split by what compute can hide."""

    sent_bytes: int
    """Bytes each rank sends."""
    gathers_s: float
    """Weight all-gathers that run while earlier units compute (FSDP2 prefetch on CUDA)."""
    grads_s: float
    """Gradient reductions that run while later units compute backward (FSDP2, DDP buckets)."""
    backward_window: float
    """Fraction of the step's compute that gradient reductions can hide behind: the synced
    micro-batch's backward."""
    exposed_s: float
    """Seconds nothing overlaps: the first all-gather, the last reduction, the loop's small
    all-reduces, and on CPU/gloo every FSDP2 collective."""

    @property
    def seconds(self) -> float:
        return self.gathers_s + self.grads_s + self.exposed_s

    def hidden_s(self, compute_s: float) -> float:
        """Collectives share one link, so together they hide behind at most the whole compute."""
        return min(compute_s, self.gathers_s + min(self.grads_s, self.backward_window * compute_s))


def _collective_s(nbytes: float, *, ranks: int, bytes_per_s: float, hop_s: float, all_reduce: bool = False) -> float:
    """A ring all-gather or reduce-scatter of `nbytes` (the full buffer) over `ranks`: N-1 steps,
    each sending 1/N of it; an all-reduce is both, twice the steps and bytes. `bytes_per_s` is
    the all-reduce bus bandwidth (what doctor measures)."""
    if ranks <= 1:
        return 0.0
    steps = (ranks - 1) * (2 if all_reduce else 1)
    return steps * hop_s + steps * nbytes / ranks / bytes_per_s


def _gather_s(nbytes: float, *, gloo: bool, **link) -> float:
    """FSDP2's all-gather (see GLOO_ALL_GATHER_EFFICIENCY)."""
    if gloo:
        link = dict(link, bytes_per_s=link["bytes_per_s"] * GLOO_ALL_GATHER_EFFICIENCY)
    return _collective_s(nbytes, **link)


def _scatter_s(nbytes: float, *, gloo: bool, **link) -> float:
    """FSDP2's reduce-scatter: on gloo as long as an all-reduce of the input (GLOO_REDUCE_SCATTER_FACTOR)."""
    return _collective_s(nbytes, **link) * (GLOO_REDUCE_SCATTER_FACTOR if gloo else 1.0)


def _communication(shape: ModelShape, base_bytes: int, trainable: int, *, rung: Rung, request: PlanRequest,
                   cluster: Cluster, root_bytes: int, grad_bytes: int = 4) -> Communication:
    """Bytes each rank sends per optimizer step, the seconds that takes, and how much of it compute hides.

    Ring collectives: an all-gather or reduce-scatter of B bytes sends B x (N-1)/N per rank in
    N-1 steps, an all-reduce twice that; each step also costs the link's hop latency (half a
    measured tiny 2-rank all-reduce). A ring that spans nodes runs at its slowest hop, the Ethernet.

    What FSDP2 sends (distributed.parallelize: one unit per transformer block plus the root with
    embeddings, final norm and head, which stays gathered from forward to backward): every
    micro-batch all-gathers each unit in forward and, with reshard_after_forward (FULL_SHARD,
    HYBRID_SHARD), each block again in backward: ~3 x weight bytes x (N-1)/N per step with one
    reduce-scatter of equal dtype. Gradients are reduce-scattered per unit, on every micro-batch
    for a full fine-tune under FULL_SHARD/HYBRID_SHARD (the trainer does not defer it: a deferred
    sync keeps a whole unsharded gradient per rank) and once per step otherwise. HYBRID_SHARD does
    that inside a node and all-reduces each rank's gradient shard with its replicas on the other
    nodes: only that crosses Ethernet, but all `gpus_per_node` replica groups cross the one NIC at
    once. DDP (no_shard) all-reduces the trainable gradients once per step in DDP's buckets.

    Overlap, as FSDP2 and DDP actually schedule it:
    - FSDP2 on CUDA issues each unit's all-gather on its own stream while the previous unit
      computes (implicit forward prefetch, explicit backward prefetch) and reduce-scatters a
      unit's gradients while the next one runs backward. Compute hides everything up to its own
      length except the root unit's forward all-gather (nothing runs before it) and the last
      unit's reduction (nothing runs after it); gradient reductions hide only behind backward:
      step = max(compute, overlappable) + exposed. Not yet measured on GPUs (no multi-GPU
      machine here): it follows FSDP2's stream design (_fsdp_param_group.py).
    - FSDP2 on CPU/gloo hides nothing: without streams it calls every collective synchronously
      (torch/distributed/fsdp/_fully_shard/_fsdp_collectives.py, _fsdp_param_group.py), so the
      process waits for each one: step = compute + communication (measured, bench/network.py).
    - DDP all-reduces each bucket from a gradient hook on gloo's or NCCL's own thread/stream while
      backward goes on, on CPU and CUDA alike; only the bucket that fills last (the first layers')
      waits at the end of backward. The window is the last micro-batch's backward
      (_backward_fraction): 2/3 of a full fine-tune's compute, 1/2 of LoRA's, more with
      activation checkpointing's recomputation.
    - The loop's small all-reduces (LOOP_ALL_REDUCES, + the gradient norm under FSDP2) sit
      between steps, exposed everywhere.
    """
    n, g, nodes = cluster.world_size, cluster.gpus_per_node, cluster.nodes
    if n == 1:
        return Communication(sent_bytes=0, gathers_s=0.0, grads_s=0.0, backward_window=0.0, exposed_s=0.0)
    accum = request.grad_accum_steps
    intra = dict(bytes_per_s=cluster.intra_bytes_per_s, hop_s=cluster.intra_hop_s)
    # a ring over every rank waits on its slowest hop: Ethernet as soon as it spans nodes
    ring = dict(bytes_per_s=cluster.inter_bytes_per_s, hop_s=cluster.inter_hop_s) if nodes > 1 else intra
    loop = (LOOP_ALL_REDUCES + rung.fsdp_enabled) * _collective_s(8, ranks=n, all_reduce=True, **ring)
    backward = _backward_fraction(rung.method, request)

    if not rung.fsdp_enabled:
        # DDP reduces in the gradients' dtype, or on GPUs in bf16 with reduce_dtype=bfloat16
        # (distributed._replicate: torch's bf16 hook needs NCCL)
        dtype_bytes = min(_reduce_bytes(request), grad_bytes) if cluster.device == "cuda" else grad_bytes
        return _ddp_communication(trainable * dtype_bytes, ranks=n, ring=ring, window=backward / accum, loop_s=loop)

    grads = trainable * _reduce_bytes(request)
    units = shape.num_layers
    block_bytes = (base_bytes - root_bytes) / max(1, units)
    gathers = 2 if rung.reshard_after_forward else 1
    deferred = not rung.reshard_after_forward or trainable < DEFER_SYNC_TRAINABLE_FRACTION * shape.total_params
    syncs = 1 if deferred else accum
    shards = rung.shard_size
    link = intra if rung.hybrid_enabled else ring
    # the node's g replica groups of HYBRID_SHARD share its one NIC
    nic = dict(bytes_per_s=cluster.inter_bytes_per_s / g, hop_s=cluster.inter_hop_s)

    gloo = cluster.device == "cpu"

    def reduce_s(nbytes: float) -> float:
        """One unit's gradients: reduce-scattered over its shard group, and with HYBRID_SHARD the
        shard all-reduced with the replicas on the other nodes."""
        if not nbytes:
            return 0.0
        across = _collective_s(nbytes / shards, ranks=nodes, all_reduce=True, **nic) if rung.hybrid_enabled else 0.0
        return _scatter_s(nbytes, ranks=shards, gloo=gloo, **link) + across

    root_gather = _gather_s(root_bytes, ranks=shards, gloo=gloo, **link)
    gathers_s = accum * (root_gather + gathers * units * _gather_s(block_bytes, ranks=shards, gloo=gloo, **link))
    grad_root = grads * root_bytes / base_bytes if rung.method == "full" else 0.0
    grad_block = (grads - grad_root) / max(1, units)
    grads_s = syncs * (reduce_s(grad_root) + units * reduce_s(grad_block))
    sent = (gathers * accum * base_bytes + syncs * grads) * (shards - 1) / shards
    if rung.hybrid_enabled:
        sent += syncs * 2 * grads / shards * (nodes - 1) / nodes
    if gloo:
        return Communication(sent_bytes=int(sent), gathers_s=0.0, grads_s=0.0, backward_window=0.0,
                             exposed_s=gathers_s + grads_s + loop)
    # Nothing computes before the root's first all-gather, nor after the last unit's reduction (the
    # root's when it trains, else the first block's).
    first, last = accum * root_gather, reduce_s(grad_root or grad_block)
    return Communication(sent_bytes=int(sent), gathers_s=gathers_s - first, grads_s=grads_s - last,
                         backward_window=backward / syncs, exposed_s=first + last + loop)


def _ddp_communication(grads: float, *, ranks: int, ring: dict, window: float, loop_s: float) -> Communication:
    """DDP all-reduces the trainable gradients in buckets, each as soon as it is ready: all but the
    last overlap the rest of backward (`window`: backward's share of the step's compute)."""
    buckets = _ddp_buckets(grads)
    total = sum(_collective_s(b, ranks=ranks, all_reduce=True, **ring) for b in buckets)
    last = _collective_s(buckets[-1], ranks=ranks, all_reduce=True, **ring)
    return Communication(sent_bytes=int(2 * grads * (ranks - 1) / ranks), gathers_s=0.0, grads_s=total - last,
                         backward_window=window, exposed_s=last + loop_s)


def _backward_fraction(method: Method, request: PlanRequest) -> float:
    """Backward's share of a step's FLOPs (see _compute_s): 4 of 6 per parameter and token for a
    full fine-tune, 2 of 4 for adapters, plus the forward that activation checkpointing recomputes
    in backward; a DPO adapter step's reference forward is forward work."""
    forward = 2 + (2 if request.objective == "dpo" and method != "full" else 0)
    backward = (4 if method == "full" else 2) + (2 if request.activation_checkpointing else 0)
    return backward / (forward + backward)


def _ddp_buckets(grad_bytes: float) -> list[float]:
    """DDP's buckets in the order they fill in backward: a small first one, then full-size ones."""
    if grad_bytes <= DDP_FIRST_BUCKET_BYTES:
        return [grad_bytes]
    rest = grad_bytes - DDP_FIRST_BUCKET_BYTES
    full, tail = divmod(rest, DDP_BUCKET_BYTES)
    return [DDP_FIRST_BUCKET_BYTES] + [DDP_BUCKET_BYTES] * int(full) + ([tail] if tail else [])


def _compute_s(shape: ModelShape, method: Method, request: PlanRequest, cluster: Cluster) -> float:
    """6 x params x tokens FLOPs for full fine-tuning (forward 2, backward 4; Kaplan et al. 2020);
    4 for LoRA (frozen weights need no weight gradients), +2 when activation checkpointing
    recomputes the forward, and 2 x vocab x hidden more when the chunked loss recomputes the LM
    head. Params are the matmul ones a token passes through (blocks' active parameters and the LM
    head; the embedding is a lookup). Attention's seq^2 term is left out: below 8k tokens it adds
    < 10% for these models."""
    tokens = request.seq_len * request.rows_per_micro_batch * request.grad_accum_steps
    factor = (6 if method == "full" else 4) + (2 if request.activation_checkpointing else 0)
    if request.objective == "dpo" and method != "full":
        factor += 2  # the reference: one more forward with the adapters disabled
    flops = factor * _matmul_params(shape) * tokens
    if chunked_loss(request):
        flops += 2 * shape.vocab_size * shape.hidden_size * tokens  # the chunked loss recomputes the head
    seconds = flops / (cluster.tflops * 1e12)
    return seconds * (QLORA_SLOWDOWN if method == "qlora" else 1.0)


def _matmul_params(shape: ModelShape) -> int:
    return shape.active_params - shape.embedding_params + shape.vocab_size * shape.hidden_size * shape.tie_word_embeddings


def _prepass_s_per_pair(shape: ModelShape, method: Method, request: PlanRequest, cluster: Cluster) -> float:
    """A forward (2 FLOPs per param and token) of both answers at full length, shared by all ranks."""
    if request.objective != "dpo" or method != "full":
        return 0.0
    return 2 * _matmul_params(shape) * 2 * request.seq_len / (cluster.tflops * 1e12 * cluster.world_size)


def _offload_s(weight_shard_bytes: float, trainable_shard: float, w_bytes: int, request: PlanRequest) -> float:
    """CPU offload: the weight shard crosses PCIe for the forward and the backward all-gather of
    every micro-batch, gradients come back once, and AdamW runs on the CPU."""
    copies = 2 * request.grad_accum_steps * weight_shard_bytes + trainable_shard * w_bytes
    return copies / OFFLOAD_BYTES_PER_S + trainable_shard / CPU_ADAM_PARAMS_PER_S
