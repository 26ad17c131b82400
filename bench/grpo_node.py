"""GRPO on one process against a rollout node, waiting (grpo.max_staleness 0) and overlapped (1).

The same tiny job as bench/grpo_step.py (LoRA r16 on a 20M-parameter Llama, 4 prompts x 8
generations of <= 32 tokens per step), each contender started as a user starts it, `homelab-ft
train` (torchrun for the two-process ones), on this machine's 2 cores:

- `colocated`: one process with 2 threads generates and trains;
- `node-wait`: 2 processes of 1 thread, the trainer and the rollout rank, taking turns;
- `node-ahead`: the same with max_staleness 1, the rollout rank generating the next step's batch
  while the trainer trains this one (truncated importance sampling corrects the lag).

Per step: the median wall time between logged steps after a warm-up step (metrics.jsonl's time_s)
and the completion tokens generated; per CPU second: every completion token of the run over the
CPU time of the whole `homelab-ft train` process tree (resource.getrusage of the children: startup
included, for all contenders alike). The plan's predicted step (plan.json) is printed beside the
measured one. Contenders interleaved over ROUNDS, each keeping its best round.
"""

from __future__ import annotations

import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT))

import grpo_step  # noqa: E402  (the shared job: model, prompts, reward)

STEPS = 6
WARMUP = 1
ROUNDS = 2
CONTENDERS = {"colocated": {"procs": 1, "threads": 2, "grpo": {"rollout": "colocated"}},
              "node-wait": {"procs": 2, "threads": 1, "grpo": {"rollout": "node", "max_staleness": 0}},
              "node-ahead": {"procs": 2, "threads": 1, "grpo": {"rollout": "node", "max_staleness": 1}}}


def recipe(tmp: Path, name: str, spec: dict) -> Path:
    body = {
        "name": name, "method": "lora", "objective": "grpo",
        "grpo": {"num_generations": grpo_step.G, "max_completion_length": grpo_step.COMPLETION,
                 "reward_funcs": ["rewards.py:reward"], "log_completions_every": 0, **spec["grpo"]},
        "model": {"path": str(tmp / "model"), "dtype": "float32"},
        "lora": {"r": 16, "alpha": 32, "dropout": 0.0, "target_modules": "all-linear"},
        "data": {"sources": [{"path": "prompts.jsonl"}], "max_length": 256, "shuffle": False,
                 "cache_dir": str(tmp / "cache")},
        "train": {"max_steps": WARMUP + STEPS, "micro_batch_size": grpo_step.PROMPTS, "device": "cpu", "lr": grpo_step.LR,
                  "lr_schedule": "constant", "save_every": 0, "num_threads": spec["threads"]},
        "output": {"dir": str(tmp / "runs" / name), "overwrite": True, "tensorboard": False},
        "cluster": {"nodes": 1, "gpus_per_node": spec["procs"], "device": "cpu"},
        "sharding": {"strategy": "no_shard"},
    }
    path = tmp / f"{name}.yaml"
    path.write_text(yaml.safe_dump(body))
    return path


def run(tmp: Path, name: str, spec: dict) -> dict:
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    env = {**os.environ, "HF_DATASETS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": str(spec["threads"]),
           "PYTHONPATH": str(tmp)}  # rewards.py imports the shared reward from there
    out = subprocess.run([sys.executable, "-m", "homelab_ft", "train", str(recipe(tmp, name, spec))], cwd=tmp,
                         env=env, capture_output=True, text=True)
    if out.returncode:
        raise SystemExit(f"{name} failed:\n{out.stderr[-4000:]}")
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu_s = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    folder = tmp / "runs" / name
    rows = [r for r in map(json.loads, (folder / "metrics.jsonl").read_text().splitlines()) if "loss" in r]
    times = [r["time_s"] for r in rows]
    tokens = [r["completions/mean_length"] * grpo_step.PROMPTS * grpo_step.G for r in rows]
    plan = json.loads((folder / "plan.json").read_text()) if (folder / "plan.json").is_file() else {}
    return {"wall_s": statistics.median(b - a for a, b in zip(times[WARMUP:-1], times[WARMUP + 1:], strict=True)),
            "generation_s": statistics.median(r["generation_s"] for r in rows[WARMUP + 1:]),
            "tokens": statistics.median(tokens[WARMUP + 1:]), "all_tokens": sum(tokens), "cpu_s": cpu_s,
            "planned_s": (plan.get("chosen") or {}).get("step_s")}


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp_str:
        tmp = Path(tmp_str)
        grpo_step.setup(tmp)
        best: dict[str, dict] = {}
        for _ in range(ROUNDS):
            for name, spec in CONTENDERS.items():
                got = run(tmp, name, spec)
                if name not in best or got["wall_s"] < best[name]["wall_s"]:
                    best[name] = got
    print(f"grpo_node: LoRA r16 on a 20M Llama, {grpo_step.PROMPTS} prompts x {grpo_step.G} generations of <= "
          f"{grpo_step.COMPLETION} tokens per step, {STEPS} steps after {WARMUP} warm-up, 2 cores")
    for name, r in best.items():
        planned = f"  planned {r['planned_s']:.2f} s (measured/planned {r['wall_s'] / r['planned_s']:.2f})" \
            if r["planned_s"] else ""
        print(f"  {name:10s} {r['wall_s']:.2f} s/step (generation {r['generation_s']:.2f} s)  {r['tokens']:.0f} "
              f"completion tokens/step  {r['tokens'] / r['wall_s']:.0f} tokens/s  "
              f"{r['all_tokens'] / r['cpu_s']:.1f} tokens/CPU s (whole run){planned}")
    colo = best["colocated"]
    for name in ("node-wait", "node-ahead"):
        r = best[name]
        print(f"  {name}/colocated: {r['tokens'] / r['wall_s'] / (colo['tokens'] / colo['wall_s']):.2f}x tokens/s, "
              f"{r['all_tokens'] / r['cpu_s'] / (colo['all_tokens'] / colo['cpu_s']):.2f}x tokens per CPU second")


if __name__ == "__main__":
    main()
