"""The decision ladder: which rung (QLoRA -> LoRA -> full sharded) and strategy a run uses, and why.

`plan()` is pure: it evaluates every option (method x sharding strategy x CPU offload) with the
memory/network model of memory.py, marks which fit the cluster with the recipe's headroom, and
picks one:
- `method: auto` walks the ladder in the seed's order, quantize first, then LoRA, then full
  fine-tuning, and takes the first rung with an option that the request allows and that fits;
- a named method keeps to that rung.
Within a rung the fastest fitting option wins (estimated step time, then traffic, then memory), which is how
full fine-tuning ends on the cheapest strategy for the link and how a slow link steers towards
HYBRID_SHARD or adapter-only data parallelism. When nothing fits, the plan keeps the closest
option and what would make something fit; the CLI prints that and exits 2.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass

from homelab_ft.config import MAX_UNQUANTIZABLE_FRACTION
from homelab_ft.errors import UserError
from homelab_ft.plan.diskspace import checkpoint_bytes
from homelab_ft.plan.memory import (
    OFFLOAD_BYTES_PER_S,
    Cluster,
    Estimate,
    GiB,
    PlanRequest,
    estimate,
    with_paged_spill,
)
from homelab_ft.plan.shapes import ModelShape
from homelab_ft.rung import (
    FULL_SHARD,
    HYBRID_SHARD,
    METHODS,
    NO_SHARD,
    SHARD_GRAD_OP,
    Rung,
    RungError,
    implied_checkpointing,
    requested_rung,
)

LADDER = METHODS
STEP_TIME_TIE = 0.05
"""Step times closer than this fraction are below what the time model resolves (bench/network.py
measured its predictions within ~25% on slow links); the option moving fewer bytes wins them."""


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
        return self.rung.label


@dataclass(frozen=True)
class Plan:
    model: str
    config_source: str
    """Where config.json came from (a path, GGUF metadata, or the bundled copy)."""
    shape: ModelShape
    cluster: Cluster
    request: PlanRequest
    options: tuple[Option, ...]
    chosen: Option | None
    closest: Option | None
    """When nothing fits: the allowed option that comes nearest (smallest total / budget)."""
    suggestions: tuple[str, ...]
    """When nothing fits: changes that would make an option fit, each with its numbers."""
    warnings: tuple[str, ...]

    @property
    def fits(self) -> bool:
        return self.chosen is not None

    @property
    def checkpoint_bytes(self) -> int | None:
        """One checkpoint of the chosen option on disk (diskspace.checkpoint_bytes)."""
        if self.chosen is None:
            return None
        return checkpoint_bytes(self.chosen, request=self.request, cluster=self.cluster)

    def to_dict(self) -> dict:
        def option(o: Option | None):
            if o is None:
                return None
            data = dataclasses.asdict(o)
            data["memory"]["total"] = o.memory.total
            data["step_s"] = o.step_s
            return data

        return {
            "model": self.model,
            "config_source": self.config_source,
            "model_type": self.shape.model_type,
            "total_params": self.shape.total_params,
            "active_params": self.shape.active_params,
            "cluster": dataclasses.asdict(self.cluster),
            "request": dataclasses.asdict(self.request),
            "fits": self.fits,
            "chosen": option(self.chosen),
            "checkpoint_bytes": self.checkpoint_bytes,
            "closest": option(self.closest),
            "suggestions": list(self.suggestions),
            "warnings": list(self.warnings),
            "options": [option(o) for o in self.options],
        }

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2)


# --------------------------------------------------------------------------------------------
# the decision


def plan(shape: ModelShape, *, request: PlanRequest, cluster: Cluster, model: str = "", config_source: str = "") -> Plan:
    """Evaluate every option, pick one by the ladder, explain the rest."""
    validate(shape, request=request, cluster=cluster)
    options = evaluate(shape, request=request, cluster=cluster)
    chosen = choose(options, request=request)
    closest, suggestions = None, ()
    if chosen is None:
        allowed = [o for o in options if o.allowed] or list(options)
        closest = min(allowed, key=_pressure)
        suggestions = what_would_fit(shape, request=request, cluster=cluster, closest=closest)
    return Plan(model=model, config_source=config_source, shape=shape, cluster=cluster, request=request, options=options, chosen=chosen,
                closest=closest, suggestions=suggestions, warnings=_warnings(shape, chosen, request, cluster))


def validate(shape: ModelShape, *, request: PlanRequest, cluster: Cluster) -> None:
    if request.seq_len > shape.max_position_embeddings:
        raise UserError(
            f"data.max_length={request.seq_len} is beyond the model's max_position_embeddings="
            f"{shape.max_position_embeddings}; lower data.max_length"
        )
    if request.method != "auto" and request.strategy != "auto":
        # A fully named rung is refused here, before anything is priced, created or launched.
        requested_rung(request.method, strategy=request.strategy, cpu_offload=request.cpu_offload,
                       nodes=cluster.nodes, procs_per_node=cluster.gpus_per_node, optimizer=request.optimizer,
                       optimizer_in_backward=request.optimizer_in_backward, quant_bits=request.quant_bits,
                       activation_checkpointing=request.activation_checkpointing,
                       activation_offload=request.activation_offload)
    elif request.strategy == HYBRID_SHARD and cluster.nodes < 2:
        raise RungError("sharding.strategy=hybrid_shard shards inside a node and replicates across nodes: "
                        "it needs cluster.nodes >= 2; on one machine use full_shard")


def option_rung(method: str, strategy: str, offload: bool, *, request: PlanRequest, cluster: Cluster,
                savers: tuple[bool, bool] | None = None) -> Rung:
    """The validated rung of one option on this cluster (raises RungError for one the trainer refuses).
    `savers` is (activation checkpointing, activation offload); default: the request's first level."""
    checkpointing, act_offload = savers if savers is not None else saver_levels(request, cluster)[0]
    return Rung(method=method, strategy=strategy, cpu_offload=offload, nodes=cluster.nodes,
                procs_per_node=cluster.gpus_per_node, optimizer=request.optimizer,
                optimizer_in_backward=request.optimizer_in_backward, quant_bits=request.quant_bits,
                activation_checkpointing=checkpointing, activation_offload=act_offload)


