"""The ladder: every option (method x sharding strategy x CPU offload) a cluster supports and the
trainer accepts, each priced by memory.estimate and judged against the recipe's headroom, and the
one rule that picks among those that fit. Pure: no torch, no I/O.

- `method: auto` walks the ladder in the seed's order, quantize first, then LoRA, then full
  fine-tuning, and takes the first rung with an option that the request allows and that fits;
- a named method keeps to that rung.
Within a rung the fastest fitting option wins, a near-tie going to fewer moving parts, then less traffic
(`choose`), which is how
full fine-tuning ends on the cheapest strategy for the link and how a slow link steers towards
HYBRID_SHARD or adapter-only data parallelism. Each option carries its verdict as one line of
text (`Option.reason`), which the plan shows as it is.
"""

from __future__ import annotations

import dataclasses
import itertools
from dataclasses import dataclass

from homelab_ft.plan.inputs import Cluster, PlanRequest
from homelab_ft.plan.price import pipeline
from homelab_ft.plan.price.memory import Estimate, estimate, gib_text, with_paged_spill
from homelab_ft.plan.price.network import OFFLOAD_BYTES_PER_S
from homelab_ft.plan.shape.shapes import ModelShape
from homelab_ft.rules import embedding_offload, refusals
from homelab_ft.rules.quant_rule import MAX_UNQUANTIZABLE_FRACTION, unquantizable_fraction
from homelab_ft.rung import (
    COLOCATED,
    FULL_SHARD,
    HYBRID_SHARD,
    METHODS,
    NO_SHARD,
    ROLLOUT_NODE,
    SHARD_GRAD_OP,
    Rung,
    RungError,
    build,
    implied_checkpointing,
    requested_rollout,
    requested_staleness,
)

LADDER = METHODS
STEP_TIME_TIE = 0.05
"""Step times closer than this fraction are below what the time model resolves (bench/network.py
measured its predictions within ~25% on slow links): `choose` calls them a tie."""


@dataclass(frozen=True)
class Option(Estimate):
    """An estimate judged against the cluster's budget and the user's request."""

    budget_bytes: int
    """Device memory minus headroom: what `memory.total` must stay under."""
    host_budget_bytes: int
    """Host RAM per node minus headroom (0 on a CPU 'device', where memory.total is host RAM)."""
    allowed: bool
    """The request (method, strategy, offload) permits this option."""
    fits: bool
    reason: str
    rung: Rung
    """The validated rung this option trains with: the planner offers nothing the trainer refuses."""

    @property
    def label(self) -> str:
        return pipeline.label(self.rung) if self.rung.pipeline_enabled else self.rung.label

    @property
    def batch_s(self) -> float:
        """Seconds per replica's batch (micro_batch x grad_accum_steps rows): the step divided by the
        data-parallel replicas, what `choose` ranks by. A sharded or DDP step trains one batch per
        rank, a pipelined one one per pipeline, so its step carries fewer rows."""
        return self.step_s / self.rung.data_parallel_size


def option_rung(method: str, strategy: str, offload: bool, *, request: PlanRequest, cluster: Cluster,
                savers: tuple[bool, bool] | None = None, stages: int = 1, rollout: str | None = None,
                shape: ModelShape | None = None) -> Rung:
    """The validated rung of one option on this cluster (raises RungError for one that cannot exist).
    `savers` is (activation checkpointing, activation offload); default: the request's first level.
    `stages` > 1: a pipeline (pipeline.py), its blocks per stage as the recipe gives them, else left
    for `price` to size to each GPU. `rollout`: where GRPO generates; default: the one the recipe
    names (colocated for `auto`, `requested_rollout`). With the model's `shape`, the rung's
    `embedding_offload` is decided (rules/embedding_offload.placed); without it the table stays on
    the device (a rung priced for its other fields alone). Whether the trainer runs it for this recipe and model is
    `refusals.refusals` (`offers` asks it of every option)."""
    checkpointing, act_offload = savers if savers is not None else saver_levels(request, cluster)[0]
    rung = build(method, strategy, offload, nodes=cluster.nodes, procs_per_node=cluster.gpus_per_node,
                 train=request.train, quant=request.quant, sharding=request.sharding, data=request.data,
                 activation_checkpointing=checkpointing, activation_offload=act_offload, pipeline_stages=stages,
                 rollout=requested_rollout(request.objective, request.grpo) if rollout is None else rollout,
                 staleness=requested_staleness(request.objective, request.grpo))
    return rung if shape is None else with_table(rung, request=request, shape=shape, cluster=cluster)


