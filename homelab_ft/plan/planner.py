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
import math
from dataclasses import dataclass

from homelab_ft.errors import UserError
from homelab_ft.plan import afford
from homelab_ft.plan.inputs import Cluster, PlanRequest, RowImages, RowLengths
from homelab_ft.plan.ladder import (
    LADDER,
    STEP_TIME_TIE,
    Option,
    Refusal,
    choose,
    evaluate,
    offers,
    price,
    with_table,
)
from homelab_ft.plan.price.diskspace import checkpoint_bytes
from homelab_ft.plan.price.images import REFERENCE_SIDE
from homelab_ft.plan.price.memory import gib_text
from homelab_ft.plan.shape.shapes import ModelShape
from homelab_ft.rules import embedding_offload, moe_routers
from homelab_ft.rules.image_area import bounded_size
from homelab_ft.rung import (
    Rung,
    RungError,
    hybrid_refusal,
    requested_rollout,
    requested_rung,
    requested_staleness,
    rung_for,
)


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
    refused: tuple[Refusal, ...] = ()
    """Options the ladder did not offer, each with the trainer's reason (refusals.py, rung._validate)."""

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
        grpo = self.request.objective == "grpo"

        def option(o: Option | None):
            if o is None:
                return None
            data = dataclasses.asdict(o)
            data["memory"]["total"] = o.memory.total
            data["step_s"] = o.step_s
            if grpo:
                data["memory"].update(training_peak=o.memory.training_peak, generation_peak=o.memory.generation_peak)
                data["rollout"]["seconds"] = o.rollout.seconds
                data["training_s"] = o.training_s
            else:
                _drop(data, "rollout", "memory.generation")
            return data

        request, cluster = dataclasses.asdict(self.request), dataclasses.asdict(self.cluster)
        if not grpo:
            _drop(request, "grpo")
            _drop(cluster, "memory_bytes_per_s")
        if self.request.objective != "dpo":
            _drop(request, "dpo")

        return {
            "model": self.model,
            "config_source": self.config_source,
            "model_type": self.shape.model_type,
            "facts": self.shape.facts.to_dict(),
            "total_params": self.shape.total_params,
            "active_params": self.shape.active_params,
            "cluster": cluster,
            "request": request,
            "fits": self.fits,
            "chosen": option(self.chosen),
            "checkpoint_bytes": self.checkpoint_bytes,
            "closest": option(self.closest),
            "suggestions": list(self.suggestions),
            "afford": [_afford_dict(a, grpo=grpo) for a in self.affordable],
            "warnings": list(self.warnings),
            "options": [option(o) for o in self.options],
            "refused": [dataclasses.asdict(r) for r in self.refused],
        }

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2)


def _afford_dict(a: afford.Afford, *, grpo: bool) -> dict:
    """An Afford as plan --json writes it: its GRPO limits only in a GRPO plan."""
    data = dataclasses.asdict(a)
    if not grpo:
        _drop(data, "num_generations", "completion_len")
    return data


def _drop(data: dict, *dotted: str) -> None:
    """Take out what only GRPO's pricing reads (the grpo section, the rollout, the memory bandwidth),
    so an SFT or DPO plan's JSON reads as it did before GRPO was priced (issue 33)."""
    for key in dotted:
        *parents, leaf = key.split(".")
        inner = data
        for parent in parents:
            inner = inner[parent]
        del inner[leaf]


# --------------------------------------------------------------------------------------------
# the plan


def plan(shape: ModelShape, *, request: PlanRequest, cluster: Cluster, model: str = "", config_source: str = "") -> Plan:
    """Evaluate every option, pick one by the ladder, explain the rest."""
    validate(shape, request=request, cluster=cluster)
    check_router_request(shape, request=request, model=f"{model} ({shape.model_type}, {config_source or 'its config'})")
    options, refused = offers(shape, request=request, cluster=cluster)
    _refuse_named_pipeline(options, refused, request=request)
    _refuse_named_method(options, refused, request=request)
    chosen = choose(options, request=request)
    closest, suggestions = None, ()
    if chosen is None:
        allowed = [o for o in options if o.allowed] or list(options)
        closest = min(allowed, key=_pressure)
        suggestions = what_would_fit(shape, request=request, cluster=cluster, closest=closest)
    return Plan(model=model, config_source=config_source, shape=shape, cluster=cluster, request=request, options=options, chosen=chosen,
                closest=closest, suggestions=suggestions, warnings=_warnings(shape, chosen, request, cluster, options),
                refused=refused)