def saver_levels(request: PlanRequest, cluster: Cluster) -> list[tuple[bool, bool]]:
    """The (activation checkpointing, activation offload) settings one option is priced with, fastest
    first: what the recipe fixes stays fixed, what it leaves `auto` is tried off, then on. The cheap
    savers come before any costlier rung, offload or GPU: `evaluate` keeps, per option, the first
    level that fits. Activation offload only helps where there is a GPU to offload from."""
    off = request.activation_offload
    ckpt = implied_checkpointing(request.activation_checkpointing, activation_offload=off)
    ckpts = [ckpt] if isinstance(ckpt, bool) else [False, True]
    levels = []
    for c in ckpts:
        offs = [off] if isinstance(off, bool) else [False, True] if c and cluster.device == "cuda" else [False]
        levels += [(c, o) for o in offs]
    return levels


def evaluate(shape: ModelShape, *, request: PlanRequest, cluster: Cluster) -> tuple[Option, ...]:
    """Every option this cluster supports and the trainer accepts (a `Rung` that validates), with
    its estimate, whether it fits and why."""
    budget = int(cluster.device_bytes * (1 - request.headroom))
    host_budget = int(cluster.host_ram_bytes * (1 - request.headroom))
    out = []
    levels = saver_levels(request, cluster)
    for method in LADDER:
        for strategy, offload in _strategies(cluster):
            try:
                rungs = [option_rung(method, strategy, offload, request=request, cluster=cluster, savers=level)
                         for level in levels]
            except RungError:
                continue  # e.g. QLoRA with a sharded base, 8-bit AdamW under FSDP2
            saver_note = ""
            for rung in rungs:  # the first saver level that fits, else the leanest
                est = with_paged_spill(estimate(shape, rung=rung, request=request, cluster=cluster), budget=budget)
                fits, reason = _verdict(shape, est, budget=budget, host_budget=host_budget, request=request, cluster=cluster)
                if fits or rung is rungs[-1]:
                    break
                saver_note = f"{_next_saver(rung)}=auto turned on: without it {_gib(est.memory.total)} GiB"
            if saver_note and fits:
                reason += f" ({saver_note})"
            estimated = {f.name: getattr(est, f.name) for f in dataclasses.fields(est)}
            out.append(Option(
                **estimated, budget_bytes=budget,
                host_budget_bytes=host_budget if cluster.device == "cuda" else 0,
                allowed=_allowed(method, strategy, offload, request=request, cluster=cluster), fits=fits, reason=reason,
                rung=rung,
            ))
    return tuple(out)


