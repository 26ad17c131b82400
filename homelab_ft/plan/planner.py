"""The plan: the ladder's choice for a recipe on a cluster, with the advice around it. Pure and
torch-free, except that `plan_for_recipe` reads the model's config.json and, when the recipe leaves
the cluster to detection, probes this machine (hardware.detect).

`plan()` checks the request against the model, evaluates every option on the ladder (ladder.py,
each priced by memory.estimate) and takes the one `ladder.choose` picks. When nothing fits, the
plan keeps the closest option and what would make something fit, each change tried on the ladder
with its numbers; the CLI prints that (report.format_plan) and exits 2. The warnings are the
shape's notes and what the chosen option pays for: communication that outweighs compute, CPU
offload's copies, MoE experts that LoRA leaves untrained, paged AdamW without CUDA.
"""

from __future__ import annotations

import dataclasses
import functools
import json
from dataclasses import dataclass

from homelab_ft import embedding_offload, moe_routers
from homelab_ft.errors import UserError
from homelab_ft.plan import afford
from homelab_ft.plan.diskspace import checkpoint_bytes
from homelab_ft.plan.inputs import Cluster, PlanRequest
from homelab_ft.plan.ladder import STEP_TIME_TIE, Option, choose, evaluate, price
from homelab_ft.plan.memory import gib_text
from homelab_ft.plan.shapes import ModelShape
from homelab_ft.rung import HYBRID_SHARD, RungError, requested_rung


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

    @functools.cached_property
    def affordable(self) -> tuple[afford.Afford, ...]:
        """How far the batch and the sequence can grow: for the chosen option and the ladder's next
        rung (afford.py); empty when nothing fits (the suggestions say what would)."""
        if self.chosen is None:
            return ()
        found = [afford.for_option(self.shape, self.chosen, request=self.request, cluster=self.cluster)]
        heavier = afford.next_rung(self.chosen.method)
        if heavier is not None:
            found.append(afford.for_rung(self.shape, heavier, request=self.request, cluster=self.cluster))
        return tuple(found)

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
            "facts": self.shape.facts.to_dict(),
            "total_params": self.shape.total_params,
            "active_params": self.shape.active_params,
            "cluster": dataclasses.asdict(self.cluster),
            "request": dataclasses.asdict(self.request),
            "fits": self.fits,
            "chosen": option(self.chosen),
            "checkpoint_bytes": self.checkpoint_bytes,
            "closest": option(self.closest),
            "suggestions": list(self.suggestions),
            "afford": [dataclasses.asdict(a) for a in self.affordable],
            "warnings": list(self.warnings),
            "options": [option(o) for o in self.options],
        }

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2)


# --------------------------------------------------------------------------------------------
# the plan


def plan(shape: ModelShape, *, request: PlanRequest, cluster: Cluster, model: str = "", config_source: str = "") -> Plan:
    """Evaluate every option, pick one by the ladder, explain the rest."""
    validate(shape, request=request, cluster=cluster)
    check_router_request(shape, request=request, model=f"{model} ({shape.model_type}, {config_source or 'its config'})")
    options = evaluate(shape, request=request, cluster=cluster)
    chosen = choose(options, request=request)
    closest, suggestions = None, ()
    if chosen is None:
        allowed = [o for o in options if o.allowed] or list(options)
        closest = min(allowed, key=_pressure)
        suggestions = what_would_fit(shape, request=request, cluster=cluster, closest=closest)
    return Plan(model=model, config_source=config_source, shape=shape, cluster=cluster, request=request, options=options, chosen=chosen,
                closest=closest, suggestions=suggestions, warnings=_warnings(shape, chosen, request, cluster, options))


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
    if request.embedding_offload is True:
        targeted = embedding_offload.targets_embedding(request.lora_targets, embedding_name=shape.embedding_name)
        why = embedding_offload.model_refusal(tied=shape.tie_word_embeddings, targeted=targeted, device_type=cluster.device)
        if why is not None:
            raise embedding_offload.error(why)


