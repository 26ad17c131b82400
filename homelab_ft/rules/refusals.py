"""What the trainer refuses to run: one function per rule, for the planner and the trainer alike.

A rule reads the rung (what runs) and the one recipe setting or model fact it is about, and returns
None or the one line that names the recipe key and the fix. `refusals` asks them all, of a
`config.Recipe` or of the planner's `PlanRequest` (which holds the same sections under the same
names: `objective`, `lora`, `data`, `train`), with the model's facts (its decoder blocks, whether it
has fused MoE experts). The ladder
(plan/ladder.py) asks every rule of every option it would price, so an option the trainer would
refuse is never offered and `plan` says why it was not; preflight (train/preflight.py) and the
builder ask the same rules of the rung they were handed, before anything is created. What needs
torch to answer (does this torch have the schedule class, does a decoder return tuples) stays in
distributed/stages.py, beside what it checks. Pure and torch-free.

The rung's own validity (a strategy with one process, a bitsandbytes optimizer under FSDP2, ...)
is `rung._validate`: a `Rung` that constructs is one the rules below may refuse only in the
context of the recipe and the model.
"""

from __future__ import annotations

from homelab_ft.recipe.objectives import KTO_MIN_STEP_ROWS
from homelab_ft.rules import embedding_offload, moe_routers
from homelab_ft.rung import Rung, RungError

STAGES_KEY = "sharding.pipeline_stages"


def _not_pipelined(rung: Rung, what: str, fix: str) -> str:
    return f"{STAGES_KEY}={rung.pipeline_stages}: {what} is not run pipelined yet; set {fix}, or {STAGES_KEY}=1"


def micro_batches(rung: Rung, *, grad_accum_steps: int) -> str | None:
    """A schedule feeds each stage one micro-batch at a time: fewer micro-batches than stages leave
    a stage idle the whole step (and torch's schedules refuse it)."""
    if rung.pipeline_enabled and grad_accum_steps < rung.pipeline_stages:
        return (f"{STAGES_KEY}={rung.pipeline_stages} needs at least as many micro-batches per step: "
                f"train.grad_accum_steps={grad_accum_steps} would leave stages idle the whole step; set "
                f"train.grad_accum_steps >= {rung.pipeline_stages} (4 x stages keeps the bubble small)")
    return None


def blocks(rung: Rung, *, num_blocks: int) -> str | None:
    """Every stage holds at least one decoder block, and a given split covers the model."""
    if not rung.pipeline_enabled:
        return None
    if num_blocks < rung.pipeline_stages:
        return (f"{STAGES_KEY}={rung.pipeline_stages}, but the model has {num_blocks} decoder block(s); every "
                f"stage needs one: set {STAGES_KEY} <= {num_blocks}")
    if rung.stage_blocks and sum(rung.stage_blocks) != num_blocks:
        return (f"sharding.stage_blocks={list(rung.stage_blocks)} covers {sum(rung.stage_blocks)} decoder "
                f"blocks, but the model has {num_blocks}; make them sum to {num_blocks}, or drop stage_blocks")
    return None


def activation_offload(rung: Rung) -> str | None:
    """The pipelined step (trainer.pipeline_step) checkpoints a stage's blocks but runs no
    activation offload: offload.activations_on_host wraps only the unpipelined micro-batch loop."""
    if rung.pipeline_enabled and rung.activation_offload:
        return _not_pipelined(rung, "train.activation_offload", "train.activation_offload=false")
    return None


def objective(rung: Rung, *, objective: str) -> str | None:
    """The pipelined step is the SFT loss on the last stage; DPO's pairs and reference are not, nor
    GRPO's generation (which needs the whole model on one process)."""
    if rung.pipeline_enabled and objective in ("dpo", "grpo"):
        return _not_pipelined(rung, f"objective={objective}", "objective: sft")
    return None


def grpo_reference(rung: Rung, *, objective: str, beta: float) -> str | None:
    """GRPO's KL term scores each completion under the reference: an adapter rung's is the same model
    with its adapters disabled; a full fine-tune would need a second copy, which the trainer does not
    build."""
    if objective == "grpo" and beta > 0 and not rung.adapters_enabled:
        return ("objective=grpo with grpo.beta > 0 needs a reference model, which a full fine-tune would hold as a "
                "second copy; use method: lora or qlora, or grpo.beta=0")
    return None


def kto_batch(rung: Rung, *, objective: str, loss: str, micro_batch_size: int, grad_accum_steps: int) -> str | None:
    """KTO's reference point is a mean over the step's rows on all ranks (train/preference.py): a step
    of micro_batch_size x grad_accum_steps x data-parallel replicas rows below KTO_MIN_STEP_ROWS
    leaves that estimate one to three numbers."""
    rows = micro_batch_size * grad_accum_steps * rung.data_parallel_size
    if objective == "dpo" and loss == "kto" and rows < KTO_MIN_STEP_ROWS:
        return (f"dpo.loss=kto estimates its KL reference point over each step's rows, and a step holds {rows} "
                f"(train.micro_batch_size={micro_batch_size} x train.grad_accum_steps={grad_accum_steps} x "
                f"{rung.data_parallel_size} process(es)); raise train.grad_accum_steps or train.micro_batch_size "
                f"to make it >= {KTO_MIN_STEP_ROWS}")
    return None


ROLLOUT_NODE_PROCESSES = 2
"""grpo.rollout=node: one training process and one rollout rank (train/rollout_node.py)."""


