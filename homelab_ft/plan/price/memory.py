"""The memory model behind the planner: pure arithmetic, no torch, no I/O.

For one option (method x sharding strategy x CPU offload) on one cluster, `estimate` returns the
bytes each device holds at peak, broken into the items that decide whether a run OOMs, and the
host RAM per node: it spreads what the parameters cost (params.py) over the rung's ranks, adds
one micro-batch's activations and logits (activations.py), and asks network.py for the bytes
each rank sends per optimizer step and the seconds of compute and communication per step.
Every formula says where it comes from; docs/ladder.md walks through a worked example and
bench/plan_vs_measured.py checks the model-state bytes against real runs.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from homelab_ft.plan.inputs import Cluster, PlanRequest
from homelab_ft.plan.price.activations import (
    activation_bytes,
    activation_dtype_bytes,
    activation_offload_host_bytes,
    gradients_at_recompute,
    logits_bytes,
    recomputed_block_bytes,
)
from homelab_ft.plan.price.host_ram import (
    host_bytes,
    loading_bytes,
    one_process_load_host_bytes,
)
from homelab_ft.plan.price.images import vision_bytes, vision_s
from homelab_ft.plan.price.network import (
    OFFLOAD_BYTES_PER_S,
    Communication,
    communication,
    compute_s,
    offload_s,
    prepass_s_per_pair,
)
from homelab_ft.plan.price.params import (
    adapter_bytes,
    base_weight_bytes,
    device_kept_bytes,
    gathered_end_params,
    host_embedding_bytes,
    largest_param,
    optimizer_bytes_per_param,
    optimizer_step_bytes,
    pageable_optimizer_bytes,
    quant_state_bytes,
    router_params,
    targeted_linears,
    trainable_params,
    vision_linears_for,
    weight_bytes,
)
from homelab_ft.plan.price.rollout import Rollout, generation_bytes, rollout
from homelab_ft.plan.shape.shapes import ModelShape
from homelab_ft.rules.adapter_sync import synced_bytes
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


def gib_text(nbytes: float) -> str:
    """Bytes as every plan line shows them: GiB with one decimal."""
    return f"{nbytes / GiB:.1f}"


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
    gradients_at_recompute: int = 0
    """Gradients made before the last block is recomputed, beyond `gradients_in_backward`: with
    activation checkpointing the first block is recomputed at the end of backward, when every later
    block's gradients exist (bench/memory.py --moe-shape: adapters on 64 experts x 4 blocks, 36.5 MB
    of fp32 gradients, put a 125 MB checkpointed step at 148-152 MB, 1.19-1.21 x the plan without them)."""
    gradients_in_backward: int = 0
    """Gradients alive at the activation peak (the start of backward): the LM head's, made by the
    first backward op while every activation is still held, and with gradient accumulation the
    sums of the earlier micro-batches. The others appear as backward frees activations."""
    step_temporary: int = 0
    """What the optimizer step allocates besides its state (optimizer_step_bytes)."""
    step_in_backward: bool = False
    """train.optimizer_in_backward: the step's temporaries appear inside backward, one parameter at
    a time, after the loss has freed its logits."""
    generation: int = 0
    """GRPO: bytes held while `generate` samples the rollouts (rollout.generation_bytes: what stays
    resident, the KV cache, the prefill's or a decode step's transients); 0 without generation."""
    vision_forward: int = 0
    """An image-text model: bytes held while its vision tower runs on the micro-batch's images, before
    the language model's activations exist (images.vision_bytes: its working set, and what a trained
    tower keeps, which `activations` holds too)."""

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
        language = self.activations - self.recomputed + max(self.recomputed + self.gradients_at_recompute, self.logits,
                                                             in_backward)
        return (self.weights + self.optimizer + self.gradients_in_backward + max(language, self.vision_forward)
                + self.gathered)

    @property
    def optimizer_step(self) -> int:
        """Bytes held by the optimizer step: every gradient exists, activations are gone."""
        return self.model_state + (0 if self.step_in_backward else self.step_temporary)

    @property
    def training_peak(self) -> int:
        """The training phases' peak: the larger of forward/backward and the optimizer step, with overhead."""
        return max(self.forward_backward, self.optimizer_step) + self.overhead

    @property
    def generation_peak(self) -> int:
        """GRPO's generation phase's peak, with overhead; 0 without generation."""
        return self.generation + self.overhead if self.generation else 0

    @property
    def total(self) -> int:
        """The peak is the larger phase, not the sum of all items: by the time every gradient
        exists, backward has freed the activations and logits they were computed from; GRPO's
        generation runs before the micro-batch's forward, its KV cache freed before training."""
        return max(self.training_peak, self.generation_peak)


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
    bubble_s: float
    """A pipeline's idle fill and drain (plan/price/pipeline.py); 0 without one."""
    stages: tuple[Stage, ...]
    """A pipeline's stages, first to last (plan/price/pipeline.py); () without one. `memory` is then the
    stage nearest its GPU's budget."""
    rollout: Rollout | None
    """GRPO's generation and no-grad forwards (plan/price/rollout.py); None for SFT and DPO."""

    @property
    def training_s(self) -> float:
        """Compute plus the communication that compute does not hide (see network.communication);
        offload copies and the CPU optimizer step are not overlapped, nor a pipeline's bubble."""
        return self.compute_s + self.bubble_s + self.comm_s - self.comm_hidden_s + self.offload_s

    @property
    def step_s(self) -> float:
        """`training_s`, and GRPO's rollout before it (generation and the no-grad forwards) or, on an
        overlapped rollout node, beside it (price/rollout.Rollout.step_s)."""
        return self.rollout.step_s(self.training_s) if self.rollout else self.training_s


