"""What a pipeline costs: per-stage memory, the point-to-point traffic at each stage boundary, the
schedule's bubble, and the split of the decoder blocks over GPUs of different sizes. Pure arithmetic,
no torch, no I/O.

A pipelined rung (rung.pipeline_stages > 1, torch.distributed.pipelining) cuts the decoder blocks into
contiguous stages, one per rank of each pipeline; the first stage also holds the embeddings, the last
the final norm, the LM head and the loss. Ranks are laid out pipeline-major (stage s is ranks
s*D .. s*D+D-1 for D = rung.data_parallel_size replicas), so with one stage per node each boundary is
one Ethernet hop and the replicas of a stage share their node's PCIe. Only activations cross a
boundary: per micro-batch, the hidden states [micro_batch, seq, hidden] forward and their gradient
back, where FSDP moves ~3x the weights per step (network.communication). The ladder prices these
options beside FSDP/HSDP/DDP (ladder.evaluate), with network.py's compute and link model.
"""

from __future__ import annotations

import dataclasses

from homelab_ft.plan.inputs import Cluster, PlanRequest
from homelab_ft.plan.price.activations import (
    activation_bytes,
    activation_dtype_bytes,
    logits_bytes,
    recomputed_block_bytes,
)
from homelab_ft.plan.price.host_ram import CUDA_HOST_PROCESS_BYTES
from homelab_ft.plan.price.memory import (
    CPU_PROCESS_BYTES,
    CUDA_CONTEXT_BYTES,
    CUDA_FRAGMENTATION_BYTES,
    Estimate,
    Memory,
    Stage,
    step_temporary_bytes,
)
from homelab_ft.plan.price.network import (
    LOOP_ALL_REDUCES,
    backward_fraction,
    collective_s,
    compute_s,
    ddp_communication,
    matmul_params,
    p2p_s,
)
from homelab_ft.plan.price.params import (
    adapter_bytes,
    adapter_params,
    base_weight_bytes,
    optimizer_bytes_per_param,
    pageable_optimizer_bytes,
    sharded_qlora_loading_bytes,
    weight_bytes,
)
from homelab_ft.plan.shape.shapes import ModelShape
from homelab_ft.rung import Rung


def bubble_fraction(*, stages: int, micro_batches: int) -> float:
    """The share of a pipelined step each stage idles while the pipeline fills and drains: GPipe and
    1F1B alike run micro_batches + stages - 1 slots of which stages - 1 are empty (GPipe paper,
    Huang et al. 2019; Narayanan et al. 2021 for 1F1B)."""
    return (stages - 1) / (micro_batches + stages - 1)


def in_flight(schedule: str, *, stages: int, stage_index: int, micro_batches: int) -> int:
    """Micro-batches whose activations stage `stage_index` holds at its peak: 1F1B starts the
    backward of the first micro-batch once it has run stages - stage_index forwards (warm-up), GPipe
    runs every forward first."""
    if schedule == "gpipe":
        return micro_batches
    return min(stages - stage_index, micro_batches)


def p2p_bytes(shape: ModelShape, *, rung: Rung, request: PlanRequest, cluster: Cluster) -> int:
    """Bytes one stage boundary carries per micro-batch and direction: the hidden states
    [rows, seq, hidden] in the activation dtype forward, and their gradient (same shape) back."""
    act = activation_dtype_bytes(rung, request, cluster)
    return request.micro_batch_tokens * shape.hidden_size * act