def with_table(rung: Rung, *, request: PlanRequest, shape: ModelShape, cluster: Cluster) -> Rung:
    """`rung` with `embedding_offload` decided for this model and device (rules/embedding_offload.placed):
    for every rung the ladder builds, and for the named rung `planner.named_rung` builds."""
    return embedding_offload.placed(rung, request.train.embedding_offload, targets=request.lora.targets,
                                    embedding_name=shape.embedding_name, tied=shape.tie_word_embeddings,
                                    device_type=cluster.device)


def rollouts(request: PlanRequest, cluster: Cluster) -> tuple[str, ...]:
    """Where the ladder prices GRPO's rollouts: the one `grpo.rollout` names, or with `auto` both
    colocated and, on a job the node runs on (refusals.ROLLOUT_NODE_PROCESSES), the rollout node;
    every other objective generates nothing (colocated stands for "no node")."""
    if request.objective != "grpo":
        return (COLOCATED,)
    if request.grpo.rollout != "auto":
        return (request.grpo.rollout,)
    return (COLOCATED, ROLLOUT_NODE) if cluster.world_size == refusals.ROLLOUT_NODE_PROCESSES else (COLOCATED,)


def saver_levels(request: PlanRequest, cluster: Cluster) -> list[tuple[bool, bool]]:
    """The (activation checkpointing, activation offload) settings one option is priced with, fastest
    first: what the recipe fixes stays fixed, what it leaves `auto` is tried off, then on. The cheap
    savers come before any costlier rung, offload or GPU: `evaluate` keeps, per option, the first
    level that fits. Activation offload only helps where there is a GPU to offload from."""
    off = request.train.activation_offload
    ckpt = implied_checkpointing(request.train.activation_checkpointing, activation_offload=off)
    ckpts = [ckpt] if isinstance(ckpt, bool) else [False, True]
    levels = []
    for c in ckpts:
        offs = [off] if isinstance(off, bool) else [False, True] if c and cluster.device == "cuda" else [False]
        levels += [(c, o) for o in offs]
    return levels


@dataclass(frozen=True)
class Refusal:
    """An option the ladder does not offer: the trainer would refuse it (refusals.py, rung._validate)."""

    label: str
    reason: str
    """The refusal's one line, naming the recipe key and the fix."""


def evaluate(shape: ModelShape, *, request: PlanRequest, cluster: Cluster) -> tuple[Option, ...]:
    """Every option this cluster supports and the trainer accepts, with its estimate, whether it fits and why."""
    return offers(shape, request=request, cluster=cluster)[0]


def offers(shape: ModelShape, *, request: PlanRequest, cluster: Cluster) -> tuple[tuple[Option, ...], tuple[Refusal, ...]]:
    """`evaluate`'s options, and the ones not offered with why: a rung that does not validate (QLoRA
    with a sharded 8-bit base, 8-bit AdamW under FSDP2) or that one of the trainer's rules refuses
    for this recipe and model (refusals.py: a pipeline for DPO, for 4-bit MoE experts ...)."""
    budget = int(cluster.device_bytes * (1 - request.planner.headroom))
    host_budget = int(cluster.host_ram_bytes * (1 - request.planner.headroom))
    moe_experts = any(b.expert_stacks for b in shape.blocks)
    out, refused = [], []
    levels = saver_levels(request, cluster)
    placed = rollouts(request, cluster)
    for method in LADDER:
        for (strategy, offload, stages), rollout in itertools.product(_strategies(shape, cluster, request=request),
                                                                      placed):
            # pipeline.py prices no activation offload, and the pipelined step runs none (refusals.activation_offload)
            pipelined_levels = [level for level in levels if not (stages > 1 and level[1])] or levels
            try:
                rungs = [option_rung(method, strategy, offload, request=request, cluster=cluster, savers=level,
                                     stages=stages, rollout=rollout, shape=shape) for level in pipelined_levels]
                why = next((w for r in rungs for w in refusals.refusals(r, request, num_blocks=shape.num_layers,
                                                                        moe_experts=moe_experts)), None)
            except RungError as err:
                why = str(err)
            if why is not None:
                if rollout == ROLLOUT_NODE and len(placed) > 1:
                    continue  # `auto` tried the node beside every colocated option: only where it runs is news
                refused.append(Refusal(label=_plain_label(method, strategy, offload, stages, rollout), reason=why))
                continue
            saver_note = ""
            for rung in rungs:  # the first saver level that fits, else the leanest
                est, fits, reason, rung = sized_price(shape, rung=rung, request=request, cluster=cluster)
                if fits or rung is rungs[-1]:
                    break
                saver_note = f"{_next_saver(rung)}=auto turned on: without it {gib_text(est.memory.total)} GiB"
            if saver_note and fits:
                reason += f" ({saver_note})"
            estimated = {f.name: getattr(est, f.name) for f in dataclasses.fields(est)}
            out.append(Option(
                **estimated, budget_bytes=_budget(est, budget),
                host_budget_bytes=host_budget if cluster.device == "cuda" else 0,
                allowed=_allowed(method, strategy, offload, stages, request=request, cluster=cluster), fits=fits,
                reason=reason,
                rung=rung,
            ))
    return tuple(out), tuple(refused)