def choose(options: tuple[Option, ...], *, request: PlanRequest) -> Option | None:
    rungs = LADDER if request.method == "auto" else (request.method,)
    for rung in rungs:
        candidates = [o for o in options if o.method == rung and o.allowed and o.fits]
        if candidates:
            # Step times within STEP_TIME_TIE of the fastest are a tie, which goes to the option that
            # moves fewer bytes: overlap of communication with compute is never perfect, and fewer
            # collectives fail less.
            fastest = min(o.step_s for o in candidates)
            tied = [o for o in candidates if o.step_s <= fastest * (1 + STEP_TIME_TIE)]
            return min(tied, key=lambda o: (o.comm_bytes, round(o.step_s, 3), o.memory.total))
    return None


def _next_saver(rung: Rung) -> str:
    """The recipe key of what the next saver level adds to `rung` (for the note on an option that needed it)."""
    return "train.activation_offload" if rung.activation_checkpointing else "train.activation_checkpointing"


def _strategies(cluster: Cluster) -> list[tuple[str, bool]]:
    """One device: plain, or FSDP2 on one rank to offload to the CPU. Several: DDP-style
    replication, FULL_SHARD and SHARD_GRAD_OP (and HYBRID_SHARD across nodes with several GPUs
    each), the sharded ones with and without offload. A CPU 'device' has nothing to offload to."""
    offloads = (False,) if cluster.device == "cpu" else (False, True)
    if cluster.world_size == 1:
        return [(NO_SHARD, False)] + [(FULL_SHARD, True)] * (cluster.device != "cpu")
    sharded = [FULL_SHARD, SHARD_GRAD_OP]
    if cluster.nodes > 1 and cluster.gpus_per_node > 1:
        sharded.append(HYBRID_SHARD)
    return [(NO_SHARD, False)] + [(s, off) for s in sharded for off in offloads]


def _allowed(method: str, strategy: str, offload: bool, *, request: PlanRequest, cluster: Cluster) -> bool:
    if request.method not in ("auto", method):
        return False
    if request.cpu_offload and not offload:
        return False
    if request.strategy == "auto":
        return True
    if cluster.world_size == 1 and not offload:
        return True  # one device has no strategy to choose
    return strategy == request.strategy and offload == request.cpu_offload


def _verdict(shape: ModelShape, est: Estimate, *, budget: int, host_budget: int, request: PlanRequest,
             cluster: Cluster) -> tuple[bool, str]:
    device = "GPU" if cluster.device == "cuda" else "process"
    name = f"{_method_label(est.method, request, cluster)} {est.strategy}{' +offload' if est.cpu_offload else ''}"
    if est.method == "qlora" and _unquantizable_fraction(shape) > MAX_UNQUANTIZABLE_FRACTION:
        share = _unquantizable_fraction(shape)
        return False, (f"{name}: {share:.0%} of the block weights are MoE expert tensors that bitsandbytes "
                       "cannot quantize (quant.py refuses); use lora or full")
    limit = f"{_gib(cluster.device_bytes)} GiB - {request.headroom:.0%} headroom"
    total = est.memory.total - est.spilled_bytes
    if total > budget:
        biggest = max(("activations", "logits", "weights", "gathered", "optimizer", "gradients"),
                      key=lambda k: getattr(est.memory, k))
        return False, (f"{name}: {_gib(total)} GiB per {device} > {limit} "
                       f"(largest: {biggest} {_gib(getattr(est.memory, biggest))} GiB)")
    if cluster.device == "cuda" and est.host_bytes > host_budget:
        return False, (f"{name}: host RAM {_gib(est.host_bytes)} GiB per node > "
                       f"{_gib(cluster.host_ram_bytes)} GiB - {request.headroom:.0%} headroom")
    spill = (f" (paged optimizer state: {_gib(est.spilled_bytes)} GiB spills to host RAM, "
             f"~{2 * est.spilled_bytes / OFFLOAD_BYTES_PER_S:.1f} s/step of paging)") if est.spilled_bytes else ""
    return True, f"{name}: {_gib(total)} GiB per {device} <= {limit}{spill}"


def _unquantizable_fraction(shape: ModelShape) -> float:
    blocks = shape.block_params
    return sum(b.num_blocks * (b.params - b.linear_weight_params) for b in shape.blocks) / blocks


def _method_label(method: str, request: PlanRequest, cluster: Cluster) -> str:
    if method == "qlora":
        return "QLoRA nf4" if request.quant_bits == 4 else "QLoRA int8"
    dtype = request.dtype if request.dtype != "auto" else ("bfloat16" if cluster.device == "cuda" else "float32")
    short = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}[dtype]
    return f"{'LoRA' if method == 'lora' else 'full'} {short}"


