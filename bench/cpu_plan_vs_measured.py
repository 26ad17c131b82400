"""The CPU recipes' planned step time against real steps (issue 39): planned s/step, measured wall and
CPU s/step, side by side in one run.

    .venv/bin/python bench/cpu_plan_vs_measured.py                      # every recipes/*cpu*.yaml
    .venv/bin/python bench/cpu_plan_vs_measured.py recipes/smollm2-lora-cpu.yaml --steps 4

For each recipe: `homelab-ft data inspect` first (so the plan has the rows' measured lengths, as a
user's second plan has), then `homelab-ft plan --json` (the planner's step_s), then `homelab-ft
train` of STEPS steps in a child process that logs every step, with the recipe's own threads. The
first step is warm-up (allocations, oneDNN's kernel choice, a GRPO run's first generation) and is
left out; the figures are medians over the rest. Wall s/step comes from the run's metrics.jsonl
(time_s between steps); CPU s/step from the child's time.process_time() at each logged step (user +
system time of all its threads, what resource.getrusage counts), which another job on a shared
machine disturbs far less than wall time: on an idle machine of C cores a step's CPU seconds are
about C x its wall seconds, so `cpu/C` is the wall time the step would take idle. A torchrun recipe
(several processes) reports wall time only. ratio = measured wall / planned; idle = (CPU s / cores)
/ planned.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
STEPS = 4


def child(recipe: str, run_dir: str, steps: int, out: str) -> None:
    """Run in the child: train with the logger patched to note each row's process CPU time."""
    sys.path.insert(0, str(ROOT))
    from homelab_ft.cli.main import main
    from homelab_ft.train import metrics

    marks = []
    log = metrics.MetricsLogger.log

    def noted(self, row: dict) -> None:
        if "step" in row and "tokens_per_s" in row:
            marks.append({"step": row["step"], "cpu_s": time.process_time(), "wall_s": row["time_s"],
                          "tokens": row["tokens"]})
        log(self, row)

    metrics.MetricsLogger.log = noted
    code = main(["train", recipe, f"train.max_steps={steps}", "train.log_every=1", "train.eval_every=0",
                 "train.save_every=0", "train.eval_max_batches=1", "output.overwrite=true", "--run-dir", run_dir, "-q"])
    Path(out).write_text(json.dumps(marks))
    sys.exit(code)


def planned(recipe: str) -> dict:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    subprocess.run([sys.executable, "-m", "homelab_ft", "data", "inspect", recipe], env=env, check=True,
                   capture_output=True)
    out = subprocess.run([sys.executable, "-m", "homelab_ft", "plan", recipe, "--json"], env=env, check=False,
                         capture_output=True, text=True).stdout
    plan = json.loads(out)
    return {"step_s": plan["chosen"]["step_s"], "cores": _cores(plan), "processes": plan["cluster"]["gpus_per_node"]}


def _cores(plan: dict) -> float:
    return len(os.sched_getaffinity(0)) / plan["cluster"]["gpus_per_node"]


def measured(recipe: str, *, steps: int, tmp: Path) -> dict:
    run_dir, out = tmp / Path(recipe).stem, tmp / f"{Path(recipe).stem}.json"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_DISABLE_PROGRESS_BARS": "1", "TRANSFORMERS_VERBOSITY": "error"}
    env.pop("OMP_NUM_THREADS", None)  # the recipe's own threads (train.num_threads, else torch's choice)
    subprocess.run([sys.executable, __file__, "--child", recipe, str(run_dir), str(steps), str(out)], env=env,
                   check=True, capture_output=True)
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if "tokens_per_s" in r]
    wall = [b["time_s"] - a["time_s"] for a, b in zip(rows, rows[1:], strict=False)]
    marks = json.loads(out.read_text()) if out.exists() else []
    cpu = [b["cpu_s"] - a["cpu_s"] for a, b in zip(marks, marks[1:], strict=False)]
    return {"wall_s": statistics.median(wall), "cpu_s": statistics.median(cpu) if cpu else None,
            "tokens": statistics.median(r["tokens"] for r in rows[1:])}


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        child(sys.argv[2], sys.argv[3], int(sys.argv[4]), sys.argv[5])
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("recipes", nargs="*", default=sorted(str(p) for p in (ROOT / "recipes").glob("*cpu*.yaml")))
    parser.add_argument("--steps", type=int, default=STEPS)
    args = parser.parse_args()
    print(f"{'recipe':24s} {'planned':>8s} {'wall':>7s} {'cpu':>7s} {'cores':>5s} {'wall/plan':>9s} {'idle/plan':>9s}"
          f" {'tokens':>7s}   (s/step; load average at start {os.getloadavg()[0]:.2f})")
    with tempfile.TemporaryDirectory(prefix="cpu-plan-") as tmp:
        for recipe in args.recipes:
            plan = planned(recipe)
            got = measured(recipe, steps=args.steps, tmp=Path(tmp))
            cpu, cores = got["cpu_s"], plan["cores"]
            idle = f"{cpu / cores / plan['step_s']:9.2f}" if cpu is not None else f"{'-':>9s}"
            cpu_text = f"{cpu:7.2f}" if cpu is not None else f"{'-':>7s}"
            print(f"{Path(recipe).stem:24s} {plan['step_s']:8.2f} {got['wall_s']:7.2f} {cpu_text} {cores:5g} "
                  f"{got['wall_s'] / plan['step_s']:9.2f} {idle} {got['tokens']:7.0f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