def _plain_label(method: str, strategy: str, offload: bool, stages: int, rollout: str = COLOCATED) -> str:
    """An option's name without its savers (the plan's `not offered` lines)."""
    if stages > 1:
        return f"{method} pipeline {stages} stages"
    return f"{method} {strategy}{' +offload' if offload else ''}{' +rollout-node' if rollout == ROLLOUT_NODE else ''}"


def price(shape: ModelShape, *, rung: Rung, request: PlanRequest, cluster: Cluster) -> tuple[Estimate, bool, str]:
    """One rung's estimate (paged optimizer state spilled past the budget), whether it fits the
    device and host budgets left by the recipe's headroom, and the verdict's line."""
    return sized_price(shape, rung=rung, request=request, cluster=cluster)[:3]


PRICED_KEPT = 4096
"""How many priced options `sized_price` keeps (oldest dropped first): a plan with its advice and
limits prices a few hundred; test_rung's grid re-prices each plan's options once per option."""
_priced: dict[tuple, tuple[Estimate, bool, str, Rung]] = {}


def sized_price(shape: ModelShape, *, rung: Rung, request: PlanRequest,
                cluster: Cluster) -> tuple[Estimate, bool, str, Rung]:
    """`price`, and the rung priced: a pipeline's with its blocks per stage sized to each GPU
    (pipeline.sized) unless the recipe gave them. A pipeline's budget is its tightest stage's.

    Kept per (shape, rung, cluster, request.pricing_key): pricing is pure, and the same option is
    priced again by every `evaluate` of a request that differs only in what the rung decides
    (method, sharding.strategy, sharding.cpu_offload: `what_would_fit`'s method and offload
    changes, `afford.for_rung`, a recipe naming a printed option). Everything here is frozen, so
    callers share the result."""
    key = (shape, rung, cluster, request.pricing_key)
    priced = _priced.get(key)
    if priced is None:
        priced = _priced[key] = _sized_price(shape, rung=rung, request=request, cluster=cluster)
        if len(_priced) > PRICED_KEPT:
            del _priced[next(iter(_priced))]
    return priced


def _sized_price(shape: ModelShape, *, rung: Rung, request: PlanRequest,
                 cluster: Cluster) -> tuple[Estimate, bool, str, Rung]:
    """`sized_price` without its memory."""
    budget = int(cluster.device_bytes * (1 - request.planner.headroom))
    host_budget = int(cluster.host_ram_bytes * (1 - request.planner.headroom))
    if rung.pipeline_enabled:
        rung = pipeline.sized(shape, rung=rung, request=request, cluster=cluster)
        est = pipeline.estimate(shape, rung=rung, request=request, cluster=cluster)
    else:
        est = estimate(shape, rung=rung, request=request, cluster=cluster)
    budget = _budget(est, budget)
    est = with_paged_spill(est, budget=budget)
    fits, reason = _verdict(shape, est, budget=budget, host_budget=host_budget, request=request, cluster=cluster)
    return est, fits, reason, rung


