"""What the planner is asked and for what: the recipe's request and the cluster, with the link
figures a cluster description falls back to when nothing was measured. Pure dataclasses.

`planner.request_from_recipe` and `hardware.resolve_cluster` build these from a recipe; memory.py
(with params.py and activations.py) prices an option from them and network.py times its step.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Literal

from homelab_ft.plan import gpus
from homelab_ft.recipe.config import (
    DataConfig,
    LoraConfig,
    ModelConfig,
    PlannerConfig,
    QuantConfig,
    ShardingConfig,
    TrainConfig,
)
from homelab_ft.recipe.objectives import DpoConfig, GrpoConfig

# Effective bandwidths in bytes/s. PCIe: NCCL busbw on PCIe 4.0 x16 without peer-to-peer (GeForce
# cards route through host memory) is ~10 GB/s in nccl-tests. NVLink: the 3090/A6000 bridge gives
# ~50 GB/s per direction. Ethernet: link rate x 0.9 (TCP/IP framing; NCCL socket transport reaches
# ~90% of line rate on large messages). CPU/gloo inside a machine: gloo has no shared-memory
# transport, its ranks talk over loopback TCP: 2 ranks of 1 thread each reach an all-reduce bus
# bandwidth of 1.1-1.3 GB/s at 1-64 MiB measured here (torch 2.13, 2-core Xeon VM; the former
# assumed 5 GB/s planned tiny-full-2proc-cpu's collectives ~4x too fast).
LINK_BYTES_PER_S = {"pcie": 10e9, "nvlink": 50e9, "cpu": 1.3e9}
ETHERNET_EFFICIENCY = 0.9
# Latency of a tiny all-reduce between two ranks when the cluster file has no measurement. Ethernet:
# ~0.2 ms for NCCL's socket transport or gloo between two homelab machines (two kernel TCP stack
# passes each way plus NIC interrupt moderation, ~25-50 us a hop on 1-10 GbE, and the library's
# own ~50 us). PCIe: NCCL's small-message all-reduce between two GPUs of one machine, ~20 us
# (nccl-tests); NVLink ~10 us. CPU/gloo on one machine: 0.38 ms measured here (2 processes over
# loopback TCP on a loaded 2-core machine, 200 tiny all-reduces).
LATENCY_S = {"ethernet": 0.2e-3, "pcie": 0.02e-3, "nvlink": 0.01e-3, "cpu": 0.38e-3}
# Host memory bandwidth a CPU process's decode streams its weights at: dual-channel DDR4-3200 peaks
# at 51 GB/s and STREAM's triad reaches ~20 GB/s of it on a desktop (the figure network.py's
# CPU_ADAM_PARAMS_PER_S assumes); the processes of one node share it.
HOST_MEMORY_BYTES_PER_S = 20e9


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
    """Sustained training throughput per device in TFLOPS (peak x utilisation; gpus.throughput)."""
    tflops_source: str = ""
    """Which peak `tflops` comes from and where (gpus.throughput), shown in the plan."""
    memory_bytes_per_s: float | None = None
    """Memory bandwidth per device, what a decode step streams the weights and KV cache at
    (gpus.throughput: the GPU table's; on `cpu` HOST_MEMORY_BYTES_PER_S shared by the node's
    processes); None: `memory_bandwidth`'s fallback."""
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
    node_device_bytes: tuple[int, ...] = ()
    """Memory per device on each node, first to last, when the nodes' GPUs differ (cluster.node_vram_gib,
    `--gpus 1x24GB,1x12GB`); () = `device_bytes` on every node, which is then the smallest of these."""

    @property
    def world_size(self) -> int:
        return self.nodes * self.gpus_per_node

    def node_bytes(self, node: int) -> int:
        """Memory per device on `node` (what a pipeline stage placed there may use)."""
        return self.node_device_bytes[node] if self.node_device_bytes else self.device_bytes

    @property
    def memory_bandwidth(self) -> float:
        """Bytes per second a device reads its memory at: `memory_bytes_per_s`, else the host's share per
        process on `cpu`, else the GPU table's slowest card with this much memory (as gpus.throughput
        prices an unnamed GPU)."""
        if self.memory_bytes_per_s is not None:
            return self.memory_bytes_per_s
        if self.device == "cpu":
            return HOST_MEMORY_BYTES_PER_S / self.gpus_per_node
        return gpus.slowest_with(self.device_bytes).bandwidth_gbs * 1e9

    @property
    def intra_kind(self) -> str:
        return "cpu" if self.device == "cpu" else self.intra_link

    @property
    def inter_link_name(self) -> str:
        """A measured link is named by its rate alone; a nominal one is the Ethernet speed given."""
        return f"{self.inter_link_gbit:g} Gbit/s" + ("" if self.inter_link_measured else " Ethernet")

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
class RowLengths:
    """Token lengths of the recipe's prepared training rows (data/lengths.py measures them when the
    data is prepared; the CLI hands them in): what one row's padded width is made of, an SFT sample,
    the longer side of a pair, a GRPO prompt."""

    counts: tuple[tuple[int, int], ...]
    """(length, rows), shortest first."""

    def expected_longest(self, rows: int) -> float:
        """The expected longest of `rows` rows drawn at random, what a micro-batch is padded to
        (rows.collate): sum over lengths L of L x (P(max <= L) - P(max < L)), P(max <= L) = F(L)^rows."""
        total = sum(n for _, n in self.counts)
        below, expected = 0, 0.0
        for length, n in self.counts:
            expected += length * (((below + n) / total) ** rows - (below / total) ** rows)
            below += n
        return expected

    @property
    def num_rows(self) -> int:
        return sum(n for _, n in self.counts)


