"""`homelab-ft report RUN`: one HTML page per run, with its pictures, in RUN/report/.

The page reads only what the run folder holds: metrics.jsonl (train and eval rows), run.json (the
rung), plan.json (the predicted peak per device) and eval/<task>.json (`homelab-ft eval`'s scores).
The PNGs are written beside report.html and embedded in it as base64, so the page opens offline and
still shows its pictures when copied alone.

Written atomically: the whole folder is built as RUN/.report.tmp-<pid> and renamed into place, so a
kill leaves the previous report or the new one, never a page that looks complete and is not.
"""

from __future__ import annotations

import base64
import html
import json
import logging
import os
import shutil
import statistics
from pathlib import Path

from homelab_ft.errors import UserError
from homelab_ft.report import plots
from homelab_ft.store.layout import RunDir
from homelab_ft.train.metrics import read_metrics

log = logging.getLogger(__name__)

PAGE = "report.html"
FIGURES = {"loss.png": "Loss and learning rate", "throughput.png": "Throughput and memory",
           "objective.png": "Objective metrics (DPO / GRPO)"}


def write_report(run_dir: Path) -> Path:
    """Draw and write RUN/report/report.html (and its PNGs); returns the page's path.

    A folder that is not a run, or a run with no metrics yet, is one UserError naming it.
    """
    layout = RunDir(run_dir)
    info = layout.read_info()  # one line for a folder that is not a run
    if not layout.metrics_file.is_file():
        raise UserError(f"{layout.root}: no {layout.metrics_file.name} yet; the report is drawn from a run that "
                        "has trained at least one step")
    rows = read_metrics(layout.metrics_file)
    plan = _plan(layout)
    predicted = plan["memory"]["total"] / 2**30 if plan else None
    figures = {"loss.png": plots.loss_figure(rows),
               "throughput.png": plots.throughput_figure(rows, predicted_gib=predicted),
               "objective.png": plots.objective_figure(rows)}
    tmp = layout.root / f".report.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        images = {}
        for name, fig in figures.items():
            if fig is not None:
                plots.save(fig, tmp / name)
                images[name] = base64.b64encode((tmp / name).read_bytes()).decode("ascii")
        page = _page(layout, info=info, rows=rows, plan=plan, images=images, scores=_eval_scores(layout))
        (tmp / PAGE).write_text(page, encoding="utf-8")
        _swap_in(tmp, layout.report_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return layout.report_dir / PAGE


def _swap_in(tmp: Path, target: Path) -> None:
    """Replace `target` with the finished `tmp`: the old folder is renamed aside first (a folder cannot
    be renamed over a non-empty one), then removed."""
    old = target.with_name(f".report.old-{os.getpid()}")
    if target.exists():
        os.replace(target, old)
    os.replace(tmp, target)
    shutil.rmtree(old, ignore_errors=True)


def _plan(layout: RunDir) -> dict | None:
    """The chosen option of plan.json (its `memory.total` is the predicted peak per device), or None
    for a run trained without a plan or a plan.json that does not read."""
    if not layout.plan_file.is_file():
        return None
    try:
        chosen = json.loads(layout.plan_file.read_text(encoding="utf-8")).get("chosen")
    except ValueError:
        log.warning("%s does not read as JSON; the report leaves the plan out", layout.plan_file)
        return None
    return chosen if isinstance(chosen, dict) and "memory" in chosen else None


def _eval_scores(layout: RunDir) -> list[dict]:
    """Every eval/<task>.json that reads, sorted by task."""
    found = []
    for path in sorted(layout.eval_dir.glob("*.json")) if layout.eval_dir.is_dir() else []:
        try:
            found.append(json.loads(path.read_text(encoding="utf-8")))
        except ValueError:
            log.warning("%s does not read as JSON; left out of the report", path)
    return found


def _page(layout: RunDir, *, info, rows: list[dict], plan: dict | None, images: dict[str, str],
          scores: list[dict]) -> str:
    e = html.escape
    summary = "".join(f"<tr><th>{e(k)}</th><td>{e(v)}</td></tr>" for k, v in _summary(info, rows, plan))
    pictures = "".join(f'<h2>{e(FIGURES[name])}</h2><img alt="{e(FIGURES[name])}" src="data:image/png;base64,{data}">'
                       for name, data in images.items())
    return f"""<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>homelab-ft report: {e(layout.root.name)}</title>
<style>body{{font-family:sans-serif;max-width:60rem;margin:2rem auto;padding:0 1rem}}
table{{border-collapse:collapse;margin:1rem 0}}th,td{{border:1px solid #ccc;padding:.3rem .6rem;text-align:left}}
img{{max-width:100%}}</style></head>
<body><h1>Run {e(layout.root.name)}</h1>
<table>{summary}</table>
{pictures}
{_eval_table(scores)}
</body></html>
"""


def _summary(info, rows: list[dict], plan: dict | None) -> list[tuple[str, str]]:
    """The page's first table: what ran, how far, how fast, and memory measured against the plan."""
    train = [r for r in rows if "loss" in r]
    evals = [r for r in rows if "eval_loss" in r]
    lines = [("rung", info.rung.label), ("model", info.model_dir), ("processes", str(info.world_size)),
             ("parameters", f"{info.params:,}"), ("steps logged", str(len(train)))]
    if train:
        lines.append(("train loss", f"{train[0]['loss']:.4f} (step {train[0]['step']}) -> "
                                    f"{train[-1]['loss']:.4f} (step {train[-1]['step']})"))
    if evals:
        lines.append(("eval loss", f"{evals[-1]['eval_loss']:.4f} (step {evals[-1]['step']})"))
    speeds = [r["tokens_per_s"] for r in train if "tokens_per_s" in r]
    if speeds:
        lines.append(("tokens / s", f"median {statistics.median(speeds):,.0f}"))
    for key, label in plots.MEMORY_KEYS.items():
        peaks = [r[key] for r in rows if key in r]
        if peaks:
            lines.append((f"measured peak: {label}", f"{max(peaks):.2f} GiB"))
    if plan:
        lines.append(("plan: predicted peak per device", f"{plan['memory']['total'] / 2**30:.2f} GiB ({plan.get('reason', '')})"))
    return lines


def _eval_table(scores: list[dict]) -> str:
    """homelab-ft eval's scores, with the base model's beside them when --baseline scored it."""
    if not scores:
        return ""
    e = html.escape
    body = []
    for result in scores:
        task = result.get("task", "?")
        before = (result.get("baseline") or {}).get(task, {})
        for metric, value in (result.get("scores") or {}).items():
            if not plots.is_number(value):
                continue
            old = before.get(metric)
            base = f"{old:.4f}" if plots.is_number(old) else ""
            body.append(f"<tr><td>{e(task)}</td><td>{e(metric)}</td><td>{base}</td><td>{value:.4f}</td></tr>")
    return ("<h2>Evaluation (homelab-ft eval)</h2><table><tr><th>task</th><th>metric</th><th>base</th>"
            f"<th>this run</th></tr>{''.join(body)}</table>")