def check_router_request(shape: ModelShape, *, request: PlanRequest, model: str) -> None:
    """lora.train_router refused before anything is priced or written: on a model without routers, and
    on a named pipeline (moe_routers.check_rung, which the ladder applies per option)."""
    if not request.train_router:
        return
    if not any(b.router_params for b in shape.blocks):
        raise moe_routers.refuse_dense(model)
    if request.method in ("lora", "qlora"):
        stages = request.pipeline_stages if isinstance(request.pipeline_stages, int) else 1
        moe_routers.check_rung(True, stages=stages)


def _pressure(option: Option) -> float:
    """How far over its limits an option is: the worse of device memory and (on GPUs) host RAM."""
    device = option.memory.total / max(1, option.budget_bytes)
    host = option.host_bytes / max(1, option.host_budget_bytes) if option.host_budget_bytes else 0.0
    return max(device, host)


# --------------------------------------------------------------------------------------------
# when nothing fits, and warnings


def what_would_fit(shape: ModelShape, *, request: PlanRequest, cluster: Cluster, closest: Option) -> tuple[str, ...]:
    """Changes, one at a time, that make an allowed option fit, each with the option it gives."""
    r, c = request, cluster
    tries: list[tuple[str, PlanRequest, Cluster]] = []
    # The cheap savers first: they cost a little compute, never a rung or a GPU.
    if r.loss_chunk_tokens == 0:
        tries.append(("train.loss_chunk_tokens=auto", dataclasses.replace(r, loss_chunk_tokens="auto"), c))
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
            tries.append((f"--gpus {more}x{gib_text(c.device_bytes)}GB", r, dataclasses.replace(c, gpus_per_node=more)))
    if c.device == "cuda":
        tries.append((f"--nodes {c.nodes * 2}", r, dataclasses.replace(c, nodes=c.nodes * 2)))

    found: list[str] = []
    shorter_found = False
    for text, req, clu in tries:
        if shorter_found and text.startswith("data.max_length"):
            continue  # the longest sequence that fits is the useful one
        option = choose(evaluate(shape, request=req, cluster=clu), request=req)
        if option is not None:
            found.append(f"{text}: {option.label} fits ({gib_text(option.memory.total)} of {gib_text(option.budget_bytes)} GiB)")
            shorter_found = shorter_found or text.startswith("data.max_length")
        if len(found) >= 4:
            break
    device_need = closest.memory.total / (1 - request.headroom)
    if closest.host_budget_bytes and closest.host_bytes > closest.host_budget_bytes:
        found.append(f"host RAM >= {gib_text(closest.host_bytes / (1 - request.headroom))} GiB per node"
                     + (f" and GPUs with >= {gib_text(device_need)} GiB" if closest.memory.total > closest.budget_bytes else "")
                     + f": {closest.label} would fit")
    else:
        what = "GPUs" if cluster.device == "cuda" else "host RAM per process"
        found.append(f"{what} with >= {gib_text(device_need)} GiB: {closest.label} would fit")
    return tuple(dict.fromkeys(found))


NEAR_MISS = 0.1
"""A pipeline over its budget by no more than this fraction is named in the advice with what it lacks:
the recipe knobs that free a GiB or two (8-bit AdamW, bf16 adapters, less headroom) can close that."""