@dataclass(frozen=True)
class RowImages:
    """The images of an image-text model's rows, in the tokens they add to the language model's
    sequence. `plan_for_recipe` asks the model's vision side what one image at `size` becomes
    (plan/shape/vision.py: its own image processor and forward); `counts` are the prepared rows'
    own figures, measured on the data (the data side records them), or () before they are: each row
    is then priced with one image (price/images.py)."""

    tokens_per_image: int
    """Image tokens one image of `size` becomes."""
    size: tuple[int, int]
    """(height, width): the square of area data.image_max_pixels (`bounded`), else a reference photo
    (price/images.REFERENCE_SIDE) the plan quotes."""
    bounded: bool
    """`size` is the recipe's bound; without one an image keeps its own size up to the processor's
    limit, and one whose tokens grow with it may fill a row."""
    counts: tuple[tuple[int, int, int], ...] = ()
    """Measured: (images in a row, image tokens in it, rows), fewest tokens first; () not measured."""

    @property
    def num_rows(self) -> int:
        return sum(n for _, _, n in self.counts)

    @property
    def most_per_row(self) -> tuple[int, int]:
        """(images, image tokens) of the measured row with the most image tokens: what memory is priced at."""
        images, tokens, _ = max(self.counts, key=lambda c: (c[1], c[0]))
        return images, tokens

    @property
    def mean_per_row(self) -> tuple[float, float]:
        """(images, image tokens) of the average measured row: what a step's seconds are priced at."""
        rows = self.num_rows
        return (sum(i * n for i, _, n in self.counts) / rows, sum(t * n for _, t, n in self.counts) / rows)


