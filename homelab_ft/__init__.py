"""homelab-ft: fine-tune open-weight LLMs on your own GPUs.

A run flows recipe -> plan -> model -> data -> loop -> checkpoint -> export, one sub-package per
stage (docs/architecture.md says who calls what):

    cli          the commands: parse, call one function below, print, exit codes
    plan         pure: the model's shape, what each option costs, the ladder, the plan and its text
    data         sources -> formats -> chat template -> tokens + loss mask -> pack -> batches
    model        load, quantize, attach adapters, find the blocks, compile; knows nothing of ranks
    distributed  process group, FSDP2 / DDP / pipeline stages, sharded loading
    train        the model for a rung, the one loop, the steps and objectives, preflight
    store        the run directory as a type, checkpoints, manifests, locks
    export       merged safetensors, GGUF, the files local runtimes read
    cluster      launch, the handoff every worker receives, supervise, doctor
    harness      after the run: lm-evaluation-harness on a run or a model folder, the shipped tasks
    report       after the run: `homelab-ft report`, one HTML page of its curves, memory and scores
    demo         the `make demo` tasks

The shared vocabulary, torch-free and imported by every stage:

    recipe         the recipe's typed sections, YAML reading and bounds
    rules          one rule each that the planner prices and the runtime runs
    rung           `Rung`: the whole description of what runs, validated in one place
    model_facts    what the builder asks of a model (blocks, experts, vocab, tying), answered once by the planner
    locate         where a model lives (local folder, GGUF, embedded, HF cache) and its config
    errors, logs   `UserError` (one line, exit 2); the CLI's logging and the rank-zero filter
    fsio           file-system failures as one line naming the path and the fix; written files' mode
    host, labels   this machine's RAM; `IGNORE_INDEX`
    torch_support  the oldest torch homelab-ft runs on, checked from torch's metadata at start-up
"""

__version__ = "0.1.0"