def shorter_steps(shape: ModelShape, chosen: Option, *, options: tuple[Option, ...], request: PlanRequest,
                  cluster: Cluster) -> list[str]:
    """What would shorten a communication-bound step, each with the seconds it plans, checked on the
    ladder rather than assumed: a pipeline (only activations cross the boundaries), adapter-only data
    parallelism (no_shard: only the adapter gradients are all-reduced, once per step), HYBRID_SHARD
    (only with several GPUs per node, whose weight traffic it keeps inside the node), and a larger
    micro-batch for the same batch under FSDP (its all-gathers repeat every micro-batch). More
    grad_accum_steps is never among them: it adds those all-gathers and makes the step longer.
    Times compare per replica's batch (Option.batch_s): a pipeline's step carries fewer replicas."""
    better = [o for o in options if o.fits and o.batch_s < chosen.batch_s * (1 - STEP_TIME_TIE) and o is not chosen]

    def named(o: Option) -> str:
        return f"{o.label} {o.step_s:.1f} s/step" + ("" if o.allowed else f" (not requested: {_asking_for(o, request)})")

    def best(group: list[Option]) -> Option:
        """The fastest of `group`, the chosen method's first (the recipe may have named it)."""
        return min(group, key=lambda o: (o.method != chosen.method, o.batch_s))

    found = []
    pipelines = [o for o in better if o.rung.pipeline_enabled]
    near = [o for o in options if o.rung.pipeline_enabled and not o.fits and o.batch_s < chosen.batch_s
            and o.memory.total <= o.budget_bytes * (1 + NEAR_MISS)]
    if pipelines:
        found.append("a pipeline, " + named(best(pipelines)))
    elif near:
        o = best(near)
        knobs = "train.optimizer=adamw_8bit" + (", lora.dtype=compute" if o.rung.adapters_enabled else "")
        found.append(f"a pipeline, {named(o)}, if it had {gib_text(o.memory.total - o.budget_bytes)} GiB more per GPU "
                     f"({gib_text(o.memory.total)} of {gib_text(o.budget_bytes)}: {knobs} or a lower planner.headroom "
                     "free that much)")
    adapters_dp = [o for o in better if o.rung.adapters_enabled and o.rung.ddp_enabled and not o.rung.pipeline_enabled]
    if adapters_dp and chosen.rung.fsdp_enabled:
        found.append("adapter-only data parallelism, " + named(best(adapters_dp)))
    hybrid = [o for o in better if o.rung.hybrid_enabled]
    if hybrid and not chosen.rung.hybrid_enabled:
        found.append("hybrid_shard, " + named(best(hybrid)))
    if chosen.rung.fsdp_enabled and request.grad_accum_steps > 1 and not request.optimizer_in_backward:
        micro, accum = request.micro_batch_size * 2, request.grad_accum_steps // 2
        larger = dataclasses.replace(request, micro_batch_size=micro, grad_accum_steps=accum)
        est, fits, _ = price(shape, rung=chosen.rung, request=larger, cluster=cluster)
        if fits and est.step_s < chosen.step_s * (1 - STEP_TIME_TIE) * micro * accum / (
                request.micro_batch_size * request.grad_accum_steps):
            found.append(f"a larger micro-batch, train.micro_batch_size={micro} train.grad_accum_steps={accum} "
                         f"(same batch) {est.step_s:.1f} s/step")
    return found


def _asking_for(o: Option, request: PlanRequest) -> str:
    """The recipe keys that would let the ladder take option `o`."""
    keys = []
    if request.method not in ("auto", o.method):
        keys.append(f"method={o.method}")
    if o.rung.pipeline_enabled and request.pipeline_stages not in ("auto", o.rung.pipeline_stages):
        keys.append("sharding.pipeline_stages=auto")
    if request.strategy not in ("auto", o.strategy) or (o.rung.pipeline_enabled and request.strategy != "auto"):
        keys.append("sharding.strategy=auto")
    return " ".join(keys) or "the recipe's other settings"


