"""The step-time model behind the planner: seconds of compute, of collectives over the links, of
offload copies, and how much of the collectives compute hides. Pure arithmetic, no torch, no I/O.

memory.estimate calls it for each option; tests/unit/plan/price/test_network.py checks the collective
counts and the overlap, and bench/network.py checks the whole against runs over shaped links.
"""

from __future__ import annotations

from dataclasses import dataclass

from homelab_ft.plan.inputs import Cluster, PlanRequest
from homelab_ft.plan.shape.shapes import ModelShape
from homelab_ft.rules.loss_chunks import recomputes
from homelab_ft.rung import Rung

# gloo (every CPU run) is slower at FSDP2's collectives than the ring model: its reduce_scatter_tensor
# takes as long as an all-reduce of the whole input (2 MiB per rank: 374 ms vs 358 ms for the 4 MiB
# all-reduce at 100 Mbit, 1.91 s vs 1.98 s at 20, 36 ms vs 35 ms at 1000), and its
# all_gather_into_tensor reaches ~0.7 of the all-reduce's bus bandwidth (0.62-0.75 at 0.5-2 MiB and
# 20-1000 Mbit); measured between two namespace nodes with torch 2.13 (bench/network.py's links).
# NCCL's ring collectives reach the link's bus bandwidth for all three.
GLOO_REDUCE_SCATTER_FACTOR = 2.0
GLOO_ALL_GATHER_EFFICIENCY = 0.7
# FSDP2 on the CPU also pays for the host copies around each collective, which on a GPU run at HBM
# speed: the all-gather's copy-in and copy-out into freshly allocated (page-faulted) unsharded
# buffers, the reduce-scatter's chunk_cat of the gradients, their accumulation into the sharded
# ones. torch.profiler on SmolLM2-135M fp32, 2 ranks of one thread: FULL_SHARD's aten::copy_, cat,
# fill_ and add took ~1.9 s a step more than SHARD_GRAD_OP's, beside 2 more all-gathers and one
# more reduce-scatter; over tiny-full-2proc-cpu and its shard_grad_op twin, ~0.75 s per GB of
# unsharded bytes gathered or reduced beside the link time (bench/cpu_plan_vs_measured.py).
# One thread per process, as the CPU recipes run; more threads copy faster, which this ignores.
GLOO_FSDP_HOST_S_PER_BYTE = 0.75e-9
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


def collective_s(nbytes: float, *, ranks: int, bytes_per_s: float, hop_s: float, all_reduce: bool = False) -> float:
    """A ring all-gather or reduce-scatter of `nbytes` (the full buffer) over `ranks`: N-1 steps,
    each sending 1/N of it; an all-reduce is both, twice the steps and bytes. `bytes_per_s` is
    the all-reduce bus bandwidth (what doctor measures)."""
    if ranks <= 1:
        return 0.0
    steps = (ranks - 1) * (2 if all_reduce else 1)
    return steps * hop_s + steps * nbytes / ranks / bytes_per_s


def p2p_s(nbytes: float, *, bytes_per_s: float, hop_s: float) -> float:
    """One point-to-point send of `nbytes` (a pipeline stage's hidden states or their gradient):
    one hop's latency and the bytes at the link's bandwidth; a send and the opposite direction's
    share nothing on full-duplex Ethernet or PCIe."""
    return hop_s + nbytes / bytes_per_s


def _gather_s(nbytes: float, *, gloo: bool, **link) -> float:
    """FSDP2's all-gather (see GLOO_ALL_GATHER_EFFICIENCY)."""
    if gloo:
        link = dict(link, bytes_per_s=link["bytes_per_s"] * GLOO_ALL_GATHER_EFFICIENCY)
    return collective_s(nbytes, **link)


def _scatter_s(nbytes: float, *, gloo: bool, **link) -> float:
    """FSDP2's reduce-scatter: on gloo as long as an all-reduce of the input (GLOO_REDUCE_SCATTER_FACTOR)."""
    return collective_s(nbytes, **link) * (GLOO_REDUCE_SCATTER_FACTOR if gloo else 1.0)


