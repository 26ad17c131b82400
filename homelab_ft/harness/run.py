"""lm-eval's `simple_evaluate` over a model already in memory (a run's base with its adapters, or a
model folder), offline, its scores kept per task.

The model is handed to lm-eval's `hf` model (`HFLM(pretrained=<the model>)`) rather than a path, so a
run is scored with its LoRA adapters applied by PEFT, unmerged: the numbers are the checkpoint's own,
not a merge's (which `export` checks separately). Prompts go through the tokenizer's chat template
when it has one (an instruct model answers the way it was trained to be asked), greedy. The Hugging
Face libraries are put offline for the call, so a task whose data is not cached fails at once, in
one line naming the task, instead of trying the network (lm-eval's GGUF path is not used: it scores
loglikelihood tasks at chance against current llama-server, lm-eval#4158).
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import math
import os
from pathlib import Path

from homelab_ft import fsio
from homelab_ft.errors import UserError
from homelab_ft.harness import tasks as shipped_tasks

log = logging.getLogger(__name__)

OFFLINE = {"HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}


def check_tasks(names: list[str]):
    """lm-eval's task manager for `names`, each checked (a name neither shipped nor lm-eval's is refused
    in one line with the near ones), before any model loads."""
    try:
        import lm_eval.tasks  # noqa: F401
    except ImportError:
        raise UserError("homelab-ft eval runs lm-evaluation-harness, which is not installed here: "
                        "pip install 'homelab-ft[eval]' (or pip install lm-eval)") from None
    # lm-eval's own task index takes ~9 CPU s to build: only when a name is not one of ours
    ours = all(name in shipped_tasks.shipped() for name in names)
    manager = _task_manager(include_defaults=not ours)
    for name in names:
        _check_task(name, manager)
    return manager


@functools.cache
def _task_manager(*, include_defaults: bool):
    """lm-eval's TaskManager, built once per process: with lm-eval's own tasks it reads ~15k task
    configs (~9 CPU s), which a process that checks or scores tasks again (a notebook, the tests)
    need not repeat. It only indexes the installed task files, which do not change under it."""
    from lm_eval.tasks import TaskManager

    return TaskManager(include_defaults=include_defaults, verbosity="ERROR")


def evaluate(model, tokenizer, names: list[str], *, manager, limit: int | None, batch_size: int,
             device) -> dict[str, dict]:
    """{task: {metric: value}} for each of `names` (shipped or lm-eval tasks, `manager` from
    check_tasks) on `model`."""
    from lm_eval import simple_evaluate
    from lm_eval.models.huggingface import HFLM

    # lm-eval warns that a model object, not a path, was passed: meant (the module docstring says why)
    logging.getLogger("lm-eval").setLevel(logging.ERROR)
    logging.getLogger("lm_eval").setLevel(logging.ERROR)
    lm = HFLM(pretrained=model, tokenizer=tokenizer, batch_size=batch_size, device=str(device))
    chat = bool(getattr(tokenizer, "chat_template", None))
    with _offline():
        try:
            out = simple_evaluate(model=lm, tasks=shipped_tasks.resolve(names), limit=limit, apply_chat_template=chat,
                                  log_samples=False, bootstrap_iters=0, verbosity="ERROR", task_manager=manager)
        except Exception as e:  # noqa: BLE001 (lm-eval's failures on a task's data are many kinds)
            raise UserError(_why(names, e)) from e
    return {task: _scores(values) for task, values in out["results"].items()}


def _scores(values: dict) -> dict[str, float]:
    """lm-eval's `metric,filter` keys as `metric` (the filter named when not `none`), stderr left out."""
    scores = {}
    for key, value in values.items():
        metric, _, filt = key.partition(",")
        if not filt or "stderr" in metric or not isinstance(value, (int, float)):
            continue
        scores[metric if filt == "none" else f"{metric} ({filt})"] = float(value)
    return scores


def _check_task(name: str, manager) -> None:
    """A name that is neither shipped nor one of lm-eval's tasks: refused with the near ones."""
    if name in shipped_tasks.shipped():
        return
    import difflib

    known = manager.all_tasks
    if name not in known:
        near = difflib.get_close_matches(name, [*shipped_tasks.shipped(), *known], n=3)
        raise UserError(f"--tasks: no task {name!r}" + (f"; did you mean {', '.join(near)}?" if near else "")
                        + f" (shipped: {', '.join(shipped_tasks.shipped())}; lm-eval's: `lm-eval ls tasks`)")


def _why(names: list[str], err: Exception) -> str:
    text = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
    offline = any(w in text.lower() for w in ("offline", "connection", "couldn't reach", "not found on the hub",
                                              "couldn't find", "doesn't exist on the hub", "not cached"))
    if offline:
        return (f"task {', '.join(names)}: its data is not in the local Hugging Face datasets cache and homelab-ft "
                f"never downloads ({text}); download it once with network (`lm-eval run --tasks {names[0]} --limit 1 "
                "--model dummy` or datasets.load_dataset), or use a shipped task")
    return f"lm-eval failed on {', '.join(names)}: {type(err).__name__}: {text}"


@contextlib.contextmanager
def _offline():
    saved = {k: os.environ.get(k) for k in OFFLINE}
    os.environ.update(OFFLINE)
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def write(results: dict[str, dict], folder: Path, *, about: dict) -> list[Path]:
    """Each task's scores as `folder/<task>.json` ({"task", "scores", **about}), written whole or not at all."""
    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    for task, scores in results.items():
        path = folder / f"{task}.json"
        tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
        try:
            tmp.write_text(json.dumps({"task": task, "scores": scores, **about}, indent=1) + "\n")
            os.replace(tmp, path)
        except OSError as e:
            tmp.unlink(missing_ok=True)
            raise UserError(f"cannot write {path}: {fsio.describe(e) or e}") from e
        paths.append(path)
    return paths


def table(after: dict[str, dict], before: dict[str, dict] | None = None) -> list[str]:
    """One line per task and metric: the score, and with `before` (the base) the change."""
    lines = []
    for task, scores in after.items():
        for metric, value in scores.items():
            if before is None:
                lines.append(f"{task:24s} {metric:28s} {value:.4f}")
            else:
                old = before.get(task, {}).get(metric, math.nan)
                lines.append(f"{task:24s} {metric:28s} {old:.4f} -> {value:.4f} ({value - old:+.4f})")
    return lines