@dataclass(frozen=True)
class PlanRequest:
    """What the recipe asks for: its own typed sections (config.py), as `planner.request_from_recipe`
    takes them from a `config.Recipe`, so a recipe key is read under its own name (`data.max_length`,
    `lora.r`, `quant.bits`) with its own type and default, once. `planner.default_request()` is a
    recipe that sets nothing. The cluster section is not here: `Cluster` is what the plan is for.

    What the planner decides for an `auto` (the savers, the strategy, the pipeline) is never written
    back here: it is the option's `Rung`, and pricing reads the rung for it."""

    method: str
    """`auto` or one of rung.METHODS (config.Recipe.method)."""
    objective: Literal["sft", "dpo", "grpo"]
    """`dpo`: every micro-batch row is a pair, run as a chosen and a rejected sequence in one batch;
    `grpo`: every row is a prompt, sampled `grpo.num_generations` times (price/rollout.py)."""
    model: ModelConfig
    lora: LoraConfig
    quant: QuantConfig
    data: DataConfig
    train: TrainConfig
    sharding: ShardingConfig
    planner: PlannerConfig
    grpo: GrpoConfig = dataclasses.field(default_factory=GrpoConfig)
    """The recipe's `grpo` section, read when `objective` is grpo."""
    dpo: DpoConfig = dataclasses.field(default_factory=DpoConfig)
    """The recipe's `dpo` section, read when `objective` is dpo (its loss decides the reference)."""
    lengths: RowLengths | None = None
    """The prepared rows' measured lengths, what step *time* is priced at (`timed_sequence_tokens`);
    None: rows at data.max_length. Memory is always priced at data.max_length, the longest a batch gets.
    An image-text model's rows count their image tokens in both: they are tokens of the sequence."""
    images: RowImages | None = None
    """An image-text model's images per row (price/images.py: the vision tower's memory and seconds);
    None for a text model."""

    def changed(self, **sections) -> PlanRequest:
        """This request with recipe keys changed, a section's as a dict (validated by its dataclass):
        `changed(data={"max_length": 512}, method="lora")`."""
        new = {name: dataclasses.replace(getattr(self, name), **value) if isinstance(value, dict) else value
               for name, value in sections.items()}
        return dataclasses.replace(self, **new)

    @property
    def pricing_key(self) -> str:
        """The request as pricing reads it, as text (ladder.sized_price keeps prices under it): all
        but `method`, `sharding.strategy` and `sharding.cpu_offload`, which an option's `Rung`
        decides and pricing reads from the rung (tests/unit/plan/test_inputs.py checks that it
        does). Text because the sections hold lists and so do not hash; their reprs are exact."""
        sharding = {f.name: getattr(self.sharding, f.name) for f in dataclasses.fields(self.sharding)
                    if f.name not in ("strategy", "cpu_offload")}
        return repr((self.objective, self.model, self.lora, self.quant, self.data, self.train, sharding, self.planner,
                     self.grpo, self.dpo, self.lengths, self.images))

    @property
    def rows_per_micro_batch(self) -> int:
        """Sequences one forward carries: DPO concatenates each pair's chosen and rejected rows (KTO's
        forwards carry one row each: its completions, or their mismatched completions); GRPO samples
        each of `train.micro_batch_size` prompts `grpo.num_generations` times."""
        if self.objective == "grpo":
            return self.train.micro_batch_size * self.grpo.num_generations
        return self.train.micro_batch_size * (2 if self.objective == "dpo" and not self.dpo.unpaired else 1)

    @property
    def reference_forward(self) -> bool:
        """Preference tuning that compares with a reference model (dpo.loss sigmoid or ipo): a no-grad
        forward per micro-batch with adapters, a cached pre-pass for a full fine-tune. ORPO and SimPO
        need none."""
        return self.objective == "dpo" and self.dpo.needs_reference

    @property
    def reference_forwards(self) -> int:
        """No-grad forwards of the reference per micro-batch with adapters, each of rows_per_micro_batch
        rows: DPO's one of both answers, KTO's two (the completions, then the mismatched completions,
        one at a time so no forward holds more logits than the trained one); 0 without a reference.
        A full fine-tune reads them from the cache instead (its pre-pass: prepass_s_per_pair)."""
        return (2 if self.dpo.unpaired else 1) if self.reference_forward else 0

    @property
    def kl_forwards(self) -> int:
        """KTO's no-grad forward of the policy on the mismatched completions per micro-batch (its KL
        reference point, train/preference.py), on every rung; 0 for the other objectives."""
        return int(self.objective == "dpo" and self.dpo.unpaired)

    @property
    def completion_tokens(self) -> int:
        """Tokens a GRPO rollout appends to its prompt at most (grpo.max_completion_length); 0 otherwise."""
        return self.grpo.max_completion_length if self.objective == "grpo" else 0

    @property
    def sequence_tokens(self) -> int:
        """Tokens of one training sequence, what every activation and logit is priced at: data.max_length,
        and for GRPO the prompt (capped at data.max_length, left-padded) plus its completion."""
        return self.data.max_length + self.completion_tokens

    @property
    def micro_batch_tokens(self) -> int:
        """Tokens one training forward carries: rows_per_micro_batch x sequence_tokens."""
        return self.sequence_tokens * self.rows_per_micro_batch

    @property
    def timed_prompt_tokens(self) -> float:
        """The width a micro-batch is padded to on average, what its seconds are priced at: the expected
        longest of its rows (a DPO micro-batch's pairs, a GRPO micro-batch's prompts) when `lengths`
        were measured and the rows are not packed, else data.max_length."""
        if self.lengths is None or self.data.packing:
            return float(self.data.max_length)
        return min(float(self.data.max_length), self.lengths.expected_longest(self.train.micro_batch_size))

    @property
    def timed_micro_batch_tokens(self) -> float:
        """Tokens one training forward computes on average, padding included: rows_per_micro_batch x
        (timed_prompt_tokens + completion_tokens); micro_batch_tokens when no lengths were measured."""
        return (self.timed_prompt_tokens + self.completion_tokens) * self.rows_per_micro_batch

    @property
    def reduce_bytes(self) -> int:
        """Bytes per element of FSDP2's gradient reductions (sharding.reduce_dtype)."""
        return 4 if self.sharding.reduce_dtype == "float32" else 2

    @property
    def chunked_loss(self) -> bool:
        """The SFT loss runs in chunks (loss.py) unless turned off, and so do GRPO's per-token log-probs
        (loss.completion_logprobs, from the same chunks); DPO's log-probabilities do not yet."""
        return self.train.loss_chunk_tokens != 0 and self.objective != "dpo"

    @property
    def held_out(self) -> bool:
        """The data section holds out an eval split (data.eval_sources, or data.eval_fraction > 0)."""
        return bool(self.data.eval_sources or self.data.eval_fraction)
