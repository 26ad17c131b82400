"""The rung: how one run trains, decided once and validated in one place.

A rung is method (qlora / lora / full) x sharding strategy x CPU offload x the job's shape (nodes x
processes per node) x optimizer (and whether it steps inside backward). The planner builds one `Rung` per option it prices and offers only
those whose construction succeeds; `train` runs the rung the planner chose (or the recipe named), and
the CLI, the model builder and `distributed.parallelize` read its `*_enabled` properties instead of
comparing strategy strings. Validation is pure (no torch, no process group), after torchtitan's
`ParallelDims`, so `plan` and `train` cannot disagree about what runs.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace

from homelab_ft.errors import UserError

METHODS = ("qlora", "lora", "full")
"""The ladder, cheapest first: a 4-bit base + adapters, a 16/32-bit base + adapters, every weight."""

NO_SHARD = "no_shard"
FULL_SHARD = "full_shard"
SHARD_GRAD_OP = "shard_grad_op"
HYBRID_SHARD = "hybrid_shard"
STRATEGIES = (FULL_SHARD, SHARD_GRAD_OP, HYBRID_SHARD, NO_SHARD)
"""FSDP1's names for the four ways to spread a model, kept because users know them."""

ADAMW = "adamw"
BNB_OPTIMIZERS = ("adamw_8bit", "paged_adamw_8bit")
OPTIMIZERS = (ADAMW, *BNB_OPTIMIZERS)
COLOCATED, ROLLOUT_NODE = "colocated", "node"
ROLLOUTS = (COLOCATED, ROLLOUT_NODE)
"""Where GRPO generates: in the training process, or on a rollout rank (train/rollout_node.py)."""
PIPELINE_SCHEDULES = ("1f1b", "gpipe")
"""torch.distributed.pipelining's Schedule1F1B and ScheduleGPipe; 1F1B keeps at most `stages`
micro-batches' activations in flight on the first stage, GPipe all of them."""

DEFER_SYNC_TRAINABLE_FRACTION = 0.05
"""Below this fraction of trainable parameters (adapters: typically < 2%), FSDP2's gradient
reduce-scatter waits for the last micro-batch: the unsharded gradient it keeps meanwhile is small.
A full fine-tune would keep 4 B/param, the very memory FULL_SHARD exists to save. One value for
`distributed.parallelize`, which defers, and `plan.memory`, which prices it."""


class RungError(UserError):
    """A combination the trainer cannot run; the message names the recipe keys and the fix."""


