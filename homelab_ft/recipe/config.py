"""Recipes: YAML mapped onto frozen, validated dataclasses.

Every default lives here, once, as a field with a docstring. Loading is strict: an unknown key
names its dotted path and the nearest valid key, a wrong type or out-of-range value names the key
and what it accepts. Nothing in the code base reads a recipe with `.get(key, default)`.

pydantic does the type checking and coercion; io.py reads the YAML, applies the
`section.key=value` command-line overrides and words the error messages a user can act on.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import Field, TypeAdapter, ValidationError
from pydantic.dataclasses import dataclass

from homelab_ft.errors import UserError
from homelab_ft.recipe import objective_checks
from homelab_ft.recipe.bounds import (
    STRICT,
    Fraction,
    LearningRate,
    NonNegative,
    NonNegInt,
    Positive,
    PositiveInt,
    Seed,
)
from homelab_ft.recipe.io import apply_overrides, attach_field_docs, explain, read_yaml_mapping
from homelab_ft.recipe.objectives import DpoConfig, GrpoConfig
from homelab_ft.rules import embedding_offload
from homelab_ft.rung import METHODS, OPTIMIZERS, PIPELINE_SCHEDULES, STRATEGIES

# The names live once, in rung.py; `auto` lets the planner choose.
Method = Literal[("auto", *METHODS)]


@dataclass(frozen=True, config=STRICT)
class ModelConfig:
    path: str = "smollm2"
    """A local Hugging Face model directory, a `.gguf` file, a hub id already in the local HF cache,
    or `smollm2` for the embedded SmolLM2-135M-Instruct (converted once from its GGUF file)."""
    tokenizer: str | None = None
    """Tokenizer location when it differs from `path`."""
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    """Dtype of the trainable base weights. `auto`: bfloat16 on GPUs that support it, else float32
    (CPU matmuls in bf16 are slow and lossy, so CPU runs train in fp32)."""
    attn_implementation: Literal["auto", "sdpa", "eager", "flash_attention_2"] = "auto"
    """`auto`: sdpa where the model class supports it, else eager (Gemma 2, gpt-oss), as transformers
    falls back; an explicit choice the family does not support is refused (model/family.py)."""
    trust_remote_code: bool = False
    """Run Python code shipped with a model. Off by default: it executes files from the model dir."""


@dataclass(frozen=True, config=STRICT)
class LoraConfig:
    r: PositiveInt = 16
    """Adapter rank."""
    alpha: Positive = 32.0
    """Scaling numerator: the adapter output is multiplied by alpha / r (alpha / sqrt(r) with rsLoRA)."""
    dropout: Fraction = 0.05
    target_modules: Literal["all-linear"] | list[str] = "all-linear"
    """`all-linear` (every linear layer except the LM head) or a list of module-name suffixes."""
    use_dora: bool = False
    """Weight-decomposed LoRA (Liu et al. 2024): slower steps, often better at low rank."""
    use_rslora: bool = False
    """Rank-stabilised scaling alpha / sqrt(r) (Kalajdzievski 2023), which keeps high ranks stable."""
    dtype: Literal["float32", "compute"] = "float32"
    """Dtype of the adapter weights, and so of their gradients and AdamW moments (torch keeps the
    moments in the parameter's dtype). `float32`, the most accurate: 16 B per adapter parameter with
    AdamW. `compute`: bf16 when the base computes in bf16 (8 B per parameter; small updates round
    away sooner), fp32 otherwise (fp16 adapters overflow)."""
    train_router: bool = False
    """On an MoE model, train each router (the [experts, hidden] gate of every sparse-MoE block,
    homelab_ft/rules/moe_routers.py) in full, beside the adapters: no LoRA on it, its weights in the
    adapters' dtype (`dtype` above: fp32, or bf16 with `compute`). Off, the router stays frozen in
    the compute dtype. Refused on a dense model and in pipelines (one process, DDP and FSDP2 train it)."""

    @property
    def targets(self) -> tuple[str, ...]:
        """`target_modules` as a tuple of names (`("all-linear",)` for the string)."""
        names = self.target_modules
        return (names,) if isinstance(names, str) else tuple(names)


@dataclass(frozen=True, config=STRICT)
class QuantConfig:
    bits: Literal[4, 8] = 4
    quant_type: Literal["nf4", "fp4"] = "nf4"
    """4-bit data type; NF4 is the QLoRA paper's choice for normally distributed weights."""
    double_quant: bool = True
    """Quantize the per-block absmax constants too: saves ~0.37 bits/param (QLoRA paper, sec. 3)."""
    compute_dtype: Literal["auto", "bfloat16", "float16", "float32"] = "auto"
    """Dtype the 4-bit weights are dequantized to for matmuls. `auto`: bf16 where supported, else fp32."""


@dataclass(frozen=True, config=STRICT)
class SourceConfig:
    path: str
    """A file (JSONL, JSON, CSV, Parquet), a glob, a folder, a `save_to_disk` directory, or a hub
    dataset id already in the local cache."""
    format: Literal["auto", "chat", "alpaca", "sharegpt", "prompt_completion", "text", "preference", "unpaired"] = "auto"
    """`preference`: rows `{prompt | messages, chosen, rejected}` for `objective: dpo` (chosen and
    rejected as strings or message lists, as in UltraFeedback-style sets); `unpaired`: rows `{prompt |
    messages, completion, label}` with a boolean label (thumbs up/down) for `dpo.loss: kto`."""
    split: str = "train"
    """Split to read when the source has several (hub datasets, `DatasetDict` folders)."""
    weight: Positive = 1.0
    """Multiplier on this source's row count when mixing: 2.0 uses every row twice, 0.5 a random half
    (chosen by the seed). Held-out eval rows are taken before weighting, so repeats never leak into eval."""
    limit: PositiveInt | None = None
    """Use at most this many rows of this source: the first valid ones, in file order."""
    fields: dict[str, str] = Field(default_factory=dict)
    """Column renames from the format's names to yours, e.g. `{instruction: question, output: answer}`."""


@dataclass(frozen=True, config=STRICT)
class DataConfig:
    sources: list[SourceConfig] = Field(default_factory=list)
    """Training sources (required to train; never defaulted). `demo:train` / `demo:eval` are the
    dataset shipped for `make demo`."""
    eval_sources: list[SourceConfig] = Field(default_factory=list)
    """Held-out sources; when empty, `eval_fraction` of the training rows are held out instead."""
    eval_fraction: Fraction = 0.0
    max_length: PositiveInt = 512
    """Tokens per sample (and per packed block)."""
    overlong: Literal["truncate", "drop"] = "truncate"
    packing: bool = False
    """Concatenate samples into `max_length` blocks; attention never crosses a sample boundary."""
    train_on_inputs: bool = False
    """Also put loss on prompts and user turns; by default only assistant turns are learned."""
    system_prompt: str | None = None
    """Inserted as the system turn of every sample that has none."""
    drop_system_prompt: bool = False
    """Remove every system turn from the rows (before `system_prompt`, which then adds nothing)."""
    chat_template: str | None = None
    """A Jinja chat template (inline, a path to a file, or `chatml`) that replaces the tokenizer's own."""
    bad_rows: Literal["fail", "skip"] = "fail"
    """`skip`: malformed rows are counted and left out instead of stopping the run."""
    shuffle: bool = True
    """Shuffle the training rows each epoch (seeded by train.seed); false: file order."""
    cache_dir: str | None = None
    """Where tokenised data is cached; default: the `datasets` cache."""
    images: bool = False
    """Rows hold images (content parts `{type: image, path | image}`, docs/data.md): the model is built as
    its image-text class and reads them through its processor (rules/vision.py). SFT, unpacked."""
    image_max_pixels: PositiveInt | None = None
    """With `images`: a larger image is shrunk into this area (width x height), aspect kept, before its
    processor resizes it (Qwen2-VL-style: one token per 28x28 pixels). Unset: not shrunk."""
    image_min_pixels: PositiveInt | None = None
    """With `images`: an image smaller than this area is enlarged to it, aspect kept. Unset: none."""


DEFAULT_MAX_STEPS = 100
"""train.max_steps when neither it nor train.num_epochs is set."""


@dataclass(frozen=True, config=STRICT)
class TrainConfig:
    seed: Seed = 42
    max_steps: PositiveInt | None = None
    """Optimizer steps (each is `micro_batch_size x grad_accum_steps x ranks` samples); 100
    (DEFAULT_MAX_STEPS) unless `num_epochs` is set. Exclusive with `num_epochs`."""
    num_epochs: Positive | None = None
    """Passes over the training rows instead of `max_steps`: the optimizer steps they mean are
    counted once the data is tokenised (and packed), as ceil(num_epochs x rows // (micro_batch_size
    x ranks) / grad_accum_steps) (train.steps.total_steps), logged at the start, the progress bar's
    total and the schedule's length."""
    micro_batch_size: PositiveInt = 4
    grad_accum_steps: PositiveInt = 1
    lr: LearningRate = 2e-4
    weight_decay: NonNegative = 0.0
    betas: tuple[Fraction, Fraction] = (0.9, 0.999)
    warmup_steps: NonNegInt = 0
    lr_schedule: Literal["cosine", "linear", "constant"] = "cosine"
    min_lr_ratio: Annotated[float, Field(ge=0, le=1)] = 0.0
    """The schedule decays to `lr * min_lr_ratio` at `max_steps`."""
    max_grad_norm: NonNegative = 1.0
    """Clip the global gradient norm to this; 0 turns clipping off."""
    optimizer: Literal[OPTIMIZERS] = "adamw"
    """8-bit and paged AdamW come from bitsandbytes (optimizer state in 8 bits: ~75% less than
    AdamW's fp32 moments); paged AdamW falls back to plain 8-bit AdamW on CPU."""
    activation_checkpointing: bool | Literal["auto"] = "auto"
    """Recompute each block's activations in backward: ~30% slower steps, far less memory. `auto`:
    the planner turns it on only when the chosen option fits no other way (and says so)."""
    loss_chunk_tokens: NonNegInt | Literal["auto"] = "auto"
    """Compute the LM head and cross-entropy a chunk of trained tokens at a time, recomputing each
    chunk in backward (loss.py): the full-vocabulary logits never exist (7.4 GB -> 0.23 GB for
    Llama 3 at 2 x 2048 tokens). `auto`: chunks of 16.4 M logits (128 tokens of a 128k
    vocabulary; a small vocabulary takes one chunk, which is not recomputed: loss_chunks.py). A
    number: that many tokens per chunk. 0: the model's full logits and one cross-entropy."""
    activation_offload: bool | Literal["auto"] = "auto"
    """With activation_checkpointing: keep each block's checkpointed input in host RAM (pinned on
    CUDA) until backward needs it (offload.py): layers x tokens x hidden fewer bytes per GPU, at the
    cost of two PCIe copies of them per step. `auto`: on a GPU, the planner turns it on (with
    checkpointing) only when checkpointing alone does not fit."""
    embedding_offload: bool | Literal["auto"] = "auto"
    """LoRA/QLoRA on a GPU: keep the frozen input embedding table in host RAM and move only the
    looked-up rows (pinned) to the GPU (train/host_embedding.py): vocab x hidden fewer bytes per GPU
    (0.58 GiB for Qwen3-30B-A3B, 0.98 GiB for Llama-3-8B) for one tokens x hidden copy per
    micro-batch. `auto`: on wherever it applies (adapter rung, untied and untargeted embeddings, one
    process or DDP, a GPU; homelab_ft/rules/embedding_offload.py); `true` refuses where it cannot apply."""
    optimizer_in_backward: bool = False
    """Full fine-tunes: step each parameter from its gradient hook and free the gradient at once, so
    the full set of gradients never exists (saves ~2 B/param in bf16; optim_backward.py). Needs
    grad_accum_steps=1 and max_grad_norm=0 (the global norm is only known after every step ran)."""
    compile: bool = False
    """torch.compile each transformer block in place and each loss chunk's cross-entropy
    (compiling.py): fused kernels, same parameter names. The first step also compiles (tens of
    seconds per block graph on a CPU); needs a C++ compiler on CPU, Triton on CUDA."""
    eval_every: NonNegInt = 0
    """Evaluate on the held-out split every N steps (0: only at the end, if there is a split)."""
    eval_max_batches: PositiveInt | None = None
    """Evaluate on at most this many micro-batches of the held-out split, from its start (a
    shorter, cheaper evaluation); default: the whole split."""
    sample_every: NonNegInt = 0
    """Every N optimizer steps, greedy replies to `sample_prompts` go to metrics.jsonl (rows with
    `samples`), TensorBoard (text) and the progress output (train/samples.py); 0: off."""
    sample_prompts: tuple[str, ...] = ()
    """User turns to sample, rendered with the data's chat template; empty: the prompts of the first
    3 held-out rows (a run without held-out rows must name some)."""
    sample_max_new_tokens: PositiveInt = 64
    """Longest sampled reply, in tokens (64: a sentence or two, seconds per prompt on a CPU)."""
    save_every: NonNegInt = 0
    """Write a resumable checkpoint every N steps (0: only at the end)."""
    keep_last: PositiveInt = 2
    """Checkpoints to keep; older complete ones are deleted after a new one is written."""
    skip_nonfinite_steps: Annotated[int, Field(ge=0, le=1000)] = 0
    """A step whose loss or gradient norm is not finite (NaN/inf) is never applied (train/divergence.py);
    with 0 the first one stops the run (exit 3, one line naming the step and the usual causes). N
    skips up to N such steps over the run (each logged and counted in metrics.jsonl as
    `skipped_nonfinite`) and stops at the next: a rare overflow (fp16) passes, a diverged run still
    stops. At most 1000: more skipped steps than that is a run that no longer trains."""
    save_on_interrupt: bool = True
    """On SIGTERM or SIGINT (Ctrl-C, `docker stop`, a scheduler's preemption), finish the step in
    progress, write a checkpoint of it, and exit 143 / 130 with the line that resumes the run."""
    log_every: PositiveInt = 1
    """Write a metrics.jsonl row (and TensorBoard point) every N steps; the last step always."""
    resume: bool | Literal["auto"] = False
    """Continue from the newest complete checkpoint in the run directory (`true` refuses to start
    when there is none; `auto` starts a new run then)."""
    allow_data_change: bool = False
    """--allow-data-change: resume although the data differs from the checkpoint's (data/fingerprint.py)."""
    device: Literal["auto", "cpu", "cuda"] = "auto"
    num_threads: PositiveInt | None = None
    """CPU threads per process (torch.set_num_threads); default: torch's choice."""

    def __post_init__(self):
        # Refusals that depend on this section alone; rung-dependent ones: optim_backward.py.
        if self.max_steps is not None and self.num_epochs is not None:
            raise ValueError(f"train.max_steps ({self.max_steps}) and train.num_epochs ({self.num_epochs}) both say "
                             "how long to train; set one (train.max_steps=null or train.num_epochs=null drops the other)")
        if self.max_steps is None and self.num_epochs is None:
            # frozen: the one default is filled in here, where it is decided, so every reader sees an int.
            object.__setattr__(self, "max_steps", DEFAULT_MAX_STEPS)
        if self.activation_offload is True and self.activation_checkpointing is False:
            raise ValueError("train.activation_offload moves the checkpointed block inputs to host RAM; set "
                             "train.activation_checkpointing=true as well (offloading every activation is slower "
                             "than recomputing them)")
        if self.optimizer_in_backward and self.grad_accum_steps > 1:
            raise ValueError("train.optimizer_in_backward steps every parameter in each backward, so it cannot "
                             f"accumulate; set train.grad_accum_steps=1 (and raise micro_batch_size) instead of "
                             f"{self.grad_accum_steps}")
        if self.optimizer_in_backward and self.max_grad_norm > 0:
            raise ValueError("train.optimizer_in_backward steps each parameter before the global gradient norm "
                             "exists; set train.max_grad_norm=0 (the norm is still logged)")
        if self.optimizer_in_backward and self.skip_nonfinite_steps:
            raise ValueError("train.optimizer_in_backward steps each parameter inside backward, before the step's "
                             "loss and norm are known, so a non-finite step cannot be skipped (it stops the run); "
                             "set train.skip_nonfinite_steps=0")
        if self.sample_prompts and not self.sample_every:
            raise ValueError("train.sample_prompts are sampled only with train.sample_every=N (every N steps); set it, "
                             "or drop the prompts")


@dataclass(frozen=True, config=STRICT)
class EvalConfig:
    """lm-evaluation-harness after the run (`homelab-ft eval`, README): scored on the
    newest checkpoint once training ends, written to RUN/eval/<task>.json."""

    tasks: tuple[str, ...] = ()
    """Tasks to score after training: shipped (`homelab_demo_json`, `homelab_demo_sums`) or lm-eval's
    own whose data is in the local datasets cache; checked before the run starts. Empty: none."""
    limit: PositiveInt | None = None
    """At most this many examples per task."""
    baseline: bool = False
    """Also score the base model, for a before -> after table."""


@dataclass(frozen=True, config=STRICT)
class OutputConfig:
    dir: str | None = None
    """Run directory; default `runs/<recipe name>`."""
    overwrite: bool = False
    """Replace a run directory that holds another run. Without it such a directory is refused."""
    tensorboard: bool = True
    """TensorBoard events in RUN/tensorboard; the same as listing `tensorboard` in `report_to`."""
    report_to: tuple[Literal["tensorboard", "trackio", "mlflow", "wandb"], ...] = ()
    """More trackers for the same metrics, each local by default (train/trackers.py): trackio's store in
    RUN/trackio, MLflow's file store in RUN/mlflow, W&B offline in RUN/wandb unless logged in. The
    `track` extra installs them. Empty: TensorBoard only (unless `tensorboard: false`)."""

    @property
    def trackers(self) -> tuple[str, ...]:
        """Every tracker the run reports to, TensorBoard first when on, each once."""
        names = (("tensorboard",) if self.tensorboard else ()) + self.report_to
        return tuple(dict.fromkeys(names))


@dataclass(frozen=True, config=STRICT)
class ClusterConfig:
    nodes: PositiveInt = 1
    gpus_per_node: PositiveInt = 1
    """Processes per node: one per GPU (or, on CPU, worker processes)."""
    vram_gib: Positive | None = None
    """Memory per GPU; default: detected on this machine."""
    host_ram_gib: Positive | None = None
    """RAM per node; default: detected on this machine."""
    intra_link: Literal["pcie", "nvlink"] = "pcie"
    inter_link_gbit: Positive = 1.0
    """Ethernet speed between nodes in Gbit/s (1, 2.5, 10 ...)."""
    device: Literal["auto", "cuda", "cpu"] = "auto"
    """What the planner plans for; `cpu` plans host RAM as the device memory."""
    gpu_name: str | None = None
    """GPU model name (as nvidia-smi prints it, e.g. `NVIDIA GeForce RTX 4060 Ti`, or just `4060 Ti`):
    the plan looks up its throughput in the GPU table (plan/gpus.py); default: detected on this
    machine. Unset with `--gpus`, or a card the table lacks: priced as the table's slowest card
    with that much memory, and the plan says so."""
    gpu_tflops: Positive | None = None
    """Dense bf16 matmul TFLOPS one GPU reaches, as `homelab-ft doctor` measures it (written to the
    cluster file); replaces the GPU table's figure in the plan."""
    cpu_gflops_per_core: Positive | None = None
    """fp32 matmul GFLOPS one CPU core reaches, as `homelab-ft doctor` measures it on a CPU cluster
    (written to the cluster file); a CPU plan prices its steps from it (plan/hardware.py:
    cpu_throughput). Default: measured once on this machine and cached."""
    inter_latency_ms: NonNegative | None = None
    """Latency of a small collective between nodes; default: the planner's assumption for Ethernet."""
    intra_link_gbit: Positive | None = None
    """Measured collective bandwidth between processes of one node; default: from `intra_link`."""
    intra_latency_ms: NonNegative | None = None
    """Latency of a small collective inside a node; default: the planner's assumption for `intra_link`."""
    inter_link_measured: bool = False
    """`inter_link_gbit` is a measured collective bandwidth (set by a cluster file, `--cluster`),
    used as it is; otherwise it is the nominal Ethernet speed, of which collectives reach ~90%."""
    node_vram_gib: tuple[Positive, ...] | None = None
    """Memory per GPU on each node, first to last, when the nodes' GPUs differ (`--gpus 1x24GB,1x12GB`);
    one entry per node. The sharded options fit the smallest; a pipeline sizes its stages to each."""


@dataclass(frozen=True, config=STRICT)
class PlannerConfig:
    headroom: Fraction = 0.1
    """Fraction of device memory kept free beyond the estimate (allocator spikes, other processes)."""



Strategy = Literal[("auto", *STRATEGIES)]


@dataclass(frozen=True, config=STRICT)
class ShardingConfig:
    strategy: Strategy = "auto"
    """FSDP2 strategy for multi-process runs; `auto` lets the planner pick."""
    cpu_offload: bool = False
    """Keep sharded parameters, gradients and optimizer state in host RAM (FSDP2 CPUOffloadPolicy)."""
    param_dtype: Literal["auto", "float32", "bfloat16"] = "auto"
    """Dtype of gathered weights during compute; `auto`: the model dtype."""
    reduce_dtype: Literal["float32", "bfloat16"] = "float32"
    """Dtype gradients are reduced in; fp32 keeps small per-rank contributions from rounding away.
    DDP (no_shard) reduces gradients that are already bf16 in bf16 whatever this says, and on
    gloo (CPU) fp32 gradients in fp32 (torch's bf16 hook for DDP needs NCCL)."""
    pipeline_stages: PositiveInt | Literal["auto"] = "auto"
    """Cut the decoder blocks into this many contiguous stages, one per process, run by
    torch.distributed.pipelining (distributed/pipeline.py): the first stage holds the embeddings,
    the last the final norm, the head and the loss. The processes beyond one pipeline replicate it
    (DDP). `auto`: the planner prices pipelines (one stage per node, one per GPU) beside sharding
    and takes one when it is the fastest option that fits and the trainer runs it for this recipe
    (homelab_ft/rules/refusals.py: not with DPO, a held-out split, samples, DoRA, an 8-bit base ...);
    `plan` says why one was not offered. 1: never a pipeline."""
    stage_blocks: tuple[PositiveInt, ...] | None = None
    """Decoder blocks per stage, first to last, summing to the model's blocks (e.g. `[3, 1]`);
    default: as even as possible, earlier stages taking the remainder."""
    pipeline_schedule: Literal[PIPELINE_SCHEDULES] = "1f1b"
    """`1f1b`: each stage alternates one forward and one backward once the pipeline is full, so at
    most `pipeline_stages` micro-batches' activations wait on the first stage; `gpipe`: all
    forwards, then all backwards (every micro-batch's activations at once, same bubble)."""


@dataclass(frozen=True, config=STRICT)
class Recipe:
    name: str = "run"
    method: Method = "auto"
    """`auto` lets the planner walk the ladder: qlora, then lora, then full sharded training."""
    objective: Literal["sft", "dpo", "grpo"] = "sft"
    """`sft`: learn the answers; `dpo`: learn which of two answers is preferred (needs preference
    rows and a reference model: the base with adapters off, or cached log-probabilities for full);
    `grpo`: learn from rewards of sampled completions (the `grpo` section; docs/grpo.md)."""
    dpo: DpoConfig = Field(default_factory=DpoConfig)
    grpo: GrpoConfig = Field(default_factory=GrpoConfig)
    model: ModelConfig = Field(default_factory=ModelConfig)
    lora: LoraConfig = Field(default_factory=LoraConfig)
    quant: QuantConfig = Field(default_factory=QuantConfig)
    data: DataConfig = Field(default_factory=DataConfig)
    train: TrainConfig = Field(default_factory=TrainConfig)
    output: OutputConfig = Field(default_factory=OutputConfig)
    eval: EvalConfig = Field(default_factory=EvalConfig)
    cluster: ClusterConfig = Field(default_factory=ClusterConfig)
    sharding: ShardingConfig = Field(default_factory=ShardingConfig)
    planner: PlannerConfig = Field(default_factory=PlannerConfig)

    @property
    def world_size(self) -> int:
        return self.cluster.nodes * self.cluster.gpus_per_node

    @property
    def run_dir(self) -> Path:
        return Path(self.output.dir) if self.output.dir else Path("runs") / self.name


attach_field_docs(globals())  # help(TrainConfig) lists every field with its docstring

_RECIPE_ADAPTER = TypeAdapter(Recipe)


def load_recipe(path: str | Path, overrides: list[str] | tuple[str, ...] = ()) -> Recipe:
    """Read a recipe file, apply `section.key=value` overrides, validate strictly."""
    path = Path(path)
    raw = read_yaml_mapping(path)
    raw.setdefault("name", path.stem)
    return recipe_from_dict(raw, overrides=overrides, source=str(path))


def recipe_from_dict(raw: dict[str, Any], *, overrides=(), source: str = "recipe") -> Recipe:
    raw = apply_overrides(raw, overrides)
    try:
        recipe = _RECIPE_ADAPTER.validate_python(raw)
    except ValidationError as err:
        raise UserError(f"{source}: {explain(err, root=Recipe)}") from None
    objective_checks.check_objective(recipe, source=source)
    embedding_offload.check_named(recipe.train.embedding_offload, method=recipe.method,
                                  strategy=recipe.sharding.strategy, cpu_offload=recipe.sharding.cpu_offload,
                                  world_size=recipe.world_size, pipeline_stages=recipe.sharding.pipeline_stages)
    return recipe
