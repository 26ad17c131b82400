"""`make demo` end to end: score the base model, LoRA fine-tune, export, score the reloaded export.

The task, its shipped data and its scorer are sft.py's (which also holds the measured wall times);
this module is the orchestration around them, and what `homelab-ft demo` calls. `run_shapes_demo`
is the same for the image task (`homelab-ft demo --task shapes`, `make demo-shapes`): shapes.py's
pictures and scorer, shapes_model.py's tiny SmolVLM, recipes/smolvlm-shapes-cpu.yaml.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path

from homelab_ft.demo import sft, shapes
from homelab_ft.demo.sft import DemoScore
from homelab_ft.demo.shapes import ShapesScore

DEMO_RECIPE = Path(__file__).resolve().parents[2] / "recipes" / "smollm2-lora-cpu.yaml"
SHAPES_RECIPE = DEMO_RECIPE.with_name("smolvlm-shapes-cpu.yaml")
SHAPES_WORK = Path("runs/smolvlm-shapes")
"""Where the image recipe finds its base model (`base/`) and pictures (`data/`), built once."""

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class DemoResult:
    before: DemoScore
    after: DemoScore
    run_dir: Path
    export_dir: Path
    seconds: dict[str, float]
    """Wall time of each phase (convert, score base, train, export, score export, score gguf)."""
    gguf: DemoScore | None = None
    """The score of export/model-q8_0.gguf reloaded through transformers' GGUF loader."""
    report: Path | None = None
    """runs/demo/report/report.html: the run's curves, memory against the plan (`homelab-ft report`)."""


class _Stopwatch:
    """Wall time of each phase, in the order they ran."""

    def __init__(self):
        self.seconds: dict[str, float] = {}
        self._start = time.perf_counter()

    def lap(self, name: str) -> None:
        now = time.perf_counter()
        self.seconds[name] = now - self._start
        self._start = now


def run_demo(
    *,
    run_dir: Path = Path("runs/demo"),
    recipe_path: Path = DEMO_RECIPE,
    overrides: tuple[str, ...] = (),
    num_eval_rows: int | None = None,
    num_examples: int = 3,
) -> DemoResult:
    """Score the base on the held-out rows, LoRA fine-tune, export, reload the export, score again.

    The run directory belongs to the demo: a second `make demo` trains again from scratch
    (`output.overwrite`), and the export lives inside it, so it goes with the run it came from.
    """
    from homelab_ft.export.run import export_run
    from homelab_ft.model import loading
    from homelab_ft.plan import planner
    from homelab_ft.report.page import write_report
    from homelab_ft.rung import rung_for
    from homelab_ft.train import trainer

    run_dir = Path(run_dir)
    recipe = _demo_recipe(recipe_path, overrides, run_dir=run_dir)
    rows = sft.read_rows("eval")[:num_eval_rows]
    watch = _Stopwatch()
    model_dir = loading.resolve_model_dir(recipe.model.path)
    watch.lap("convert")
    log.info("held-out task: %d sentences about people whose names and cities never occur in training", len(rows))
    before = _score_folder(model_dir, rows)
    log.info("base model:       %s", before.summary())
    watch.lap("score base")

    trainer.train(recipe, plan=planner.plan_for_recipe(recipe).to_dict(), rung=rung_for(recipe))
    watch.lap("train")
    export_dir = run_dir.parent / f"{run_dir.name}-export"  # beside the run: export refuses an --out inside one
    from homelab_ft.cli.export import eval_rows

    export = export_run(run_dir, export_dir, overwrite=True, formats="safetensors,gguf",
                        eval_rows=lambda: eval_rows(run_dir))
    watch.lap("export")
    if export.quality:
        log.info("%s", export.quality.line())

    # Exactly what a user does with the export: plain transformers, no homelab-ft, no PEFT.
    after = _score_folder(export_dir, rows)
    watch.lap("score export")
    gguf = _score_gguf(export.gguf_path, rows)
    watch.lap("score gguf")
    report = write_report(run_dir)  # what `homelab-ft report runs/demo` writes: curves, memory vs plan
    watch.lap("report")
    log.info(summary(before, after, export_dir=export_dir, seconds=watch.seconds, num_examples=num_examples, gguf=gguf,
                     gguf_name=export.gguf_path.name, report=report))
    return DemoResult(before=before, after=after, run_dir=run_dir, export_dir=export_dir, seconds=watch.seconds,
                      gguf=gguf, report=report)