def _refuse_named_pipeline(options: tuple[Option, ...], refused: tuple[Refusal, ...], *, request: PlanRequest) -> None:
    """A pipeline the recipe names (sharding.pipeline_stages > 1) that the trainer refuses for every
    method it allows is the recipe's mistake: refused here with the trainer's reason, before anything
    is priced further, created or launched (with `auto` the ladder just does not offer it)."""
    stages = request.sharding.pipeline_stages
    if not isinstance(stages, int) or stages == 1 or any(o.allowed for o in options):
        return
    methods = LADDER if request.method == "auto" else (request.method,)
    named = [r for r in refused if r.label in {f"{m} pipeline {stages} stages" for m in methods}]
    if named:
        raise RungError(named[0].reason)


def _refuse_named_method(options: tuple[Option, ...], refused: tuple[Refusal, ...], *, request: PlanRequest) -> None:
    """A method the recipe names whose every option the trainer refuses (a full fine-tune of GRPO with
    grpo.beta > 0) is refused with the trainer's reason, as a named pipeline is; so is `auto` when
    the trainer refuses every option (KTO's step of fewer than 4 rows, whatever the method)."""
    if request.method == "auto" and not options and refused:
        raise RungError(refused[0].reason)
    if request.method == "auto" or any(o.method == request.method for o in options):
        return
    named = [r for r in refused if r.label.split(" ")[0] == request.method]
    if named:
        raise RungError(named[0].reason)


def validate(shape: ModelShape, *, request: PlanRequest, cluster: Cluster) -> None:
    if request.completion_tokens and request.sequence_tokens > shape.max_position_embeddings:
        raise UserError(
            f"data.max_length={request.data.max_length} + grpo.max_completion_length={request.completion_tokens} "
            f"is beyond the model's max_position_embeddings={shape.max_position_embeddings}; lower either")
    if request.data.max_length > shape.max_position_embeddings:
        raise UserError(
            f"data.max_length={request.data.max_length} is beyond the model's max_position_embeddings="
            f"{shape.max_position_embeddings}; lower data.max_length"
        )
    if request.method != "auto" and request.sharding.strategy != "auto":
        # A fully named rung is refused here, before anything is priced, created or launched.
        requested_rung(request.method, nodes=cluster.nodes, procs_per_node=cluster.gpus_per_node,
                       train=request.train, quant=request.quant, sharding=request.sharding, data=request.data,
                       rollout=requested_rollout(request.objective, request.grpo),
                       staleness=requested_staleness(request.objective, request.grpo))
    elif why := hybrid_refusal(request.sharding.strategy, nodes=cluster.nodes):
        raise RungError(why)
    if request.train.embedding_offload is True:
        targeted = embedding_offload.targets_embedding(request.lora.targets, embedding_name=shape.embedding_name)
        why = embedding_offload.model_refusal(tied=shape.tie_word_embeddings, targeted=targeted, device_type=cluster.device)
        if why is not None:
            raise embedding_offload.error(why)