def _budget(est: Estimate, budget: int) -> int:
    """The device budget `est` is judged against: a pipeline's stage nearest its own GPU's budget."""
    if not est.stages:
        return budget
    return max(est.stages, key=lambda s: s.memory_total / max(1, s.budget_bytes)).budget_bytes


def choose(options: tuple[Option, ...], *, request: PlanRequest) -> Option | None:
    """The option a plan trains with: the first rung of the ladder with an allowed option that fits,
    and within it the fastest, unless another is no more than STEP_TIME_TIE slower (a tie).

    A tie goes to the option with fewer moving parts (`moving_parts`: CPU offload, activation
    offload, sharding on one GPU), then to the one that moves fewer bytes, then to the faster. The
    time model cannot tell options that close apart (bench/network.py: its predictions land within
    ~25% on slow links), while each moving part is one more thing that can be slow in ways it does
    not model (pinned-memory pressure, PCIe shared with a second card, CPU AdamW on a busy host)
    and one more path that can fail: an estimated 0.8% gain (one 24 GB card, micro-batch 16:
    `qlora full_shard +offload +ckpt` against `qlora no_shard +act-off`) is not worth them. Fewer
    collectives fail less and overlap with compute is never perfect, so fewer bytes come next.
    """
    rungs = LADDER if request.method == "auto" else (request.method,)
    for rung in rungs:
        candidates = [o for o in options if o.method == rung and o.allowed and o.fits]
        if candidates:
            fastest = min(o.batch_s for o in candidates)
            tied = [o for o in candidates if o.batch_s <= fastest * (1 + STEP_TIME_TIE)]
            return min(tied, key=lambda o: (moving_parts(o.rung), o.comm_bytes, round(o.batch_s, 3), o.memory.total))
    return None


def moving_parts(rung: Rung) -> int:
    """What a rung runs beyond a plain forward and backward on its devices, for `choose`'s ties:
    CPU offload (shards and AdamW in host RAM), activation offload (block inputs over PCIe),
    FSDP2 on a single device (there only to offload), and a pipeline schedule (a stage waits on
    its neighbours' sends), and a rollout node (a second process the step waits on). Sharding across
    several devices is not counted: there it is how the model fits, and its cost is in the traffic
    `choose` compares."""
    return (int(rung.cpu_offload) + int(rung.activation_offload and rung.activation_checkpointing)
            + int(rung.world_size == 1 and rung.strategy != NO_SHARD) + int(rung.pipeline_enabled)
            + int(rung.rollout_node_enabled))


def _next_saver(rung: Rung) -> str:
    """The recipe key of what the next saver level adds to `rung` (for the note on an option that needed it)."""
    return "train.activation_offload" if rung.activation_checkpointing else "train.activation_checkpointing"


def _strategies(shape: ModelShape, cluster: Cluster, *, request: PlanRequest) -> list[tuple[str, bool, int]]:
    """(strategy, offload, pipeline stages) of every option. One device: plain, or FSDP2 on one
    rank to offload to the CPU. Several: DDP-style replication, FULL_SHARD and SHARD_GRAD_OP (and
    HYBRID_SHARD across nodes with several GPUs each), the sharded ones with and without offload,
    then the pipelines (`pipeline_counts`), their replicas under DDP. A CPU 'device' has nothing to
    offload to."""
    offloads = (False,) if cluster.device == "cpu" else (False, True)
    if cluster.world_size == 1:
        return [(NO_SHARD, False, 1)] + [(FULL_SHARD, True, 1)] * (cluster.device != "cpu")
    sharded = [FULL_SHARD, SHARD_GRAD_OP]
    if cluster.nodes > 1 and cluster.gpus_per_node > 1:
        sharded.append(HYBRID_SHARD)
    pipelines = [(NO_SHARD, False, s) for s in pipeline_counts(shape, cluster, request=request)]
    return [(NO_SHARD, False, 1)] + [(s, off, 1) for s in sharded for off in offloads] + pipelines