@dataclass(frozen=True)
class Rung:
    """One validated way to train. Constructing an invalid one raises `RungError`."""

    method: str
    strategy: str
    cpu_offload: bool
    nodes: int = 1
    procs_per_node: int = 1
    optimizer: str = ADAMW
    optimizer_in_backward: bool = False
    """Each parameter is stepped from its gradient hook (optim_backward.py): full fine-tunes only."""
    quant_bits: int = 4
    """qlora only: 4 (NF4/FP4, shardable, see sharded_qlora.py) or 8 (LLM.int8, one replica per rank)."""
    activation_checkpointing: bool = False
    """Each block's activations are recomputed in backward (the recipe's value, or the planner's when `auto`)."""
    activation_offload: bool = False
    """The checkpointed block inputs wait in host RAM (offload.py); only with checkpointing."""
    pipeline_stages: int = 1
    """Contiguous groups of decoder blocks, one per pipeline rank (torch.distributed.pipelining);
    1 = no pipeline. The other ranks of the world replicate the pipeline (data parallelism)."""
    stage_blocks: tuple[int, ...] = ()
    """Decoder blocks per stage, first to last; () = as even as possible (the planner sizes it to each GPU)."""
    pipeline_schedule: str = "1f1b"
    embedding_offload: bool = False
    """The frozen input embedding table lives in host RAM, looked up there (train/host_embedding.py);
    set only by rules/embedding_offload.placed, the rule (on this rung, the model's facts and the
    device), where the ladder builds the rung."""
    rollout: str = COLOCATED
    """GRPO's generation: `colocated` in every training process, or `node`: the job's last rank
    generates and rank 0 trains as one process (refusals.rollout_node says when the trainer runs it)."""
    images: bool = False
    """The rows hold images (data.images): the model is built as its image-text class
    (rules/vision.auto_class), its rows read through its processor, pixel values in every forward,
    its vision tower kept out of 4-bit quantization; priced with the tower's activations."""
    rollout_staleness: int = 0
    """A rollout node's lag (grpo.max_staleness): 0 generates each batch with the trainer's adapters
    and the trainer waits; 1 generates the next step's batch while this step trains (one step older
    adapters, corrected by truncated importance sampling). Always 0 for colocated generation."""

    def __post_init__(self) -> None:
        # run.json and the torchrun handoff carry stage_blocks as a JSON list; frozen, so set once here.
        object.__setattr__(self, "stage_blocks", tuple(self.stage_blocks))
        _validate(self)
        _validate_pipeline(self)

    # ---- the job's shape

    @property
    def world_size(self) -> int:
        return self.nodes * self.procs_per_node

    @property
    def shard_size(self) -> int:
        """Ranks one parameter is split over: all of them, one node's for HYBRID_SHARD, 1 unsharded."""
        if not self.fsdp_enabled:
            return 1
        return self.procs_per_node if self.hybrid_enabled else self.world_size

    @property
    def pipeline_enabled(self) -> bool:
        return self.pipeline_stages > 1

    @property
    def data_parallel_size(self) -> int:
        """Replicas of the whole model that train (of the whole pipeline when pipelined); a rollout
        node's job trains on one of its processes."""
        if self.rollout_node_enabled:
            return 1
        return self.world_size // self.pipeline_stages

    @property
    def rollout_node_enabled(self) -> bool:
        """GRPO's rollouts come from the job's last rank; rank 0 trains alone (train/rollout_node.py)."""
        return self.rollout == ROLLOUT_NODE

    # ---- what runs

    @property
    def adapters_enabled(self) -> bool:
        """Only LoRA adapters train; the base is frozen."""
        return self.method in ("lora", "qlora")

    @property
    def quantized_enabled(self) -> bool:
        """The frozen base is loaded in 4 or 8 bits by bitsandbytes."""
        return self.method == "qlora"

    @property
    def fsdp_enabled(self) -> bool:
        """Parameters are sharded with FSDP2 `fully_shard` (also on one GPU, to offload to the CPU)."""
        return self.strategy != NO_SHARD

    @property
    def ddp_enabled(self) -> bool:
        """Several replicas with only the trainable gradients all-reduced (DistributedDataParallel)."""
        return self.strategy == NO_SHARD and self.world_size > 1

    @property
    def hybrid_enabled(self) -> bool:
        """2-D mesh: shard inside each node, replicate across nodes."""
        return self.strategy == HYBRID_SHARD

    @property
    def reshard_after_forward(self) -> bool:
        """FULL_SHARD frees each block's gathered weights after its forward; SHARD_GRAD_OP keeps them."""
        return self.strategy != SHARD_GRAD_OP

    @property
    def process_group_enabled(self) -> bool:
        """The run needs torchrun and a process group: several ranks, or FSDP on one GPU to offload."""
        return self.world_size > 1 or self.fsdp_enabled

    @property
    def bnb_optimizer_enabled(self) -> bool:
        return self.optimizer in BNB_OPTIMIZERS

    @property
    def label(self) -> str:
        savers = " +act-off" if self.activation_offload else " +ckpt" if self.activation_checkpointing else ""
        node = " +rollout-node" if self.rollout_node_enabled else ""
        images = " +images" if self.images else ""
        return f"{self.method} {self.strategy}{' +offload' if self.cpu_offload else ''}{savers}{node}{images}"

    def to_dict(self) -> dict:
        """Plain JSON data (run.json, plan.json, the torchrun handoff): stage_blocks as a list."""
        return {f.name: list(v) if isinstance(v := getattr(self, f.name), tuple) else v for f in fields(self)}

    @classmethod
    def from_dict(cls, data: dict) -> Rung:
        return cls(**{f.name: data[f.name] for f in fields(cls) if f.name in data})