def _pressure(option: Option) -> float:
    """How far over its limits an option is: the worse of device memory and (on GPUs) host RAM."""
    device = option.memory.total / max(1, option.budget_bytes)
    host = option.host_bytes / max(1, option.host_budget_bytes) if option.host_budget_bytes else 0.0
    return max(device, host)


def _gib(nbytes: float) -> str:
    return f"{nbytes / GiB:.1f}"


# --------------------------------------------------------------------------------------------
# when nothing fits, and warnings


def what_would_fit(shape: ModelShape, *, request: PlanRequest, cluster: Cluster, closest: Option) -> tuple[str, ...]:
    """Changes, one at a time, that make an allowed option fit, each with the option it gives."""
    r, c = request, cluster
    tries: list[tuple[str, PlanRequest, Cluster]] = []
    # The cheap savers first: they cost a little compute, never a rung or a GPU.
    if r.loss_chunk_tokens <= 0:
        tries.append(("train.loss_chunk_tokens=128", dataclasses.replace(r, loss_chunk_tokens=128), c))
    if not r.activation_checkpointing:
        tries.append(("train.activation_checkpointing=true", dataclasses.replace(r, activation_checkpointing=True), c))
    if c.device == "cuda" and not r.activation_offload:
        tries.append(("train.activation_checkpointing=true train.activation_offload=true",
                      dataclasses.replace(r, activation_checkpointing=True, activation_offload=True), c))
    if r.method == "full" and not r.optimizer_in_backward and r.grad_accum_steps == 1:
        tries.append(("train.optimizer_in_backward=true train.max_grad_norm=0",
                      dataclasses.replace(r, optimizer_in_backward=True), c))
    if r.micro_batch_size > 1:
        accum = r.grad_accum_steps * r.micro_batch_size
        tries.append((f"train.micro_batch_size=1 train.grad_accum_steps={accum} (same batch)",
                      dataclasses.replace(r, micro_batch_size=1, grad_accum_steps=accum), c))
    seq = r.seq_len // 2
    while seq >= 128:
        tries.append((f"data.max_length={seq}", dataclasses.replace(r, seq_len=seq), c))
        seq //= 2
    if c.device == "cuda" and not r.cpu_offload:
        tries.append(("sharding.strategy=auto sharding.cpu_offload=true",
                      dataclasses.replace(r, strategy="auto", cpu_offload=True), c))
    if r.method in ("lora", "full"):
        lighter = "qlora" if r.method == "lora" else "lora"
        tries.append((f"method={lighter}", dataclasses.replace(r, method=lighter), c))
    for more in (2, 4, 8):
        if more > c.gpus_per_node and c.device == "cuda":
            tries.append((f"--gpus {more}x{_gib(c.device_bytes)}GB", r, dataclasses.replace(c, gpus_per_node=more)))
    if c.device == "cuda":
        tries.append((f"--nodes {c.nodes * 2}", r, dataclasses.replace(c, nodes=c.nodes * 2)))

    found: list[str] = []
    shorter_found = False
    for text, req, clu in tries:
        if shorter_found and text.startswith("data.max_length"):
            continue  # the longest sequence that fits is the useful one
        option = choose(evaluate(shape, request=req, cluster=clu), request=req)
        if option is not None:
            found.append(f"{text}: {option.label} fits ({_gib(option.memory.total)} of {_gib(option.budget_bytes)} GiB)")
            shorter_found = shorter_found or text.startswith("data.max_length")
        if len(found) >= 4:
            break
    device_need = closest.memory.total / (1 - request.headroom)
    if closest.host_budget_bytes and closest.host_bytes > closest.host_budget_bytes:
        found.append(f"host RAM >= {_gib(closest.host_bytes / (1 - request.headroom))} GiB per node"
                     + (f" and GPUs with >= {_gib(device_need)} GiB" if closest.memory.total > closest.budget_bytes else "")
                     + f": {closest.label} would fit")
    else:
        what = "GPUs" if cluster.device == "cuda" else "host RAM per process"
        found.append(f"{what} with >= {_gib(device_need)} GiB: {closest.label} would fit")
    return tuple(dict.fromkeys(found))