@dataclass(frozen=True)
class Stage:
    """One pipeline stage: which blocks, where, and its peak (plan/price/pipeline.py prices it)."""

    index: int
    first_block: int
    num_blocks: int
    node: int
    device_bytes: int
    """The memory of the stage's GPU (uneven clusters: its node's, Cluster.node_device_bytes)."""
    budget_bytes: int
    """`device_bytes` minus the recipe's headroom."""
    memory_total: int
    """Peak bytes on the stage's GPU (Memory.total of its items)."""
    in_flight: int
    """Micro-batches whose activations the stage holds at once under the schedule."""
    compute_s: float
    """The stage's forward and backward seconds per optimizer step, bubble excluded."""


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


def _sizes(shape: ModelShape, rung: Rung, request: PlanRequest, cluster: Cluster) -> _Sizes:
    w_bytes = weight_bytes(request, cluster)
    # activations, and the unquantized ends (embeddings, norms, head), are in the compute dtype
    act_bytes = activation_dtype_bytes(rung, request, cluster)
    base_bytes, block_bytes = base_weight_bytes(shape, rung, request, cluster)
    if not rung.adapters_enabled:
        trainable, state_bytes = shape.total_params, w_bytes
    else:
        # PEFT creates adapters in fp32 even on a 16-bit base (get_peft_model's
        # autocast_adapter_dtype=True), so their gradients and AdamW states are fp32 too, unless
        # lora.dtype=compute keeps them in bf16 (modeling.attach_lora).
        trainable, state_bytes = trainable_params(shape, request), adapter_bytes(rung, request, cluster)
        # a trained router is the base's own weight, held in the adapters' dtype instead of the compute dtype
        base_bytes += trainable * state_bytes - router_params(shape, request) * act_bytes
    return _Sizes(w_bytes=w_bytes, act_bytes=act_bytes, base_bytes=base_bytes, block_bytes=block_bytes,
                  trainable=trainable, state_bytes=state_bytes)


def estimate(shape: ModelShape, *, rung: Rung, request: PlanRequest, cluster: Cluster) -> Estimate:
    """Peak memory per device, host RAM, traffic and time per step for one option: the `rung` the
    trainer would run (rung.py), whose properties say how parameters are spread."""
    cpu_offload, shards = rung.cpu_offload, rung.shard_size
    sizes = _sizes(shape, rung, request, cluster)
    act_host = activation_offload_host_bytes(shape, rung=rung, request=request, cluster=cluster)
    table_host = host_embedding_bytes(shape, rung=rung, request=request, cluster=cluster)
    device, resident = _device_memory(shape, sizes, rung=rung, request=request, cluster=cluster, act_host=act_host,
                                      table_host=table_host)
    offloaded = resident if cpu_offload else 0
    loading = loading_bytes(shape, rung, request, cluster, base_bytes=sizes.base_bytes,
                             sharded=shards > 1 or cpu_offload)
    host = host_bytes(device_total=device.total, offloaded=int(offloaded) + act_host + table_host, loading=loading, cluster=cluster)
    if shards == 1 and not cpu_offload:
        host = max(host, one_process_load_host_bytes(shape, held_on_cpu=device.overhead + device.weights, rung=rung, request=request, cluster=cluster))
    compute = compute_s(shape, rung=rung, request=request, cluster=cluster) + vision_s(shape, rung=rung, request=request,
                                                                                     cluster=cluster)
    if rung.rollout_node_enabled:  # rank 0 trains as one process: no gradient collectives (the adapters' sync is the rollout's)
        comm = Communication(sent_bytes=0, gathers_s=0.0, grads_s=0.0, backward_window=0.0, exposed_s=0.0)
    else:
        comm = communication(shape, sizes.base_bytes, sizes.trainable, rung=rung, request=request, cluster=cluster,
                             root_bytes=shape.root_params * sizes.act_bytes, grad_bytes=sizes.state_bytes,
                             sync_deferred=sync_deferred(shape, rung=rung, trainable=sizes.trainable))
    offload = offload_s(sizes.base_bytes / shards, sizes.trainable / shards, sizes.w_bytes, request) if cpu_offload else 0.0
    return Estimate(
        method=rung.method, strategy=rung.strategy, cpu_offload=cpu_offload, memory=device, host_bytes=host,
        trainable_params=sizes.trainable, comm_bytes=comm.sent_bytes, comm_s=comm.seconds,
        comm_hidden_s=comm.hidden_s(compute), compute_s=compute,
        # each micro-batch's block inputs go to the host in forward and come back in backward
        offload_s=offload + (2 * act_host + _looked_up_bytes(shape, request, sizes, on=table_host > 0))
        * request.train.grad_accum_steps / OFFLOAD_BYTES_PER_S,
        prepass_s_per_pair=prepass_s_per_pair(shape, rung, request, cluster), spilled_bytes=0,
        bubble_s=0.0, stages=(),
        rollout=rollout(shape, rung=rung, request=request, cluster=cluster, act_bytes=sizes.act_bytes,
                        base_bytes=sizes.base_bytes,
                        adapter_bytes=sizes.trainable * synced_bytes(sizes.state_bytes, sizes.act_bytes)
                        if rung.adapters_enabled else 0),
    )