def _validate(r: Rung) -> None:
    if r.method not in METHODS:
        raise RungError(f"method={r.method!r} is not a rung; use one of auto, {', '.join(METHODS)}")
    if r.strategy not in STRATEGIES:
        raise RungError(f"sharding.strategy={r.strategy!r} does not exist; use one of auto, {', '.join(STRATEGIES)}")
    if r.rollout not in ROLLOUTS:
        raise RungError(f"grpo.rollout={r.rollout!r} does not exist; use one of auto, {', '.join(ROLLOUTS)}")
    if r.rollout_staleness not in (0, 1) or (r.rollout_staleness and r.rollout != ROLLOUT_NODE):
        raise RungError(f"grpo.max_staleness={r.rollout_staleness} is 0, or 1 with grpo.rollout=node")
    if r.optimizer not in OPTIMIZERS:
        raise RungError(f"train.optimizer={r.optimizer!r} does not exist; use one of {', '.join(OPTIMIZERS)}")
    if r.nodes < 1 or r.procs_per_node < 1:
        raise RungError(f"cluster: {r.nodes} node(s) x {r.procs_per_node} process(es) per node; both must be >= 1")
    if why := hybrid_refusal(r.strategy, nodes=r.nodes):
        raise RungError(why)
    if r.cpu_offload and not r.fsdp_enabled:
        raise RungError("sharding.cpu_offload=true needs a sharded strategy (FSDP2 offloads shards); set "
                        "sharding.strategy=full_shard (also works with one GPU) or sharding.cpu_offload=false")
    if r.fsdp_enabled and r.world_size == 1 and not r.cpu_offload:
        raise RungError(f"sharding.strategy={r.strategy} with one process shards nothing; use "
                        "sharding.strategy=no_shard, or add sharding.cpu_offload=true to offload to the CPU")
    if r.quant_bits not in (4, 8):
        raise RungError(f"quant.bits={r.quant_bits}: bitsandbytes quantizes to 4 or 8 bits")
    if r.quantized_enabled and r.fsdp_enabled and r.quant_bits != 4:
        # LLM.int8 keeps int8 rows plus fp16 outlier columns found per batch: no byte layout FSDP2 can split.
        raise RungError(f"method=qlora with quant.bits=8 and sharding.strategy={r.strategy}: an 8-bit base cannot be "
                        "sharded (FSDP2 splits only the 4-bit base, see docs/qlora.md); use quant.bits=4, or "
                        "sharding.strategy=no_shard (each GPU holds the 8-bit base)")
    if r.optimizer_in_backward and r.adapters_enabled:
        raise RungError(f"train.optimizer_in_backward is for full fine-tunes; with method={r.method} the adapter "
                        "gradients are tiny, set train.optimizer_in_backward=false")
    if r.optimizer_in_backward and r.ddp_enabled:
        raise RungError("train.optimizer_in_backward needs FSDP on several ranks (DDP reduces gradients after the "
                        "per-parameter step would run); set sharding.strategy=full_shard or "
                        "train.optimizer_in_backward=false")
    if r.activation_offload and not r.activation_checkpointing:
        raise RungError("train.activation_offload moves the checkpointed block inputs to host RAM; set "
                        "train.activation_checkpointing=true (or auto) as well")
    if r.bnb_optimizer_enabled and r.fsdp_enabled:
        raise RungError(f"train.optimizer={r.optimizer} cannot update FSDP2-sharded parameters (bitsandbytes "
                        "optimizers take plain tensors, not DTensor shards); use train.optimizer=adamw, or "
                        "sharding.strategy=no_shard")


def hybrid_refusal(strategy: str, *, nodes: int) -> str | None:
    """HYBRID_SHARD shards inside a node and replicates across nodes: one node has nothing to
    replicate across. The rung's rule, and the planner's for a recipe that names the strategy alone."""
    if strategy == HYBRID_SHARD and nodes < 2:
        return ("sharding.strategy=hybrid_shard shards inside a node and replicates across nodes: it needs "
                "cluster.nodes >= 2; on one machine use full_shard")
    return None