@dataclass(frozen=True)
class ShapesDemoResult:
    before: ShapesScore
    after: ShapesScore
    run_dir: Path
    export_dir: Path
    seconds: dict[str, float]
    """Wall time of each phase (build, score base, train, export, score export)."""


def run_shapes_demo(*, run_dir: Path = Path("runs/smolvlm-shapes-cpu"), work_dir: Path = SHAPES_WORK,
                    model_dir: Path | None = None, overrides: tuple[str, ...] = (), num_examples: int = 3
                    ) -> ShapesDemoResult:
    """The image task: build what is missing (the pictures, and the tiny SmolVLM unless `model_dir`
    is given), score the base on the held-out pictures, fine-tune, export, score the reloaded export."""
    from homelab_ft.export.run import export_run
    from homelab_ft.plan import planner
    from homelab_ft.rung import rung_for
    from homelab_ft.train import trainer

    run_dir, watch = Path(run_dir), _Stopwatch()
    base, train_file, eval_file = prepare_shapes(Path(work_dir), model_dir=model_dir)
    watch.lap("build")
    recipe = _demo_recipe(SHAPES_RECIPE, (f"model.path={base}", f"data.sources=[{{path: '{train_file}'}}]",
                                          f"data.eval_sources=[{{path: '{eval_file}'}}]", *overrides), run_dir=run_dir)
    rows = shapes.read_rows(eval_file)
    log.info("held-out task: %d new pictures, each asked its colour, its shape or how many shapes it holds", len(rows))
    before = _score_vlm(base, rows, eval_file)
    log.info("base model:       %s", before.summary())
    watch.lap("score base")
    trainer.train(recipe, plan=planner.plan_for_recipe(recipe).to_dict(), rung=rung_for(recipe))
    watch.lap("train")
    export_dir = run_dir.parent / f"{run_dir.name}-export"
    export_run(run_dir, export_dir, overwrite=True, formats="safetensors")
    watch.lap("export")
    after = _score_vlm(export_dir, rows, eval_file)
    watch.lap("score export")
    log.info(shapes_summary(before, after, export_dir=export_dir, seconds=watch.seconds, num_examples=num_examples))
    return ShapesDemoResult(before=before, after=after, run_dir=run_dir, export_dir=export_dir, seconds=watch.seconds)


def prepare_shapes(work_dir: Path, *, model_dir: Path | None = None) -> tuple[Path, Path, Path]:
    """(base model, training rows, held-out rows) of the image task, written under `work_dir` where
    missing (the same bytes each time: both are seeded)."""
    from homelab_ft.demo import shapes_model

    data = work_dir / "data"
    train_file, eval_file = data / "train.jsonl", data / "eval.jsonl"
    if not (train_file.is_file() and eval_file.is_file()):
        shapes.write_dataset(data)
    base = model_dir or work_dir / "base"
    if not (base / "config.json").is_file():
        shapes_model.build_from_smollm2(base)
    return base, train_file, eval_file


def _score_vlm(model_dir: Path, rows: list[dict], data_file: Path) -> ShapesScore:
    """A model folder's score, loaded in fp32 by plain transformers with its own processor."""
    import torch
    from transformers import AutoModelForImageTextToText, AutoProcessor

    model = AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32)
    return shapes.score(model, AutoProcessor.from_pretrained(model_dir), rows, data_file=data_file)