def _warnings(shape: ModelShape, chosen: Option | None, request: PlanRequest, cluster: Cluster) -> tuple[str, ...]:
    out = list(shape.notes)
    if chosen is None:
        return tuple(out)
    if chosen.comm_s > chosen.compute_s and chosen.comm_s > 0:
        link = (_inter_link_name(cluster) if cluster.nodes > 1
                else cluster.intra_link if cluster.device == "cuda" else "gloo")
        advice = ("hybrid_shard keeps weight traffic inside each node, and LoRA/QLoRA with no_shard "
                  "(adapter-only data parallelism) sends only the adapter gradients"
                  if chosen.method == "full" else "fewer, larger optimizer steps (grad_accum_steps) amortise it")
        out.append(f"communication dominates: {chosen.comm_s:.1f} s/step ({_gib(chosen.comm_bytes)} GiB per rank over "
                   f"{link}) vs {chosen.compute_s:.1f} s/step of compute; {advice}")
    if chosen.cpu_offload:
        out.append(f"CPU offload adds ~{chosen.offload_s:.1f} s/step (PCIe copies of the shards, AdamW on the CPU)")
    if shape.is_moe and chosen.method != "full":
        out.append("MoE: expert weights are 3-D parameters in transformers 5; all-linear LoRA trains attention "
                   "(and shared-expert) layers only")
    if request.optimizer == "paged_adamw_8bit" and cluster.device == "cpu":
        out.append("train.optimizer=paged_adamw_8bit pages to host RAM only on CUDA; on the CPU it runs as adamw_8bit")
    return tuple(out)


# --------------------------------------------------------------------------------------------
# from a recipe, and as text


def request_from_recipe(recipe) -> PlanRequest:
    """The planner's view of a `config.Recipe`."""
    targets = recipe.lora.target_modules
    return PlanRequest(
        method=recipe.method, strategy=recipe.sharding.strategy, cpu_offload=recipe.sharding.cpu_offload,
        seq_len=recipe.data.max_length, micro_batch_size=recipe.train.micro_batch_size,
        grad_accum_steps=recipe.train.grad_accum_steps, activation_checkpointing=recipe.train.activation_checkpointing,
        loss_chunk_tokens=recipe.train.loss_chunk_tokens, optimizer_in_backward=recipe.train.optimizer_in_backward,
        activation_offload=recipe.train.activation_offload,
        lora_r=recipe.lora.r, lora_dropout=recipe.lora.dropout, lora_dtype=recipe.lora.dtype,
        lora_targets=(targets,) if isinstance(targets, str) else tuple(targets),
        quant_bits=recipe.quant.bits, double_quant=recipe.quant.double_quant,
        quant_compute_dtype=recipe.quant.compute_dtype, optimizer=recipe.train.optimizer,
        dtype=recipe.model.dtype, reduce_dtype=recipe.sharding.reduce_dtype, headroom=recipe.planner.headroom,
        objective=recipe.objective,
    )


def default_request(**changes) -> PlanRequest:
    """The request of a recipe that sets nothing (config.py's defaults), with `changes` applied."""
    from homelab_ft.config import recipe_from_dict

    return dataclasses.replace(request_from_recipe(recipe_from_dict({})), **changes)


def plan_for_recipe(recipe, *, cluster: Cluster | None = None, cluster_file: str | None = None) -> Plan:
    """Read the model's config, describe the cluster (recipe, else detected), and plan.
    `cluster_file`: the `--cluster` file whose values the recipe's cluster section holds (named in the plan)."""
    from homelab_ft.locate import locate_config
    from homelab_ft.plan import hardware
    from homelab_ft.plan.shapes import model_shape

    config, source = locate_config(recipe.model.path)
    shape = model_shape(config)
    if cluster is None:
        cluster = hardware.resolve_cluster(recipe.cluster, detected=hardware.detect(), cluster_file=cluster_file)
    return plan(shape, request=request_from_recipe(recipe), cluster=cluster, model=recipe.model.path,
                config_source=source)


def _inter_link_name(c: Cluster) -> str:
    """A measured link is named by its rate alone; a nominal one is the Ethernet speed given."""
    return f"{c.inter_link_gbit:g} Gbit/s" + ("" if c.inter_link_measured else " Ethernet")