def check_router_request(shape: ModelShape, *, request: PlanRequest, model: str) -> None:
    """lora.train_router refused before anything is priced or written on a model without routers (a
    pipeline, which does not train them, is refusals.trained_router: the ladder does not offer it)."""
    if request.lora.train_router and not any(b.router_params for b in shape.blocks):
        raise moe_routers.refuse_dense(model)


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

    def change(text: str, **sections) -> None:
        """Try `text`, the recipe keys changed as `sections`; a change the recipe would refuse is no advice."""
        try:
            tries.append((text, r.changed(**sections), c))
        except ValueError:  # pydantic's ValidationError: e.g. grad_accum_steps > 1 with optimizer_in_backward
            pass

    # The cheap savers first: they cost a little compute, never a rung or a GPU.
    if r.train.loss_chunk_tokens == 0:
        change("train.loss_chunk_tokens=auto", train={"loss_chunk_tokens": "auto"})
    if not r.train.activation_checkpointing:
        change("train.activation_checkpointing=true", train={"activation_checkpointing": True})
    if c.device == "cuda" and not r.train.activation_offload:
        change("train.activation_checkpointing=true train.activation_offload=true",
               train={"activation_checkpointing": True, "activation_offload": True})
    if r.method == "full" and not r.train.optimizer_in_backward and r.train.grad_accum_steps == 1:
        change("train.optimizer_in_backward=true train.max_grad_norm=0",
               train={"optimizer_in_backward": True, "max_grad_norm": 0.0})
    if r.train.micro_batch_size > 1:
        accum = r.train.grad_accum_steps * r.train.micro_batch_size
        change(f"train.micro_batch_size=1 train.grad_accum_steps={accum} (same batch)",
               train={"micro_batch_size": 1, "grad_accum_steps": accum})
    if r.objective == "grpo":  # fewer or shorter rollouts: a smaller KV cache and fewer training rows
        if r.grpo.num_generations >= 4:
            change(f"grpo.num_generations={r.grpo.num_generations // 2}", grpo={"num_generations": r.grpo.num_generations // 2})
        if r.grpo.max_completion_length >= 256:
            change(f"grpo.max_completion_length={r.grpo.max_completion_length // 2}",
                   grpo={"max_completion_length": r.grpo.max_completion_length // 2})
    seq = r.data.max_length // 2
    while seq >= 128:
        change(f"data.max_length={seq}", data={"max_length": seq})
        seq //= 2
    if c.device == "cuda" and not r.sharding.cpu_offload:
        change("sharding.strategy=auto sharding.cpu_offload=true", sharding={"strategy": "auto", "cpu_offload": True})
    if r.method in ("lora", "full"):
        lighter = "qlora" if r.method == "lora" else "lora"
        change(f"method={lighter}", method=lighter)
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
    device_need = closest.memory.total / (1 - request.planner.headroom)
    if closest.host_budget_bytes and closest.host_bytes > closest.host_budget_bytes:
        found.append(f"host RAM >= {gib_text(closest.host_bytes / (1 - request.planner.headroom))} GiB per node"
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
    if chosen.rung.fsdp_enabled and request.train.grad_accum_steps > 1 and not request.train.optimizer_in_backward:
        micro, accum = request.train.micro_batch_size * 2, request.train.grad_accum_steps // 2
        larger = request.changed(train={"micro_batch_size": micro, "grad_accum_steps": accum})
        est, fits, _ = price(shape, rung=chosen.rung, request=larger, cluster=cluster)
        if fits and est.step_s < chosen.step_s * (1 - STEP_TIME_TIE) * micro * accum / (
                request.train.micro_batch_size * request.train.grad_accum_steps):
            found.append(f"a larger micro-batch, train.micro_batch_size={micro} train.grad_accum_steps={accum} "
                         f"(same batch) {est.step_s:.1f} s/step")
    return found


def _asking_for(o: Option, request: PlanRequest) -> str:
    """The recipe keys that would let the ladder take option `o`."""
    keys = []
    if request.method not in ("auto", o.method):
        keys.append(f"method={o.method}")
    if o.rung.pipeline_enabled and request.sharding.pipeline_stages not in ("auto", o.rung.pipeline_stages):
        keys.append("sharding.pipeline_stages=auto")
    if request.sharding.strategy not in ("auto", o.strategy) or (o.rung.pipeline_enabled and request.sharding.strategy != "auto"):
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
    if shape.is_moe and chosen.rung.adapters_enabled and "all-linear" not in request.lora.targets:
        out.append("MoE: lora.target_modules lists linear layers only, so no routed expert trains "
                   "(all-linear adapts every expert too; the `lora` line says what trains)")
    if request.train.optimizer == "paged_adamw_8bit" and cluster.device == "cpu":
        out.append("train.optimizer=paged_adamw_8bit pages to host RAM only on CUDA; on the CPU it runs as adamw_8bit")
    return tuple(out)


# --------------------------------------------------------------------------------------------
# from a recipe


def request_from_recipe(recipe, *, lengths: RowLengths | None = None, images: RowImages | None = None) -> PlanRequest:
    """The planner's view of a `config.Recipe`: its own sections, as they are, the measured lengths of
    its prepared rows when the caller has them (data/lengths.py), and an image-text model's images."""
    return PlanRequest(method=recipe.method, objective=recipe.objective, model=recipe.model, lora=recipe.lora,
                       quant=recipe.quant, data=recipe.data, train=recipe.train, sharding=recipe.sharding,
                       planner=recipe.planner, grpo=recipe.grpo, dpo=recipe.dpo, lengths=lengths, images=images)


def default_request(**sections) -> PlanRequest:
    """The request of a recipe that sets nothing but `sections` (config.py's defaults otherwise), as a
    recipe's YAML spells them: `default_request(method="lora", data={"max_length": 512})`."""
    from homelab_ft.recipe.config import recipe_from_dict

    return request_from_recipe(recipe_from_dict(sections))


def plan_for_recipe(recipe, *, cluster: Cluster | None = None, cluster_file: str | None = None,
                    lengths: RowLengths | None = None, image_counts: tuple[tuple[int, int, int], ...] = ()) -> Plan:
    """Read the model's config, describe the cluster (recipe, else detected), and plan.
    `cluster_file`: the `--cluster` file whose values the recipe's cluster section holds (named in the plan);
    `lengths`: the prepared rows' measured lengths (data.lengths.stored), what step time is priced at;
    `image_counts`: an image-text model's prepared rows as (images in a row, image tokens in it, rows)."""
    from homelab_ft.plan import hardware

    shape, source = recipe_shape(recipe)
    images = recipe_images(recipe, shape, counts=image_counts)
    if cluster is None:
        # one core's matmul rate, measured once per machine, for a plan that may be a CPU one and names none
        cpu_speed = recipe.cluster.device != "cuda" and recipe.cluster.cpu_gflops_per_core is None
        cluster = hardware.resolve_cluster(recipe.cluster, detected=hardware.detect(cpu_speed=cpu_speed),
                                           cluster_file=cluster_file, num_threads=recipe.train.num_threads)
    return plan(shape, request=request_from_recipe(recipe, lengths=lengths, images=images), cluster=cluster, model=recipe.model.path,
                config_source=source)


def named_rung(recipe, plan: Plan) -> Rung:
    """The rung a recipe's own choices name (`rung_for`), with what only the model and device decide
    decided as the ladder decides it for the rungs it prices (the input embeddings on the host:
    embedding_offload.placed): what `train` runs where the planner chose nothing for a named method,
    and what a test or benchmark builds a model for outside `train`. Raises RungError for a refused one."""
    return with_table(rung_for(recipe), request=plan.request, shape=plan.shape, cluster=plan.cluster)


def recipe_images(recipe, shape: ModelShape, *, counts: tuple[tuple[int, int, int], ...] = ()) -> RowImages | None:
    """An image run's images as the planner prices them (inputs.RowImages): the tokens one image
    becomes at the largest area the recipe allows (rules/image_area.py: a square of
    data.image_max_pixels, its processor given the recipe's bounds as the data side gives them),
    else at a reference photo (images.REFERENCE_SIDE), counted by the model's own vision side
    (cached), and the rows' measured `counts`. None for a text run (data.images: false: the tower, if
    the class loads one, sees no image), a text model, or a vision side that could not be measured
    (its weights alone are priced, and a warning says so)."""
    from homelab_ft.locate import locate_config
    from homelab_ft.plan.shape.cache import cached_image_tokens

    if not recipe.data.images or shape.vision is None or shape.vision.unmeasured:
        return None
    bound, least = recipe.data.image_max_pixels, recipe.data.image_min_pixels
    side = math.isqrt(bound) if bound else REFERENCE_SIDE
    size = bounded_size(side, side, max_pixels=bound, min_pixels=least)
    config, _ = locate_config(recipe.model.path)
    (tokens,) = cached_image_tokens(config, sizes=(size,), model_path=recipe.model.path,
                                    trust_remote_code=recipe.model.trust_remote_code, max_pixels=bound, min_pixels=least)
    return RowImages(tokens_per_image=tokens, size=size, bounded=bound is not None,
                     counts=tuple(sorted(counts, key=lambda c: (c[1], c[0]))))


def recipe_shape(recipe) -> tuple[ModelShape, str]:
    """The shape of the model the recipe's run builds (cached, else derived: an image run's is its
    image-text class, rules/vision.auto_class) and where its config was read from."""
    from homelab_ft.locate import locate_config
    from homelab_ft.plan.shape.shapes import model_shape

    config, source = locate_config(recipe.model.path)
    return model_shape(config, attn_implementation=recipe.model.attn_implementation, model_path=recipe.model.path,
                       trust_remote_code=recipe.model.trust_remote_code, images=recipe.data.images), source
