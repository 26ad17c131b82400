"""What a run leaves behind for people to read: metrics.jsonl, the trackers' stores, a loss plot.

Every row goes to metrics.jsonl and, its numbers, to each tracker of `output.report_to`
(trackers.py: TensorBoard, trackio, MLflow, W&B), so all of them hold the same values. Only the main rank writes; other ranks get a logger that does nothing, so the loop never branches
on the rank to log.
"""

from __future__ import annotations

import contextlib
import json
import logging
from pathlib import Path

from homelab_ft import fsio
from homelab_ft.store.layout import RunDir
from homelab_ft.train import trackers

log = logging.getLogger(__name__)


class MetricsLogger:
    def __init__(self, run_dir: Path, *, enabled: bool, report_to: tuple[str, ...], project: str = "homelab-ft"):
        """`report_to`: the trackers to start (`Output.trackers`); `project`: their project name."""
        self.enabled = enabled
        self.path = RunDir(run_dir).metrics_file
        self.trackers = trackers.open_trackers(run_dir, report_to, project=project) if enabled else []
        self._tb = next((t for t in self.trackers if isinstance(t, trackers.TensorBoard)), None)

    def log(self, row: dict) -> None:
        if not self.enabled:
            return
        with self.path.open("a", encoding="utf-8") as fh:
            fh.write(json.dumps(row) + "\n")
        scalars = {k: v for k, v in row.items()
                   if k != "step" and isinstance(v, (int, float)) and not isinstance(v, bool)}
        if scalars:
            for tracker in self.trackers:
                tracker.log(row["step"], scalars)

    def log_samples(self, step: int, samples: list[dict]) -> None:
        """Sampled replies (samples.py): one metrics row `{"step", "samples": [{"prompt", "completion"}]}`
        (no `loss`, so the plot skips it) and one TensorBoard text entry per step."""
        self.log({"step": step, "samples": samples})
        if self._tb is not None:
            text = "\n\n".join(f"**{s['prompt']}**\n\n{s['completion']}" for s in samples)
            self._tb.text(step, "samples", text)

    def truncate_after(self, step: int) -> None:
        """On resume, drop rows of steps after the checkpoint (they will be logged again), and a torn
        last line (a kill -9 mid-write): left in place, the next row would be appended to it."""
        if not self.enabled or not self.path.is_file():
            return
        rows = read_metrics(self.path)
        kept = [r for r in rows if r["step"] <= step]
        fsio.replace_text(self.path, "".join(json.dumps(r) + "\n" for r in kept))  # whole: a kill leaves old or new

    def close(self) -> None:
        for tracker in self.trackers:
            tracker.close()
        self.trackers = []


def peak_memory(device) -> dict:
    """The step row's measured peak, beside which `homelab-ft report` draws the plan's prediction:
    on CUDA the allocator's peak since the process started (`max_memory_allocated`, the figure the
    planner's per-GPU total predicts), elsewhere the process's peak resident set (ru_maxrss, KiB on
    Linux), which also counts torch's own libraries (a few hundred MiB the plan leaves out)."""
    if device.type == "cuda":
        import torch

        return {"peak_mem_gib": torch.cuda.max_memory_allocated(device) / 2**30}
    import resource

    return {"peak_rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 2**30}


def read_metrics(path: Path) -> list[dict]:
    """The rows of metrics.jsonl, less a torn last line.

    A row is one `write` of one line, so a kill -9 (or a full disk) can cut only the last one: it is
    left out with a warning. A bad line before the last is not a torn write and still raises.
    """
    lines = [line for line in Path(path).read_bytes().splitlines() if line.strip()]
    rows = [json.loads(line.decode("utf-8")) for line in lines[:-1]]
    if lines:
        try:  # bytes, so a cut inside a UTF-8 character is torn too
            rows.append(json.loads(lines[-1].decode("utf-8")))
        except ValueError:
            log.warning("%s: left out a torn last line (%d bytes; a write cut short, e.g. by kill -9): %.60r",
                        path, len(lines[-1]), lines[-1])
    return rows


def plot_loss(metrics_path: Path, out_png: Path) -> None:
    """Training loss per step, and eval loss where it was measured."""
    import matplotlib

    matplotlib.use("Agg")  # no display on a headless training box
    import matplotlib.pyplot as plt

    rows = read_metrics(metrics_path)
    train = [(r["step"], r["loss"]) for r in rows if "loss" in r]
    evals = [(r["step"], r["eval_loss"]) for r in rows if "eval_loss" in r]
    fig, ax = plt.subplots(figsize=(7, 4), dpi=110)
    if train:
        ax.plot(*zip(*train, strict=True), label="train loss", linewidth=1.2)
    if evals:
        ax.plot(*zip(*evals, strict=True), "o-", label="eval loss")
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("loss (mean per trained token)")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out_png)
    plt.close(fig)


def progress_bar(start: int, total: int, *, enabled: bool, desc: str = "train", unit: str = "step",
                 leave: bool = True):
    """tqdm on the main rank (loss, tokens/s, ETA); a silent stand-in elsewhere (and under -q)."""
    if not enabled:
        return _NullProgress()
    from tqdm.auto import tqdm

    return tqdm(total=total, initial=start, desc=desc, unit=unit, dynamic_ncols=True, leave=leave)


class _NullProgress(contextlib.nullcontext):
    def set_postfix(self, refresh=True, **_):
        pass

    def update(self, _):
        pass

    def write(self, _):
        pass

    def close(self):
        pass