def pipeline_counts(shape: ModelShape, cluster: Cluster, *, request: PlanRequest) -> list[int]:
    """The pipelines the ladder prices: the recipe's sharding.pipeline_stages when it names more than
    one, else (on GPUs) one stage per node (the replicas of a stage share its node's PCIe) and one
    stage per GPU, never more stages than blocks. With `auto` the ladder may take them; with 1 (the
    default) they are priced as not requested, so the advice can say what one would plan. CPU runs
    pipeline only when the recipe names the stages."""
    if isinstance(request.sharding.pipeline_stages, int) and request.sharding.pipeline_stages > 1:
        return [request.sharding.pipeline_stages]
    if cluster.device != "cuda":
        return []
    counts = {cluster.nodes, cluster.world_size} if cluster.nodes > 1 else {cluster.gpus_per_node}
    return sorted(s for s in counts if 1 < s <= shape.num_layers)


def _allowed(method: str, strategy: str, offload: bool, stages: int = 1, *, request: PlanRequest,
             cluster: Cluster) -> bool:
    if request.method not in ("auto", method):
        return False
    if request.sharding.cpu_offload and not offload:
        return False
    if request.sharding.pipeline_stages not in ("auto", stages):
        return False
    if request.sharding.strategy == "auto" or 1 < stages == request.sharding.pipeline_stages:
        return True
    if cluster.world_size == 1 and not offload:
        return True  # one device has no strategy to choose
    return strategy == request.sharding.strategy and offload == request.sharding.cpu_offload and stages == 1


def _verdict(shape: ModelShape, est: Estimate, *, budget: int, host_budget: int, request: PlanRequest,
             cluster: Cluster) -> tuple[bool, str]:
    device = "GPU" if cluster.device == "cuda" else "process"
    layout = f"pipeline {len(est.stages)} stages" if est.stages else est.strategy
    name = f"{_method_label(est.method, request, cluster)} {layout}{' +offload' if est.cpu_offload else ''}"
    if est.method == "qlora" and _unquantizable_fraction(shape, bits=request.quant.bits) > MAX_UNQUANTIZABLE_FRACTION:
        share = _unquantizable_fraction(shape, bits=request.quant.bits)
        return False, (f"{name}: {share:.0%} of the block weights are MoE expert tensors that bitsandbytes "
                       "cannot quantize (quant.py refuses); use lora or full")
    limit = f"{gib_text(cluster.device_bytes)} GiB - {request.planner.headroom:.0%} headroom"
    total = est.memory.total - est.spilled_bytes
    if total > budget:
        biggest = max(("activations", "logits", "weights", "gathered", "optimizer", "gradients"),
                      key=lambda k: getattr(est.memory, k))
        largest = f"largest: {biggest} {gib_text(getattr(est.memory, biggest))} GiB"
        if est.rollout and est.memory.generation_peak > est.memory.training_peak:
            largest = f"generating; its KV cache {gib_text(est.rollout.kv_cache_bytes)} GiB"
        return False, f"{name}: {gib_text(total)} GiB per {device} > {limit} ({largest})"
    if cluster.device == "cuda" and est.host_bytes > host_budget:
        return False, (f"{name}: host RAM {gib_text(est.host_bytes)} GiB per node > "
                       f"{gib_text(cluster.host_ram_bytes)} GiB - {request.planner.headroom:.0%} headroom")
    spill = (f" (paged optimizer state: {gib_text(est.spilled_bytes)} GiB spills to host RAM, "
             f"~{2 * est.spilled_bytes / OFFLOAD_BYTES_PER_S:.1f} s/step of paging)") if est.spilled_bytes else ""
    return True, f"{name}: {gib_text(total)} GiB per {device} <= {limit}{spill}"


def _unquantizable_fraction(shape: ModelShape, *, bits: int) -> float:
    """Fused experts count as quantized in 4 bits: model/quant.py packs them (moe_experts.py); in 8 they
    stay kept (quant.py refuses quant.bits=8 on an MoE model)."""
    experts = bits == 4
    kept = sum(b.num_blocks * (b.params - b.linear_weight_params - experts * b.expert_params) for b in shape.blocks)
    return unquantizable_fraction(quantized_params=shape.block_params - kept, kept_params=kept)


def _method_label(method: str, request: PlanRequest, cluster: Cluster) -> str:
    if method == "qlora":
        return "QLoRA nf4" if request.quant.bits == 4 else "QLoRA int8"
    dtype = request.model.dtype if request.model.dtype != "auto" else ("bfloat16" if cluster.device == "cuda" else "float32")
    short = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}[dtype]
    return f"{'LoRA' if method == 'lora' else 'full'} {short}"