def _looked_up_bytes(shape: ModelShape, request: PlanRequest, sizes: _Sizes, *, on: bool) -> int:
    """Bytes per micro-batch that a host embedding table sends to the GPU: the looked-up rows, tokens x
    hidden, once per forward (DPO runs the reference's too, KTO two of it and its KL forward; ORPO and SimPO have none). Their gradient is never sent back: the
    frozen table needs none, and the copy is the leaf activation checkpointing marks."""
    forwards = 1 + request.reference_forwards + request.kl_forwards
    return on * forwards * request.micro_batch_tokens * shape.hidden_size * sizes.act_bytes


def sync_deferred(shape: ModelShape, *, rung: Rung, trainable: int) -> bool:
    """FSDP2 reduce-scatters gradients once per step, not on every micro-batch: SHARD_GRAD_OP keeps
    its blocks gathered anyway, and the trainer defers the sync when few parameters train
    (DEFER_SYNC_TRAINABLE_FRACTION; a deferred sync keeps a whole unsharded gradient per rank)."""
    return not rung.reshard_after_forward or trainable < DEFER_SYNC_TRAINABLE_FRACTION * shape.total_params


def _device_memory(shape: ModelShape, sizes: _Sizes, *, rung: Rung, request: PlanRequest, cluster: Cluster,
                   act_host: int, table_host: int) -> tuple[Memory, float]:
    """(peak bytes on one device by item, the model state a rank holds, on the device or offloaded).
    `table_host`: the embedding table's bytes kept in host RAM, which the device's weights do not hold
    (taken off here rather than by replacing the Memory after: one dataclass built per estimate)."""
    cpu_offload, shards = rung.cpu_offload, rung.shard_size
    trainable, state_bytes, act_bytes = sizes.trainable, sizes.state_bytes, sizes.act_bytes
    # A sharded 4-bit base splits (and offloads) the packed bytes; its constants and one expert's
    # scratch stay whole on every rank's device (params.device_kept_bytes).
    kept = device_kept_bytes(shape, rung, request, cluster)
    sharded = (sizes.base_bytes - (quant_state_bytes(shape, request) if rung.quantized_enabled else 0)) / shards
    weights = sharded + kept
    gradients = trainable * state_bytes / shards
    in_backward = rung.optimizer_in_backward  # rung._validate: full fine-tunes only
    if in_backward:
        # optim_backward.py: a gradient lives from its hook to its parameter's step; the largest
        # one alone bounds what is left of the optimizer phase.
        gradients = largest_param(shape) * state_bytes / shards
    optimizer = trainable * optimizer_bytes_per_param(request, state_bytes) / shards
    # The LM head's gradient is the first one backward makes (with FSDP2 unsharded until the head
    # unit's post-backward right after the loss, a tied head's in the root unit until backward
    # ends); a tied head's is the embedding's. Adapters' are negligible.
    head_grads = 0 if rung.adapters_enabled else shape.vocab_size * shape.hidden_size * state_bytes
    step_temp = step_temporary_bytes(shape, rung, request, cluster, trainable=trainable, state_bytes=state_bytes,
                                      in_backward=in_backward) // shards
    held = dict(weights=int(kept if cpu_offload else weights) - table_host, gradients=int(0 if cpu_offload else gradients),
                optimizer=int(0 if cpu_offload else optimizer), gathered=int(_gathered_bytes(shape, sizes, rung=rung, request=request)))
    # GRPO generates each micro-batch's rollouts between the previous one's backward and its own
    # forward: the earlier micro-batches' gradients are summed by then
    resident = held["weights"] + held["optimizer"] + held["gathered"] + held["gradients"] * (request.train.grad_accum_steps > 1)
    if rung.rollout_node_enabled:  # the rollout node's GPU: the base and the adapters, nothing of training's,
        # the adapters held as they cross the link (rules/adapter_sync.py)
        resident = held["weights"] - trainable * (state_bytes - synced_bytes(state_bytes, act_bytes))
    vision_saved, vision_held = vision_bytes(shape, rung=rung, request=request, act_bytes=act_bytes)
    device = Memory(
        **held,
        activations=activation_bytes(shape, rung=rung, request=request, act_bytes=act_bytes, offloaded=act_host > 0)
        + vision_saved,
        vision_forward=vision_held,
        recomputed=recomputed_block_bytes(shape, rung=rung, request=request, act_bytes=act_bytes),
        logits=logits_bytes(shape, request, act_bytes),
        context=CUDA_CONTEXT_BYTES if cluster.device == "cuda" else CPU_PROCESS_BYTES,
        fragmentation=CUDA_FRAGMENTATION_BYTES if cluster.device == "cuda" else 0,
        pageable=int(0 if cpu_offload else pageable_optimizer_bytes(shape, rung, request, cluster) / shards),
        gradients_in_backward=int(gradients if request.train.grad_accum_steps > 1 and not cpu_offload and not in_backward else 0)
        + (head_grads if shards > 1 or cpu_offload or request.train.grad_accum_steps == 1 else 0),
        step_temporary=int(0 if cpu_offload else step_temp),
        step_in_backward=in_backward,
        gradients_at_recompute=int(gradients_at_recompute(shape, rung=rung, request=request, in_backward=in_backward)
                                   * state_bytes / shards),
        generation=generation_bytes(shape, rung=rung, request=request, act_bytes=act_bytes, resident=resident),
    )
    return device, sharded + gradients + optimizer