def _validate_pipeline(r: Rung) -> None:
    """The pipeline's own refusals; those that need the model (its blocks) or the micro-batch count
    come from `distributed.pipeline.check_recipe`, also before anything is created."""
    if r.pipeline_stages < 1:
        raise RungError(f"sharding.pipeline_stages={r.pipeline_stages}: a pipeline has at least 1 stage (1 = none)")
    if r.world_size % r.pipeline_stages:
        raise RungError(f"sharding.pipeline_stages={r.pipeline_stages} does not divide the {r.world_size} processes of "
                        f"cluster (nodes x gpus_per_node); every data-parallel replica needs all the stages")
    if r.pipeline_schedule not in PIPELINE_SCHEDULES:
        raise RungError(f"sharding.pipeline_schedule={r.pipeline_schedule!r} does not exist; use one of "
                        f"{', '.join(PIPELINE_SCHEDULES)}")
    if r.stage_blocks and len(r.stage_blocks) != r.pipeline_stages:
        raise RungError(f"sharding.stage_blocks lists {len(r.stage_blocks)} stage(s) but sharding.pipeline_stages="
                        f"{r.pipeline_stages}; give one block count per stage, or drop stage_blocks")
    if any(n < 1 for n in r.stage_blocks):
        raise RungError(f"sharding.stage_blocks={list(r.stage_blocks)}: every stage needs at least one decoder block")
    if not r.pipeline_enabled:
        return
    if r.fsdp_enabled:
        raise RungError(f"sharding.pipeline_stages={r.pipeline_stages} runs its data-parallel replicas with DDP; "
                        f"sharding.strategy={r.strategy} inside a stage is not supported yet: set "
                        "sharding.strategy=no_shard, or sharding.pipeline_stages=1")
    if r.images:
        raise RungError(f"sharding.pipeline_stages={r.pipeline_stages} with data.images: the vision tower and the "
                        "first stage's image tokens are not split into stages yet; set sharding.pipeline_stages=1")
    if r.optimizer_in_backward:
        raise RungError("train.optimizer_in_backward steps parameters inside backward, but a pipeline's clipping "
                        "needs every stage's gradient norm first; set train.optimizer_in_backward=false "
                        "or sharding.pipeline_stages=1")


def default_strategy(method: str, *, world_size: int) -> str:
    """What a recipe that leaves `sharding.strategy: auto` gets when the planner chose nothing:
    adapters are small, so replicate them (only adapter gradients cross the network); a full
    fine-tune over several ranks shards everything."""
    if method in ("lora", "qlora") or world_size == 1:
        return NO_SHARD
    return FULL_SHARD


def effective_strategy(strategy: str, *, world_size: int, cpu_offload: bool) -> str:
    """One process without offload never shards, whatever the recipe names: there is nothing to shard."""
    return strategy if world_size > 1 or cpu_offload else NO_SHARD


def implied_checkpointing(checkpointing: bool | str, *, activation_offload: bool | str) -> bool | str:
    """Activation offload asked for explicitly brings the checkpointing it needs when that is left
    to `auto` (offload moves the checkpointed block inputs; without checkpointing there are none).
    Returns the setting to use: a bool, or still `auto`. The planner prices with it; `requested_rung` obeys it."""
    if checkpointing == "auto" and activation_offload is True:
        return True
    return checkpointing


def build(method: str, strategy: str, cpu_offload: bool, *, nodes: int, procs_per_node: int, train, quant, sharding,
          data, activation_checkpointing: bool, activation_offload: bool, pipeline_stages: int = 1,
          rollout: str = COLOCATED, staleness: int = 0) -> Rung:
    """The one place a rung's fields are read off the recipe: `train`, `quant`, `sharding` and `data` are its
    sections (recipe.config's dataclasses, which the planner's PlanRequest holds too), the choices
    the ladder or `requested_rung` made are the arguments. A new knob of what runs is a Rung field
    and a line here. A pipeline the recipe names keeps its stage split; one the planner picks is
    sized to each GPU by the pricing (plan/price/pipeline.py)."""
    named = pipeline_stages > 1 and pipeline_stages == sharding.pipeline_stages
    return Rung(method=method, strategy=strategy, cpu_offload=cpu_offload, nodes=nodes, procs_per_node=procs_per_node,
                optimizer=train.optimizer, optimizer_in_backward=train.optimizer_in_backward, quant_bits=quant.bits,
                activation_checkpointing=activation_checkpointing, activation_offload=activation_offload,
                pipeline_stages=pipeline_stages, stage_blocks=tuple(sharding.stage_blocks or ()) if named else (),
                pipeline_schedule=sharding.pipeline_schedule, rollout=rollout, images=data.images,
                rollout_staleness=staleness if rollout == ROLLOUT_NODE else 0)