def _warnings(shape: ModelShape, chosen: Option | None, request: PlanRequest, cluster: Cluster,
              options: tuple[Option, ...] = ()) -> tuple[str, ...]:
    out = list(shape.notes)
    if chosen is None:
        return tuple(out)
    if chosen.comm_s > chosen.compute_s and chosen.comm_s > 0:
        link = (cluster.inter_link_name if cluster.nodes > 1
                else cluster.intra_link if cluster.device == "cuda" else "gloo")
        shorter = shorter_steps(shape, chosen, options=options, request=request, cluster=cluster)
        advice = ("what shortens it: " + "; ".join(shorter) if shorter
                  else "nothing on this cluster moves less; a faster link shortens it")
        out.append(f"communication dominates: {chosen.comm_s:.1f} s/step ({gib_text(chosen.comm_bytes)} GiB per rank over "
                   f"{link}) vs {chosen.compute_s:.1f} s/step of compute; {advice}")
    if chosen.cpu_offload:
        out.append(f"CPU offload adds ~{chosen.offload_s:.1f} s/step (PCIe copies of the shards, AdamW on the CPU)")
    if shape.is_moe and chosen.method != "full" and "all-linear" not in request.lora_targets:
        out.append("MoE: lora.target_modules lists linear layers only, so no routed expert trains "
                   "(all-linear adapts every expert too; the `lora` line says what trains)")
    if request.optimizer == "paged_adamw_8bit" and cluster.device == "cpu":
        out.append("train.optimizer=paged_adamw_8bit pages to host RAM only on CUDA; on the CPU it runs as adamw_8bit")
    return tuple(out)


# --------------------------------------------------------------------------------------------
# from a recipe


def request_from_recipe(recipe) -> PlanRequest:
    """The planner's view of a `config.Recipe`."""
    targets = recipe.lora.target_modules
    return PlanRequest(
        method=recipe.method, strategy=recipe.sharding.strategy, cpu_offload=recipe.sharding.cpu_offload,
        seq_len=recipe.data.max_length, micro_batch_size=recipe.train.micro_batch_size,
        grad_accum_steps=recipe.train.grad_accum_steps, activation_checkpointing=recipe.train.activation_checkpointing,
        loss_chunk_tokens=recipe.train.loss_chunk_tokens, optimizer_in_backward=recipe.train.optimizer_in_backward,
        activation_offload=recipe.train.activation_offload, embedding_offload=recipe.train.embedding_offload,
        lora_r=recipe.lora.r, lora_dropout=recipe.lora.dropout, lora_dtype=recipe.lora.dtype,
        lora_targets=(targets,) if isinstance(targets, str) else tuple(targets), train_router=recipe.lora.train_router,
        quant_bits=recipe.quant.bits, double_quant=recipe.quant.double_quant,
        quant_compute_dtype=recipe.quant.compute_dtype, optimizer=recipe.train.optimizer,
        dtype=recipe.model.dtype, reduce_dtype=recipe.sharding.reduce_dtype, headroom=recipe.planner.headroom,
        objective=recipe.objective, pipeline_stages=recipe.sharding.pipeline_stages,
        stage_blocks=tuple(recipe.sharding.stage_blocks or ()), pipeline_schedule=recipe.sharding.pipeline_schedule,
    )


def default_request(**changes) -> PlanRequest:
    """The request of a recipe that sets nothing (config.py's defaults), with `changes` applied."""
    from homelab_ft.config import recipe_from_dict

    return dataclasses.replace(request_from_recipe(recipe_from_dict({})), **changes)


def plan_for_recipe(recipe, *, cluster: Cluster | None = None, cluster_file: str | None = None) -> Plan:
    """Read the model's config, describe the cluster (recipe, else detected), and plan.
    `cluster_file`: the `--cluster` file whose values the recipe's cluster section holds (named in the plan)."""
    from homelab_ft.plan import hardware

    shape, source = recipe_shape(recipe)
    if cluster is None:
        cluster = hardware.resolve_cluster(recipe.cluster, detected=hardware.detect(), cluster_file=cluster_file)
    return plan(shape, request=request_from_recipe(recipe), cluster=cluster, model=recipe.model.path,
                config_source=source)


def recipe_shape(recipe) -> tuple[ModelShape, str]:
    """The shape of the recipe's model (cached, else derived) and where its config was read from."""
    from homelab_ft.locate import locate_config
    from homelab_ft.plan.shapes import model_shape

    config, source = locate_config(recipe.model.path)
    return model_shape(config, attn_implementation=recipe.model.attn_implementation, model_path=recipe.model.path,
                       trust_remote_code=recipe.model.trust_remote_code), source