def stage_nodes(rung: Rung, cluster: Cluster) -> tuple[int, ...]:
    """The node of each stage's first rank (pipeline-major layout, see the module docstring)."""
    replicas = rung.data_parallel_size
    return tuple(s * replicas // cluster.gpus_per_node for s in range(rung.pipeline_stages))


def label(rung: Rung) -> str:
    """The option's name in the plan, e.g. `qlora pipeline 2 stages +ckpt` (x2 DDP: 2 replicas)."""
    savers = " +act-off" if rung.activation_offload else " +ckpt" if rung.activation_checkpointing else ""
    replicas = f" x{rung.data_parallel_size} ddp" if rung.data_parallel_size > 1 else ""
    return f"{rung.method} pipeline {rung.pipeline_stages} stages{replicas}{savers}"


def split_text(stages: tuple[Stage, ...]) -> str:
    """`stage 0: blocks 0-47 on node 0 (24.0 GiB), stage 1: ...`, as the plan prints the split."""
    gib = 1024**3
    return ", ".join(f"stage {s.index}: blocks {s.first_block}-{s.first_block + s.num_blocks - 1} on node {s.node} "
                     f"({s.device_bytes / gib:.1f} GiB)" for s in stages)


# --------------------------------------------------------------------------------------------
# per-stage memory


@dataclasses.dataclass(frozen=True)
class _PerBlock:
    """What one decoder block (the model's average block) and the ends cost, for one rung."""

    act_bytes: int
    base_bytes: float
    """One block's base weights."""
    trainable: float
    """One block's trainable parameters (a full fine-tune: all of them; adapters: its LoRA pairs)."""
    state_bytes: int
    """Per trainable parameter: its gradient's and each AdamW moment's bytes."""
    kept_bytes: float
    """Activations one micro-batch keeps per block (activation_bytes without the recomputed block)."""
    recomputed: int
    """One block recomputed by activation checkpointing in backward (0 without it)."""
    pageable_per_trainable: float


def _per_block(shape: ModelShape, *, rung: Rung, request: PlanRequest, cluster: Cluster) -> _PerBlock:
    layers = shape.num_layers
    act = activation_dtype_bytes(rung, request, cluster)
    base_total, _ = base_weight_bytes(shape, rung, request, cluster)
    if not rung.adapters_enabled:
        trainable, state = shape.total_params, weight_bytes(request, cluster)
        block_trainable = shape.block_params / layers
    else:
        trainable, state = adapter_params(shape, request), adapter_bytes(rung, request, cluster)
        block_trainable = trainable / layers
    recomputed = recomputed_block_bytes(shape, rung=rung, request=request, act_bytes=act)
    kept = activation_bytes(shape, rung=rung, request=request, act_bytes=act) - recomputed
    pageable = pageable_optimizer_bytes(shape, rung, request, cluster) / max(1, trainable)
    return _PerBlock(act_bytes=act, base_bytes=(base_total - shape.root_params * act) / layers,
                     trainable=block_trainable, state_bytes=state,
                     kept_bytes=kept / layers, recomputed=recomputed, pageable_per_trainable=pageable)


def _end_params(shape: ModelShape, *, first: bool, last: bool) -> int:
    """Parameters outside the blocks a stage holds: the embedding on the first, the final norm and
    the LM head on the last. A tied head is the embedding: both ends hold it (their gradients summed)."""
    head = shape.final_norm_params + shape.vocab_size * shape.hidden_size
    return (shape.embedding_params if first else 0) + (head if last else 0)


def stage_memory(shape: ModelShape, *, rung: Rung, request: PlanRequest, cluster: Cluster, stage_index: int,
                 num_blocks: int) -> Memory:
    """Peak bytes on the GPU of one stage holding `num_blocks` blocks: their weights, gradients and
    optimizer state (the ends' too where it holds them), the activations of the micro-batches in
    flight under the schedule, the loss's logits on the last stage; the items as memory.Memory
    combines them (the peak is the larger of forward/backward and the optimizer step)."""
    per = _per_block(shape, rung=rung, request=request, cluster=cluster)
    stages, first, last = rung.pipeline_stages, stage_index == 0, stage_index == rung.pipeline_stages - 1
    ends = _end_params(shape, first=first, last=last)
    full = not rung.adapters_enabled
    trainable = _stage_trainable(shape, per, rung=rung, stage_index=stage_index, num_blocks=num_blocks)
    grads = trainable * per.state_bytes
    micro = request.train.grad_accum_steps
    flying = in_flight(rung.pipeline_schedule, stages=stages, stage_index=stage_index, micro_batches=micro)
    head_grads = shape.vocab_size * shape.hidden_size * per.state_bytes if full and last else 0
    step_temp = step_temporary_bytes(shape, rung, request, cluster, trainable=int(trainable),
                                     state_bytes=per.state_bytes, in_backward=False) if trainable else 0
    cuda = cluster.device == "cuda"
    return Memory(
        weights=int(num_blocks * per.base_bytes + ends * per.act_bytes + (0 if full else grads)),
        gradients=int(grads),
        optimizer=int(trainable * optimizer_bytes_per_param(request, per.state_bytes)),
        activations=int(flying * num_blocks * per.kept_bytes + per.recomputed),
        recomputed=per.recomputed,
        logits=logits_bytes(shape, request, per.act_bytes) if last else 0,
        gathered=0,
        context=CUDA_CONTEXT_BYTES if cuda else CPU_PROCESS_BYTES,
        fragmentation=CUDA_FRAGMENTATION_BYTES if cuda else 0,
        pageable=int(trainable * per.pageable_per_trainable),
        gradients_in_backward=int(grads if micro > 1 else 0) + head_grads,
        step_temporary=int(step_temp),
    )


def sized(shape: ModelShape, *, rung: Rung, request: PlanRequest, cluster: Cluster) -> Rung:
    """`rung` with its blocks per stage: the recipe's (rung.stage_blocks), else `stage_split`'s for
    the savers the rung runs with."""
    if rung.stage_blocks:
        return rung
    return dataclasses.replace(rung, stage_blocks=stage_split(shape, rung=rung, request=request, cluster=cluster))


def stage_split(shape: ModelShape, *, rung: Rung, request: PlanRequest, cluster: Cluster) -> tuple[int, ...]:
    """Blocks per stage: as even in compute as what each GPU has left after its fixed costs allows,
    and in proportion to that when it cannot hold them all.

    A stage's fixed cost is its peak with no blocks (process context, the ends it holds, the loss's
    logits, one recomputed block); what is left of its budget (device memory minus the recipe's
    headroom) divided by what one more block adds there (weights, gradients, optimizer state, the
    activations of the micro-batches in flight: more on early stages under 1F1B) is the blocks it
    can take. The slowest stage paces the pipeline, and the last one also runs the LM head (a
    quarter of a 1B Llama's matmuls), so the split is the one whose slowest stage computes least
    with no stage over its capacity (`_balanced`). When the capacities add up to fewer blocks than
    the model has (nothing fits), the blocks are dealt out in proportion to them, so a 24 GiB card
    takes about twice the blocks of a 12 GiB one and the plan shows the nearest miss."""
    stages, layers = rung.pipeline_stages, shape.num_layers
    nodes = stage_nodes(rung, cluster)
    capacity = []
    for i in range(stages):
        budget = cluster.node_bytes(nodes[i]) * (1 - request.planner.headroom)
        fixed = stage_memory(shape, rung=rung, request=request, cluster=cluster, stage_index=i, num_blocks=0).total
        one = stage_memory(shape, rung=rung, request=request, cluster=cluster, stage_index=i, num_blocks=1).total
        capacity.append(max(0.0, budget - fixed) / max(1, one - fixed))
    whole_blocks = [int(c) for c in capacity]
    if sum(whole_blocks) >= layers and min(whole_blocks) >= 1:
        return _balanced(shape, whole_blocks)
    return _proportional(capacity, layers)


def _balanced(shape: ModelShape, capacity: list[int]) -> tuple[int, ...]:
    """The split whose slowest stage computes least, each stage holding at most `capacity` blocks
    and at least one: a block costs its matmul parameters, the last stage the LM head's besides.
    The smallest pace that fits every block is found by bisection over whole blocks."""
    stages, layers = len(capacity), shape.num_layers
    head = shape.vocab_size * shape.hidden_size / max(1, (matmul_params(shape) - shape.vocab_size * shape.hidden_size)
                                                      / layers)

    def counts(pace: int) -> list[int]:
        """Blocks per stage at a pace of `pace` block-equivalents of compute per stage."""
        return [max(1, min(capacity[i], pace - (round(head) if i == stages - 1 else 0))) for i in range(stages)]

    low, high = 1, layers + round(head)
    while low < high:
        mid = (low + high) // 2
        if sum(counts(mid)) >= layers:
            high = mid
        else:
            low = mid + 1
    split = counts(low)
    for i in reversed(range(stages)):  # trim the surplus from the last stages first (they run the head)
        surplus = sum(split) - layers
        split[i] -= min(surplus, split[i] - 1)
    return tuple(split)


def _proportional(capacity: list[float], layers: int) -> tuple[int, ...]:
    """`layers` blocks dealt out in proportion to `capacity` (largest remainders, at least one each)."""
    stages, total = len(capacity), sum(capacity)
    shares = [layers * c / total for c in capacity] if total > 0 else [layers / stages] * stages
    counts = [max(1, int(share)) for share in shares]
    by_remainder = sorted(range(stages), key=lambda i: shares[i] - int(shares[i]), reverse=True)
    i = 0
    while sum(counts) < layers:
        counts[by_remainder[i % stages]] += 1
        i += 1
    while sum(counts) > layers:
        counts[max(range(stages), key=lambda k: counts[k])] -= 1
    return tuple(counts)


# --------------------------------------------------------------------------------------------
# the estimate


def estimate(shape: ModelShape, *, rung: Rung, request: PlanRequest, cluster: Cluster) -> Estimate:
    """A pipelined rung's estimate: `memory` of the stage nearest its budget (the others in
    `stages`), the host RAM of a node, the p2p traffic and time, the bubble, and the replicas' DDP.

    Time: with t the slowest stage's compute per micro-batch and x one boundary transfer (network.p2p_s
    on the slowest boundary's link), a step of M micro-batches over S stages takes
        (M + S - 1) t                 every stage runs M slots, S - 1 of the step's slots are bubble
      + 2 (S - 1) x                   the first forward's and the last backward's transfers, which
                                      nothing overlaps (fill and drain)
      + M max(0, x - t)               when a transfer takes longer than a stage's work, the link paces
                                      the pipeline
    and the other transfers overlap compute (torch.distributed.pipelining posts them as isend/irecv).
    With D replicas each stage's gradients are all-reduced among its D copies as DDP does
    (network.ddp_communication), and the loop's small all-reduces span the world."""
    stages_n, micro = rung.pipeline_stages, request.train.grad_accum_steps
    counts = rung.stage_blocks or stage_split(shape, rung=rung, request=request, cluster=cluster)
    nodes = stage_nodes(rung, cluster)
    whole = compute_s(shape, rung=rung, request=request, cluster=cluster)
    matmul, head = matmul_params(shape), shape.vocab_size * shape.hidden_size
    stages, first = [], 0
    for i, count in enumerate(counts):
        memory = stage_memory(shape, rung=rung, request=request, cluster=cluster, stage_index=i, num_blocks=count)
        share = (count / shape.num_layers * (matmul - head) + (head if i == stages_n - 1 else 0)) / matmul
        device_bytes = cluster.node_bytes(nodes[i])
        stages.append(Stage(index=i, first_block=first, num_blocks=count, node=nodes[i], device_bytes=device_bytes,
                            budget_bytes=int(device_bytes * (1 - request.planner.headroom)), memory_total=memory.total,
                            in_flight=in_flight(rung.pipeline_schedule, stages=stages_n, stage_index=i,
                                                micro_batches=micro),
                            compute_s=whole * share))
        first += count
    binding = max(stages, key=lambda s: s.memory_total / max(1, s.budget_bytes))
    memory = stage_memory(shape, rung=rung, request=request, cluster=cluster, stage_index=binding.index,
                          num_blocks=binding.num_blocks)
    slowest = max(s.compute_s for s in stages)
    per_micro = slowest / micro
    boundary = p2p_bytes(shape, rung=rung, request=request, cluster=cluster)
    transfer = max((_transfer_s(boundary, rung=rung, cluster=cluster, inter=nodes[i] != nodes[i + 1])
                    for i in range(stages_n - 1)), default=0.0)
    p2p_total = 2 * micro * transfer
    exposed = min(p2p_total, 2 * (stages_n - 1) * transfer + micro * max(0.0, transfer - per_micro))
    sync = _replica_sync(shape, binding, rung=rung, request=request, cluster=cluster)
    comm_s = p2p_total + sync.seconds
    hidden = (p2p_total - exposed) + sync.hidden_s(slowest)
    sent = 2 * micro * boundary * (stages_n > 1) + sync.sent_bytes
    loading = cluster.gpus_per_node * sharded_qlora_loading_bytes(shape, request, cluster) if rung.quantized_enabled else 0
    host = cluster.gpus_per_node * CUDA_HOST_PROCESS_BYTES + loading if cluster.device == "cuda" else (
        cluster.gpus_per_node * memory.total)
    trainable = adapter_params(shape, request) if rung.adapters_enabled else shape.total_params
    return Estimate(
        method=rung.method, strategy=rung.strategy, cpu_offload=False, memory=memory, host_bytes=int(host),
        trainable_params=trainable, comm_bytes=int(sent), comm_s=comm_s, comm_hidden_s=hidden, compute_s=slowest,
        offload_s=0.0, prepass_s_per_pair=0.0, spilled_bytes=0,
        bubble_s=slowest * (stages_n - 1) / micro, stages=tuple(stages),
        rollout=None,  # rules/refusals.objective: GRPO does not run pipelined
    )


def _transfer_s(nbytes: int, *, rung: Rung, cluster: Cluster, inter: bool) -> float:
    """One boundary transfer: over Ethernet when the neighbouring stages sit on different nodes,
    where the D replicas of a stage cross the one NIC at once; else over the node's own link."""
    if inter:
        return p2p_s(nbytes, bytes_per_s=cluster.inter_bytes_per_s / rung.data_parallel_size, hop_s=cluster.inter_hop_s)
    return p2p_s(nbytes, bytes_per_s=cluster.intra_bytes_per_s, hop_s=cluster.intra_hop_s)


def _replica_sync(shape: ModelShape, stage: Stage, *, rung: Rung, request: PlanRequest, cluster: Cluster):
    """The D replicas of a stage all-reduce its gradients (DDP's buckets, overlapping the last
    micro-batch's backward; in the gradients' dtype, or bf16 on GPUs with reduce_dtype=bfloat16, as
    network.communication prices DDP), over the node's link when one node holds the D copies; and
    the loop's LOOP_ALL_REDUCES small all-reduces over every rank."""
    inter = dict(bytes_per_s=cluster.inter_bytes_per_s, hop_s=cluster.inter_hop_s)
    intra = dict(bytes_per_s=cluster.intra_bytes_per_s, hop_s=cluster.intra_hop_s)
    ring = inter if cluster.nodes > 1 else intra
    loop = LOOP_ALL_REDUCES * collective_s(8, ranks=cluster.world_size, all_reduce=True, **ring)
    replicas = rung.data_parallel_size
    per = _per_block(shape, rung=rung, request=request, cluster=cluster)
    dtype = min(request.reduce_bytes, per.state_bytes) if cluster.device == "cuda" else per.state_bytes
    grads = _stage_trainable(shape, per, rung=rung, stage_index=stage.index, num_blocks=stage.num_blocks) * dtype
    window = backward_fraction(rung=rung, request=request) / request.train.grad_accum_steps
    link = intra if replicas <= cluster.gpus_per_node else ring
    return ddp_communication(grads if replicas > 1 else 0, ranks=replicas, ring=link, window=window, loop_s=loop)


def _stage_trainable(shape: ModelShape, per: _PerBlock, *, rung: Rung, stage_index: int, num_blocks: int) -> float:
    """Trainable parameters a stage holds: its blocks' (and for a full fine-tune its ends')."""
    ends = _end_params(shape, first=stage_index == 0, last=stage_index == rung.pipeline_stages - 1)
    return num_blocks * per.trainable + (0 if rung.adapters_enabled else ends)