def requested_rollout(objective: str, grpo) -> str:
    """Where a recipe's rollouts run when no plan chose: what `grpo.rollout` names, colocated for
    `auto` (the planner picks the node only where it prices both) and for every other objective."""
    return grpo.rollout if objective == "grpo" and grpo.rollout != "auto" else COLOCATED


def requested_staleness(objective: str, grpo) -> int:
    """How far a rollout node may lag (grpo.max_staleness; `build` keeps it only on a node's rung)."""
    return grpo.max_staleness if objective == "grpo" else 0


def requested_rung(method: str, *, nodes: int, procs_per_node: int, train, quant, sharding, data,
                   rollout: str = COLOCATED, staleness: int = 0) -> Rung:
    """The rung a request names when no plan fills its `auto`s (the planner refuses a fully named
    rung with it before pricing anything; `train` runs it when the planner chose nothing): `auto`
    method is LoRA (a full fine-tune when the optimizer steps in backward, which only it takes),
    `auto` strategy is `default_strategy`, `auto` savers are off unless offload brings checkpointing.
    `train`, `quant`, `sharding`, `data`: the recipe's sections, as `build` reads them."""
    world_size = nodes * procs_per_node
    if method == "auto":
        method = "full" if train.optimizer_in_backward else "lora"
    strategy = sharding.strategy
    if strategy == "auto":
        strategy = default_strategy(method, world_size=world_size)
    checkpointing = implied_checkpointing(train.activation_checkpointing, activation_offload=train.activation_offload)
    return build(method, effective_strategy(strategy, world_size=world_size, cpu_offload=sharding.cpu_offload),
                 sharding.cpu_offload, nodes=nodes, procs_per_node=procs_per_node, train=train, quant=quant,
                 sharding=sharding, data=data, activation_checkpointing=checkpointing is True,
                 activation_offload=train.activation_offload is True, rollout=rollout, staleness=staleness)


def rung_for(recipe) -> Rung:
    """The rung a recipe trains with when there is no plan to take it from (a planned run takes
    `plan.chosen.rung`, decided once by the planner): the recipe's explicit choices, validated, and
    `requested_rung`'s defaults for what it leaves `auto`. Used where the planner chose nothing for
    a named method, and by tests and benchmarks that build a model for a recipe directly."""
    return pipelined(requested_rung(recipe.method, nodes=recipe.cluster.nodes, procs_per_node=recipe.cluster.gpus_per_node,
                                    train=recipe.train, quant=recipe.quant, sharding=recipe.sharding,
                                    data=recipe.data, rollout=requested_rollout(recipe.objective, recipe.grpo),
                                    staleness=requested_staleness(recipe.objective, recipe.grpo)), recipe.sharding)


def pipelined(rung: Rung, sharding) -> Rung:
    """`rung` with the pipeline the recipe's `sharding:` section names (config.ShardingConfig):
    `pipeline_stages: auto` leaves the rung's own. A pipeline's replicas are DDP replicas, so a
    `strategy: auto` that became a sharded strategy is `no_shard` there (an explicit one is
    refused by `_validate_pipeline` with its fix)."""
    if sharding.pipeline_stages == "auto" or sharding.pipeline_stages == rung.pipeline_stages:
        return rung  # the planner's pipeline (its stage split sized to each GPU), or none asked for
    strategy = NO_SHARD if sharding.pipeline_stages > 1 and sharding.strategy == "auto" else rung.strategy
    return replace(rung, strategy=strategy, cpu_offload=rung.cpu_offload and strategy != NO_SHARD,
                   embedding_offload=rung.embedding_offload and sharding.pipeline_stages == 1,
                   pipeline_stages=sharding.pipeline_stages, stage_blocks=tuple(sharding.stage_blocks or ()),
                   pipeline_schedule=sharding.pipeline_schedule)