def _gathered_bytes(shape: ModelShape, sizes: _Sizes, *, rung: Rung, request: PlanRequest) -> float:
    """Unsharded parameters FSDP holds while computing (Memory.gathered)."""
    if rung.shard_size == 1 and not rung.cpu_offload:
        return 0
    # In backward FSDP holds one block's unsharded gradients in the param dtype plus their copy in
    # the reduce dtype for the reduce-scatter (full fine-tuning; adapter gradients are tiny).
    block_grads = 0 if rung.adapters_enabled else shape.max_block_params * (sizes.w_bytes + request.reduce_bytes)
    if not rung.reshard_after_forward:
        # SHARD_GRAD_OP: every block stays gathered from its forward to its backward; untied
        # embeddings are resharded after theirs (distributed.shard_ends); 4-bit constants are never
        # gathered (params.device_kept_bytes).
        states = quant_state_bytes(shape, request) if rung.quantized_enabled else 0
        return sizes.base_bytes - states - (shape.root_params - gathered_end_params(shape)) * sizes.act_bytes + block_grads
    # The LM head (and the root unit's final norm, or a tied embedding) gathered through the
    # loss and its backward, and the running block plus one prefetched block.
    return gathered_end_params(shape) * sizes.act_bytes + 2 * sizes.block_bytes + block_grads


def step_temporary_bytes(shape: ModelShape, rung: Rung, request: PlanRequest, cluster: Cluster, *,
                          trainable: int, state_bytes: int, in_backward: bool) -> int:
    """The optimizer step's temporaries before sharding: with the step in backward, one parameter
    at a time (the LM head's while activations live); else the whole step over the trainable set."""
    if in_backward:
        return optimizer_step_bytes(request, cluster, params=largest_param(shape), largest=largest_param(shape),
                                    state_bytes=state_bytes)
    if not rung.adapters_enabled:
        largest = largest_param(shape)
    else:  # the widest adapted layer, the language model's or a vision layer lora.target_modules names
        adapted = [*(lin for b in shape.blocks for lin in targeted_linears(b, request)),
                   *vision_linears_for(shape, request.lora.targets)]
        largest = max((lin.in_features + lin.out_features for lin in adapted), default=0) * request.lora.r
    return optimizer_step_bytes(request, cluster, params=trainable, largest=largest, state_bytes=state_bytes)