def link_text(c: Cluster, *, inter: bool) -> str:
    """The link the plan assumed: bandwidth a collective gets, latency of a tiny all-reduce, and
    whether each was measured (a cluster file from `doctor`) or assumed from the link kind."""
    if inter:
        name = _inter_link_name(c)
        bw_measured, latency_measured = c.inter_link_measured, c.inter_latency_s is not None
        bytes_per_s, hop_s = c.inter_bytes_per_s, c.inter_hop_s
    else:
        name = "gloo" if c.device == "cpu" else c.intra_link
        bw_measured, latency_measured = c.intra_link_gbit is not None, c.intra_latency_s is not None
        bytes_per_s, hop_s = c.intra_bytes_per_s, c.intra_hop_s
    if bw_measured == latency_measured:
        how = "measured" if bw_measured else "assumed"
    else:
        how = f"{'bandwidth' if bw_measured else 'latency'} measured, {'latency' if bw_measured else 'bandwidth'} assumed"
    return f"{name} ({bytes_per_s / 1e6:.0f} MB/s, {2 * hop_s * 1000:.2f} ms all-reduce latency, {how})"


def format_plan(p: Plan) -> str:
    """A readable table: one row per option, the chosen one marked with `>`."""
    s, c, r = p.shape, p.cluster, p.request
    params = f"{s.total_params / 1e9:.2f}B params" + (f" ({s.active_params / 1e9:.2f}B active)" if s.is_moe else "")
    device = (f"{c.gpus_per_node}x {_gib(c.device_bytes)} GiB GPU" if c.device == "cuda"
              else f"CPU, {c.gpus_per_node} process(es), {_gib(c.device_bytes)} GiB RAM each")
    links = ""
    if c.gpus_per_node > 1:
        links += f", {link_text(c, inter=False)} inside a node"
    if c.nodes > 1:
        links += f", {link_text(c, inter=True)} between nodes"
    lines = [
        f"model    {p.model} ({s.model_type}, {params}; config: {p.config_source})",
        f"cluster  {c.nodes} node(s) x {device}, host RAM {_gib(c.host_ram_bytes)} GiB/node{links} [{c.source}]",
        f"request  method={r.method} strategy={r.strategy} seq={r.seq_len} micro_batch={r.micro_batch_size} "
        f"accum={r.grad_accum_steps} act_ckpt={str(r.activation_checkpointing).lower()} loss_chunk={r.loss_chunk_tokens}"
        f" act_offload={str(r.activation_offload).lower()}" + (" optim_in_bwd" if r.optimizer_in_backward else "")
        + (f" lora_dtype={r.lora_dtype}" if r.lora_dtype != "float32" else "") + f" headroom={r.headroom:.0%}"
        + (f" objective=dpo ({r.rows_per_micro_batch} sequences per micro-batch)" if r.objective == "dpo" else ""),
        "",
        "  option                                weights  grads  optim  activ  logits  gather  total  budget  host   comm/step  comm s  step s  verdict",
    ]
    for o in p.options:
        m = o.memory
        mark = ">" if o is p.chosen else " "
        verdict = ("fits" if o.fits else "no") + ("" if o.allowed else " (not requested)")
        verdict += f" (paged optimizer: {_gib(o.spilled_bytes)} GiB in host RAM)" if o.spilled_bytes else ""
        lines.append(
            f"{mark} {o.label:37s} {_gib(m.weights):>7} {_gib(m.gradients):>6} {_gib(m.optimizer):>6} "
            f"{_gib(m.activations):>6} {_gib(m.logits):>7} {_gib(m.gathered):>7} {_gib(m.total - o.spilled_bytes):>6} "
            f"{_gib(o.budget_bytes):>7} {_gib(o.host_bytes):>5} {_gib(o.comm_bytes):>8}Gi {o.comm_s:>7.2f} {o.step_s:>7.2f}  {verdict}"
        )
    lines.append("  (GiB per device; host: GiB on node 0; comm s: seconds of collectives per step; "
                 "step s: compute + the communication it does not hide + offload)")
    lines.append("")
    if p.chosen is not None:
        lines.append(f"chosen   {p.chosen.reason}")
        lines.append(f"disk     {_gib(p.checkpoint_bytes)} GiB per checkpoint (trainable weights + optimizer state)")
    else:
        lines.append(f"nothing fits; closest: {p.closest.reason}" if p.closest else "nothing fits")
        lines += [f"  would fit: {text}" for text in p.suggestions]
    rejected = [o for o in p.options if o.allowed and not o.fits]
    if p.chosen is not None and rejected:
        lines.append("rejected " + rejected[0].reason)
        lines += [f"         {o.reason}" for o in rejected[1:]]
    if p.chosen is not None and p.chosen.prepass_s_per_pair:
        lines.append(f"dpo      the reference is scored once before step 1: ~{p.chosen.prepass_s_per_pair * 1000:.1f} s "
                     "per 1000 pairs (cached beside the tokenised data)")
    lines += [f"warning  {w}" for w in p.warnings]
    return "\n".join(lines)