def shapes_summary(before: ShapesScore, after: ShapesScore, *, export_dir: Path, seconds: dict[str, float],
                   num_examples: int) -> str:
    """The image task's before/after table, a few held-out replies side by side, and the time."""
    lines = [
        "",
        f"held-out score ({before.num_rows} new pictures; a reply counts when it is exactly the answer word)",
        f"  base (random weights)        {before.summary()}",
        f"  fine-tuned, reloaded export  {after.summary()}",
        "",
    ]
    pairs = list(zip(before.replies, after.replies, strict=True))
    stride = len(pairs) // max(1, num_examples) + 1  # + 1: the rows cycle through the 3 kinds
    for old, new in pairs[::stride][:num_examples]:
        lines += [f"  {old.question:32s} answer {old.expected!r:10s} base {_one_line(old.got, 20)!r:24s} "
                  f"fine-tuned {new.got.strip()!r} [{'correct' if new.correct else 'wrong'}]"]
    timing = ", ".join(f"{name} {secs:.0f}s" for name, secs in seconds.items())
    lines += ["", f"time: {timing}; total {sum(seconds.values()) / 60:.1f} min", f"exported model: {export_dir}"]
    return "\n".join(lines)


def _demo_recipe(recipe_path: Path, overrides: tuple[str, ...], *, run_dir: Path):
    """The shipped demo recipe, writing into (and replacing) the demo's own run directory."""
    from homelab_ft.errors import UserError
    from homelab_ft.recipe.config import load_recipe

    if not Path(recipe_path).is_file():
        raise UserError(f"the demo recipe {recipe_path} is missing; run the demo from a checkout of homelab-ft")
    return load_recipe(recipe_path, [*overrides, f"output.dir={run_dir}", "output.overwrite=true"])


def _score_folder(model_dir: Path, rows: list[dict]) -> DemoScore:
    """A model folder's score, loaded in fp32 by plain transformers with its own tokenizer."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    return sft.score(model, tokenizer, rows)


def _score_gguf(gguf_path: Path, rows: list[dict]) -> DemoScore:
    """What llama.cpp / Ollama users get, read back by transformers' GGUF loader."""
    from homelab_ft.export.gguf.check import load_gguf

    model, tokenizer = load_gguf(gguf_path)
    return sft.score(model, tokenizer, rows)


def summary(before: DemoScore, after: DemoScore, *, export_dir: Path, seconds: dict[str, float], num_examples: int,
            gguf: DemoScore | None = None, gguf_name: str = "", report: Path | None = None) -> str:
    """The before/after table, a few held-out replies side by side, and where the time went."""
    lines = [
        "",
        f"held-out score ({before.num_rows} rows; a reply counts when json.loads gives exactly the expected record)",
        f"  base SmolLM2-135M-Instruct   {before.summary()}",
        f"  fine-tuned, reloaded export  {after.summary()}",
    ]
    if gguf is not None:
        lines.append(f"  the same, as {gguf_name:15s} {gguf.summary()}")
    lines += [
        "",
    ]
    pairs = list(zip(before.examples, after.examples, strict=True))
    # spread over the split, so the examples show different sentence shapes
    stride = max(1, len(pairs) // max(1, num_examples))
    for old, new in pairs[::stride][:num_examples]:
        lines += [
            f"  user:       {old.prompt}",
            f"  base:       {_one_line(old.got)}",
            f"  fine-tuned: {_one_line(new.got)}   [{'correct' if new.correct else 'wrong'}]",
            "",
        ]
    timing = ", ".join(f"{name} {secs:.0f}s" for name, secs in seconds.items())
    lines += [f"time: {timing}; total {sum(seconds.values()) / 60:.1f} min", f"exported model: {export_dir}"]
    if report is not None:
        lines.append(f"report (loss, lr, tokens/s, memory vs plan): {report}")
    return "\n".join(lines)


def _one_line(text: str, limit: int = 110) -> str:
    flat = " ".join(text.split())
    return flat if len(flat) <= limit else flat[: limit - 3] + "..."