def rollout_node(rung: Rung, *, objective: str) -> str | None:
    """`grpo.rollout: node` trains on rank 0 as one process and generates on the last rank, sending
    only the adapters between them: a job of exactly two processes, adapters, no pipeline, and no
    FSDP2 (the trainer is one process holding the whole model, which is what the planner prices for
    a no_shard rank, so the plan's memory stays right for it)."""
    if not rung.rollout_node_enabled:
        return None
    if objective != "grpo":
        return f"grpo.rollout=node generates GRPO's rollouts; objective={objective} samples none: drop grpo.rollout"
    if rung.world_size != ROLLOUT_NODE_PROCESSES:
        return (f"grpo.rollout=node runs one trainer and one rollout rank, but the cluster has {rung.nodes} node(s) x "
                f"{rung.procs_per_node} process(es); set cluster.nodes=2 and cluster.gpus_per_node=1 (or "
                "gpus_per_node=2 on one machine), or grpo.rollout=colocated")
    if not rung.adapters_enabled:
        return (f"grpo.rollout=node sends only the adapters to the rollout rank; method={rung.method} trains every "
                "weight: use method: lora or qlora, or grpo.rollout=colocated")
    if rung.pipeline_enabled:
        return _not_pipelined(rung, "grpo.rollout=node", "grpo.rollout=colocated")
    if rung.fsdp_enabled:
        return (f"grpo.rollout=node trains on one process, which shards nothing: sharding.strategy={rung.strategy} "
                "does not apply; set sharding.strategy=no_shard (or auto) and sharding.cpu_offload=false, or "
                "grpo.rollout=colocated")
    return None


def eight_bit_base(rung: Rung) -> str | None:
    """A stage quantizes its blocks with the 4-bit fill of the sharded base (sharded_qlora.py)."""
    if rung.pipeline_enabled and rung.quantized_enabled and rung.quant_bits != 4:
        return _not_pipelined(rung, "an 8-bit base", "quant.bits=4")
    return None


def dora(rung: Rung, *, use_dora: bool) -> str | None:
    """DoRA's magnitude needs the whole base weight at init, which a stage's meta build lacks."""
    if rung.pipeline_enabled and rung.adapters_enabled and use_dora:
        return _not_pipelined(rung, "lora.use_dora", "lora.use_dora=false")
    return None


def samples(rung: Rung, *, sample_every: int) -> str | None:
    """Sampling generates with the whole model, which no stage holds."""
    if rung.pipeline_enabled and sample_every:
        return _not_pipelined(rung, "train.sample_every", "train.sample_every=0")
    return None


def four_bit_experts(rung: Rung, *, moe_experts: bool) -> str | None:
    """Pipeline stages quantize their blocks with the dense 4-bit fill only (distributed/pipeline.py):
    4-bit fused experts in a stage are not built yet. `moe_experts`: the model has fused experts."""
    if rung.pipeline_enabled and rung.quantized_enabled and moe_experts:
        return (f"method: qlora on an MoE model does not pipeline yet (4-bit experts in a stage are not built): "
                f"set {STAGES_KEY}=1 (full_shard, no_shard or DDP run it)")
    return None


def trained_router(rung: Rung, *, train_router: bool) -> str | None:
    """A stage builds, fills and initialises its blocks on its own, which was not checked with
    trained routers; one process, DDP and FSDP2 train them (moe_routers.py). A full fine-tune
    trains them anyway."""
    if rung.pipeline_enabled and rung.adapters_enabled and train_router:
        return (f"{moe_routers.KEY}: true does not train in a pipeline yet: set {STAGES_KEY}=1 "
                f"(one process, DDP or FSDP2 train the routers), or {moe_routers.KEY}: false")
    return None


def host_embedding(rung: Rung, *, setting: bool | str) -> str | None:
    """`train.embedding_offload: true` on a rung that cannot keep the table on the host (FSDP2
    shards it, a pipeline puts it on its first stage, a full fine-tune trains it)."""
    if setting is True and (why := embedding_offload.rung_refusal(rung)):
        return str(embedding_offload.error(why))
    return None


def refusals(rung: Rung, asked, *, num_blocks: int, moe_experts: bool) -> tuple[str, ...]:
    """Every reason the trainer refuses `rung` for this recipe (`asked`: a config.Recipe or a
    PlanRequest) and model (`num_blocks` decoder blocks; `moe_experts`: it has fused MoE experts),
    in the order a user fixes them; empty: it runs."""
    found = (
        micro_batches(rung, grad_accum_steps=asked.train.grad_accum_steps),
        blocks(rung, num_blocks=num_blocks),
        activation_offload(rung),
        objective(rung, objective=asked.objective),
        grpo_reference(rung, objective=asked.objective, beta=asked.grpo.beta),
        rollout_node(rung, objective=asked.objective),
        kto_batch(rung, objective=asked.objective, loss=asked.dpo.loss, micro_batch_size=asked.train.micro_batch_size,
                  grad_accum_steps=asked.train.grad_accum_steps),
        eight_bit_base(rung),
        dora(rung, use_dora=asked.lora.use_dora),
        samples(rung, sample_every=asked.train.sample_every),
        four_bit_experts(rung, moe_experts=moe_experts),
        trained_router(rung, train_router=asked.lora.train_router),
        host_embedding(rung, setting=asked.train.embedding_offload),
    )
    return tuple(why for why in found if why is not None)


def check(rung: Rung, asked, *, num_blocks: int, moe_experts: bool) -> None:
    """Raise RungError (one line, exit 2) with the first of `refusals`, if any."""
    found = refusals(rung, asked, num_blocks=num_blocks, moe_experts=moe_experts)
    if found:
        raise RungError(found[0])
