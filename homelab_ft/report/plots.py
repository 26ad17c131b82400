"""The report's pictures, one PNG each, drawn with matplotlib's Agg backend (no display needed).

Each function takes the metrics rows (metrics.jsonl, read by train/metrics.py) and returns a figure
or None when the run has nothing to draw for it, so a report never shows an empty axis.
"""

from __future__ import annotations

import math

STEP_KEYS = frozenset({"step", "loss", "lr", "grad_norm", "tokens", "trained_tokens", "tokens_per_s", "epoch",
                       "time_s", "peak_mem_gib", "peak_rss_gib", "eval_loss"})
"""The columns every objective writes (steps.StepResult.row, metrics.peak_memory, evaluate.py), drawn
in their own plots; any other number (DPO's rewards and log-probs, GRPO's rewards, KL and clip ratios,
their `eval_` twins) is drawn by `objective_figure`."""

MEMORY_KEYS = {"peak_mem_gib": "GPU peak allocated (max_memory_allocated)",
               "peak_rss_gib": "process peak resident set (ru_maxrss)"}


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _series(rows: list[dict], key: str) -> tuple[list[int], list[float]]:
    points = [(r["step"], r[key]) for r in rows if is_number(r.get(key))]
    return [p[0] for p in points], [p[1] for p in points]


def is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _steps_axis(ax, *, label: bool = True) -> None:
    """Whole optimizer steps on the x axis (matplotlib would tick 1.25, 1.5 on a short run)."""
    from matplotlib.ticker import MaxNLocator

    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    if label:
        ax.set_xlabel("optimizer step")


def loss_figure(rows: list[dict]):
    """Train loss per step with the held-out loss where it was measured, and the learning rate below."""
    steps, loss = _series(rows, "loss")
    if not steps:
        return None
    plt = _pyplot()
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(8, 6), dpi=100, sharex=True, height_ratios=(2, 1))
    top.plot(steps, loss, label="train loss", linewidth=1.2)
    eval_steps, eval_loss = _series(rows, "eval_loss")
    if eval_steps:
        top.plot(eval_steps, eval_loss, "o-", label="eval loss")
    top.set_ylabel("loss")
    top.legend()
    top.grid(alpha=0.3)
    lr_steps, lr = _series(rows, "lr")
    bottom.plot(lr_steps, lr, color="tab:green")
    bottom.set_ylabel("learning rate")
    _steps_axis(bottom)
    bottom.grid(alpha=0.3)
    fig.tight_layout()
    return fig


def throughput_figure(rows: list[dict], *, predicted_gib: float | None):
    """Tokens/s per step, and the measured peak memory per step beside the plan's predicted peak."""
    steps, tokens = _series(rows, "tokens_per_s")
    if not steps:
        return None
    plt = _pyplot()
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(8, 6), dpi=100, sharex=True)
    top.plot(steps, tokens, color="tab:purple")
    top.set_ylabel("tokens / s (read)")
    top.grid(alpha=0.3)
    for key, label in MEMORY_KEYS.items():
        mem_steps, mem = _series(rows, key)
        if mem_steps:
            bottom.plot(mem_steps, mem, label=f"measured: {label}")
    if predicted_gib is not None:
        bottom.axhline(predicted_gib, color="tab:red", linestyle="--", label=f"plan: {predicted_gib:.2f} GiB per device")
    bottom.set_ylabel("memory (GiB)")
    _steps_axis(bottom)
    bottom.grid(alpha=0.3)
    if bottom.get_legend_handles_labels()[0]:
        bottom.legend(fontsize=8)
    fig.tight_layout()
    return fig


def objective_keys(rows: list[dict]) -> list[str]:
    """The objective's own metrics in the rows (a key and its `eval_` twin share one panel), in first-seen order."""
    keys: dict[str, None] = {}
    for row in rows:
        for key, value in row.items():
            if key not in STEP_KEYS and is_number(value):
                keys[key.removeprefix("eval_")] = None
    return list(keys)


def objective_figure(rows: list[dict]):
    """One small panel per DPO/GRPO metric (train and held-out), or None for a plain SFT run."""
    keys = objective_keys(rows)
    if not keys:
        return None
    plt = _pyplot()
    cols = min(3, len(keys))
    nrows = math.ceil(len(keys) / cols)
    fig, axes = plt.subplots(nrows, cols, figsize=(4 * cols, 2.8 * nrows), dpi=100, squeeze=False)
    for ax, key in zip(axes.flat, keys, strict=False):
        for name, style in ((key, "-"), (f"eval_{key}", "o-")):
            steps, values = _series(rows, name)
            if steps:
                ax.plot(steps, values, style, label=name, linewidth=1.1, markersize=3)
        ax.set_title(key, fontsize=9)
        _steps_axis(ax, label=False)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    for ax in list(axes.flat)[len(keys):]:
        ax.set_visible(False)
    fig.tight_layout()
    return fig


def save(fig, path) -> None:
    plt = _pyplot()
    fig.savefig(path)
    plt.close(fig)