def communication(shape: ModelShape, base_bytes: int, trainable: int, *, rung: Rung, request: PlanRequest,
                  cluster: Cluster, root_bytes: int, sync_deferred: bool, grad_bytes: int = 4) -> Communication:
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
    sync keeps a whole unsharded gradient per rank) and once per step otherwise (`sync_deferred`,
    memory.sync_deferred). HYBRID_SHARD does
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
      (backward_fraction): 2/3 of a full fine-tune's compute, 1/2 of LoRA's, more with
      activation checkpointing's recomputation.
    - The loop's small all-reduces (LOOP_ALL_REDUCES, + the gradient norm under FSDP2) sit
      between steps, exposed everywhere.
    """
    n, nodes = cluster.world_size, cluster.nodes
    if n == 1:
        return Communication(sent_bytes=0, gathers_s=0.0, grads_s=0.0, backward_window=0.0, exposed_s=0.0)
    intra = dict(bytes_per_s=cluster.intra_bytes_per_s, hop_s=cluster.intra_hop_s)
    # a ring over every rank waits on its slowest hop: Ethernet as soon as it spans nodes
    ring = dict(bytes_per_s=cluster.inter_bytes_per_s, hop_s=cluster.inter_hop_s) if nodes > 1 else intra
    loop = (LOOP_ALL_REDUCES + rung.fsdp_enabled) * collective_s(8, ranks=n, all_reduce=True, **ring)
    backward = backward_fraction(rung=rung, request=request)
    if not rung.fsdp_enabled:
        # DDP reduces in the gradients' dtype, or on GPUs in bf16 with reduce_dtype=bfloat16
        # (distributed._replicate: torch's bf16 hook needs NCCL)
        dtype_bytes = min(request.reduce_bytes, grad_bytes) if cluster.device == "cuda" else grad_bytes
        return ddp_communication(trainable * dtype_bytes, ranks=n, ring=ring, window=backward / request.train.grad_accum_steps,
                                  loop_s=loop)
    link = intra if rung.hybrid_enabled else ring
    return _fsdp_communication(shape, base_bytes, trainable * request.reduce_bytes, rung=rung, request=request,
                               cluster=cluster, root_bytes=root_bytes, syncs=1 if sync_deferred else request.train.grad_accum_steps,
                               link=link, loop_s=loop, backward=backward)


def _fsdp_communication(shape: ModelShape, base_bytes: int, grads: int, *, rung: Rung, request: PlanRequest,
                        cluster: Cluster, root_bytes: int, syncs: int, link: dict, loop_s: float,
                        backward: float) -> Communication:
    """FSDP2's all-gathers and reduce-scatters over `link` (see `communication`): `grads` bytes of
    gradients reduced `syncs` times per step, one unit per block plus the root."""
    g, nodes, accum = cluster.gpus_per_node, cluster.nodes, request.train.grad_accum_steps
    units = shape.num_layers
    block_bytes = (base_bytes - root_bytes) / max(1, units)
    gathers = 2 if rung.reshard_after_forward else 1
    shards = rung.shard_size
    # the node's g replica groups of HYBRID_SHARD share its one NIC
    nic = dict(bytes_per_s=cluster.inter_bytes_per_s / g, hop_s=cluster.inter_hop_s)
    gloo = cluster.device == "cpu"

    def reduce_s(nbytes: float) -> float:
        """One unit's gradients: reduce-scattered over its shard group, and with HYBRID_SHARD the
        shard all-reduced with the replicas on the other nodes."""
        if not nbytes:
            return 0.0
        across = collective_s(nbytes / shards, ranks=nodes, all_reduce=True, **nic) if rung.hybrid_enabled else 0.0
        return _scatter_s(nbytes, ranks=shards, gloo=gloo, **link) + across

    root_gather = _gather_s(root_bytes, ranks=shards, gloo=gloo, **link)
    gathers_s = accum * (root_gather + gathers * units * _gather_s(block_bytes, ranks=shards, gloo=gloo, **link))
    grad_root = 0.0 if rung.adapters_enabled else grads * root_bytes / base_bytes
    grad_block = (grads - grad_root) / max(1, units)
    grads_s = syncs * (reduce_s(grad_root) + units * reduce_s(grad_block))
    sent = (gathers * accum * base_bytes + syncs * grads) * (shards - 1) / shards
    if rung.hybrid_enabled:
        sent += syncs * 2 * grads / shards * (nodes - 1) / nodes
    if gloo:
        handled = accum * (root_bytes + gathers * units * block_bytes) + syncs * grads
        return Communication(sent_bytes=int(sent), gathers_s=0.0, grads_s=0.0, backward_window=0.0,
                             exposed_s=gathers_s + grads_s + loop_s + handled * GLOO_FSDP_HOST_S_PER_BYTE)
    # Nothing computes before the root's first all-gather, nor after the last unit's reduction (the
    # root's when it trains, else the first block's).
    first, last = accum * root_gather, reduce_s(grad_root or grad_block)
    return Communication(sent_bytes=int(sent), gathers_s=gathers_s - first, grads_s=grads_s - last,
                         backward_window=backward / syncs, exposed_s=first + last + loop_s)


def ddp_communication(grads: float, *, ranks: int, ring: dict, window: float, loop_s: float) -> Communication:
    """DDP all-reduces the trainable gradients in buckets, each as soon as it is ready: all but the
    last overlap the rest of backward (`window`: backward's share of the step's compute)."""
    first, full, tail = _ddp_buckets(grads)
    def reduce(nbytes: float) -> float:
        return collective_s(nbytes, ranks=ranks, all_reduce=True, **ring)
    # the full-size buckets cost the same each: counted once, not summed one by one (a 70B full
    # fine-tune has ~5,600 of them, and the ladder prices tens of thousands of options in a sweep)
    total = reduce(first) + full * reduce(DDP_BUCKET_BYTES) + (reduce(tail) if tail else 0.0)
    last = reduce(tail) if tail else reduce(DDP_BUCKET_BYTES) if full else reduce(first)
    return Communication(sent_bytes=int(2 * grads * (ranks - 1) / ranks), gathers_s=0.0, grads_s=total - last,
                         backward_window=window, exposed_s=last + loop_s)


def backward_fraction(*, rung: Rung, request: PlanRequest) -> float:
    """Backward's share of a step's FLOPs (see compute_s): 4 of 6 per parameter and token for a
    full fine-tune, 2 of 4 for adapters, plus the forward that activation checkpointing recomputes
    in backward; a DPO adapter step's reference forward is forward work, as KTO's KL forward is."""
    adapters = rung.adapters_enabled
    forward = 2 + 2 * (request.reference_forwards if adapters else 0) + 2 * request.kl_forwards
    backward = (2 if adapters else 4) + (2 if rung.activation_checkpointing else 0)
    return backward / (forward + backward)


def _ddp_buckets(grad_bytes: float) -> tuple[float, int, float]:
    """DDP's buckets in the order they fill in backward: a small first one, then `full` full-size
    ones, then the remainder (0 when none): (first, full, tail)."""
    if grad_bytes <= DDP_FIRST_BUCKET_BYTES:
        return grad_bytes, 0, 0.0
    full, tail = divmod(grad_bytes - DDP_FIRST_BUCKET_BYTES, DDP_BUCKET_BYTES)
    return DDP_FIRST_BUCKET_BYTES, int(full), tail


def compute_s(shape: ModelShape, *, rung: Rung, request: PlanRequest, cluster: Cluster) -> float:
    """6 x params x tokens FLOPs for full fine-tuning (forward 2, backward 4; Kaplan et al. 2020);
    4 for LoRA (frozen weights need no weight gradients), +2 when activation checkpointing
    recomputes the forward, and 2 x vocab x hidden more when the chunked loss recomputes the LM
    head (more than one chunk: loss_chunks.recomputes, every token counted as trained). Params are the matmul ones a token passes through (blocks' active parameters and the LM
    head; the embedding is a lookup). Tokens are the padded ones a micro-batch computes on average
    (PlanRequest.timed_micro_batch_tokens: the rows' measured lengths when the CLI has them, else
    data.max_length). Attention's seq^2 term is left out: below 8k tokens it adds
    < 10% for these models."""
    tokens = request.timed_micro_batch_tokens * request.train.grad_accum_steps
    factor = (4 if rung.adapters_enabled else 6) + (2 if rung.activation_checkpointing else 0)
    if rung.adapters_enabled:
        factor += 2 * request.reference_forwards  # the reference: forwards with the adapters disabled
    factor += 2 * request.kl_forwards  # KTO: the policy's no-grad forward of the mismatched completions
    flops = factor * matmul_params(shape) * tokens
    micro_tokens = request.micro_batch_tokens
    if request.chunked_loss and recomputes(request.train.loss_chunk_tokens, vocab_size=shape.vocab_size, tokens=micro_tokens):
        flops += 2 * shape.vocab_size * shape.hidden_size * tokens  # the chunked loss recomputes the head
    seconds = flops / (cluster.tflops * 1e12)
    return seconds * (QLORA_SLOWDOWN if rung.quantized_enabled else 1.0)


def matmul_params(shape: ModelShape) -> int:
    return shape.active_params - shape.embedding_params + shape.vocab_size * shape.hidden_size * shape.tie_word_embeddings


def prepass_s_per_pair(shape: ModelShape, rung: Rung, request: PlanRequest, cluster: Cluster) -> float:
    """A forward (2 FLOPs per param and token) of both answers at full length, shared by all ranks."""
    if not request.reference_forward or rung.adapters_enabled:
        return 0.0
    return 2 * matmul_params(shape) * 2 * request.timed_prompt_tokens / (cluster.tflops * 1e12 * cluster.world_size)


def offload_s(weight_shard_bytes: float, trainable_shard: float, w_bytes: int, request: PlanRequest) -> float:
    """CPU offload: the weight shard crosses PCIe for the forward and the backward all-gather of
    every micro-batch, gradients come back once, and AdamW runs on the CPU."""
    copies = 2 * request.train.grad_accum_steps * weight_shard_bytes + trainable_shard * w_bytes
    return copies / OFFLOAD_BYTES_PER_S + trainable_shard / CPU_ADAM_PARAMS_PER_S
