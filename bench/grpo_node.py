"""GRPO on one process against a rollout node, waiting (grpo.max_staleness 0) and overlapped (1).

    OMP_NUM_THREADS=1 .venv/bin/python bench/grpo_node.py               # ~5 minutes on 2 cores
    sudo OMP_NUM_THREADS=1 .venv/bin/python bench/grpo_node.py --netns 1000

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
measured one, and the mean reward of the first and last steps. Contenders interleaved over ROUNDS,
each keeping its best round.

`--netns MBIT` puts the trainer and the rollout rank on two machines: two network namespaces
joined by a veth pair shaped to MBIT (tests/netns.py), each node started with the command
`homelab-ft launch --iface lan0` prints (cli/cluster.py's launch_commands: planned once, on the
launching side, for the 2-node cluster), so each adapter sync crosses the shaped link. Needs root.
"""

from __future__ import annotations

import argparse
import contextlib
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

import grpo_step  # noqa: E402  (the shared job: model, prompts, reward; puts tests/ on sys.path)
import netns  # noqa: E402  (tests/netns.py)

STEPS = 6
WARMUP = 1
ROUNDS = 2
CONTENDERS = {"colocated": {"procs": 1, "threads": 2, "grpo": {"rollout": "colocated"}},
              "node-wait": {"procs": 2, "threads": 1, "grpo": {"rollout": "node", "max_staleness": 0}},
              "node-ahead": {"procs": 2, "threads": 1, "grpo": {"rollout": "node", "max_staleness": 1}}}


def recipe(tmp: Path, name: str, spec: dict, *, nodes: int = 1) -> Path:
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
        "cluster": {"nodes": nodes, "gpus_per_node": spec["procs"] // nodes, "device": "cpu"},
        "sharding": {"strategy": "no_shard"},
    }
    path = tmp / f"{name}.yaml"
    path.write_text(yaml.safe_dump(body))
    return path


def run(tmp: Path, name: str, spec: dict, link: netns.Link | None = None) -> dict:
    """One contender's run, on this machine or (a two-process one with `link`) on the two nodes."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    env = {**os.environ, "HF_DATASETS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": str(spec["threads"]),
           "PYTHONPATH": str(tmp)}  # rewards.py imports the shared reward from there
    if link is not None and spec["procs"] == 2:
        argvs = node_argvs(link, recipe(tmp, name, spec, nodes=2), env)
    else:
        argvs = [([sys.executable, "-m", "homelab_ft", "train", str(recipe(tmp, name, spec))], env)]
    procs = [subprocess.Popen(argv, cwd=tmp, env=node_env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for argv, node_env in argvs]
    logs = [p.communicate()[0] for p in procs]
    if any(p.returncode for p in procs):
        raise SystemExit(f"{name} failed:\n" + "\n".join(log[-3000:] for log in logs))
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
            "planned_s": (plan.get("chosen") or {}).get("step_s"),
            "reward": (rows[0]["reward"], rows[-1]["reward"])}


def node_argvs(link: netns.Link, path: Path, env: dict) -> list[tuple[list[str], dict]]:
    """The two node commands `homelab-ft launch RECIPE --hosts H --iface lan0` prints, each wrapped
    to run inside its namespace."""
    from homelab_ft.cli.cluster import launch_commands
    from homelab_ft.cli.main import build_parser

    hosts = path.with_suffix(".hosts")
    hosts.write_text("".join(f"{node.addr}\n" for node in link.nodes))
    args = build_parser().parse_args(["launch", str(path), "--hosts", str(hosts), "--iface", netns.IFACE,
                                      "--join-timeout", "120", "--workdir", str(path.parent)])
    return [(node.wrap(command.argv), {**env, **command.env})
            for node, command in zip(link.nodes, launch_commands(args), strict=True)]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--netns", type=float, metavar="MBIT", help="the rollout node on a second namespace node, "
                        "across a veth link shaped to MBIT (root)")
    args = parser.parse_args()
    if args.netns and netns.unavailable():
        print(f"grpo_node --netns: {netns.unavailable()}", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory() as tmp_str, \
            (netns.shaped_link(args.netns) if args.netns else contextlib.nullcontext()) as link:
        tmp = Path(tmp_str)
        grpo_step.setup(tmp)
        sys.path.insert(0, str(tmp))  # launch plans here, importing rewards.py as the nodes do (PYTHONPATH)
        best: dict[str, dict] = {}
        for _ in range(ROUNDS):
            for name, spec in CONTENDERS.items():
                got = run(tmp, name, spec, link)
                if name not in best or got["wall_s"] < best[name]["wall_s"]:
                    best[name] = got
    where = f"the rollout rank on a second node across a {args.netns:g} Mbit shaped link" if args.netns else "one machine"
    print(f"grpo_node: LoRA r16 on a 20M Llama, {grpo_step.PROMPTS} prompts x {grpo_step.G} generations of <= "
          f"{grpo_step.COMPLETION} tokens per step, {STEPS} steps after {WARMUP} warm-up, 2 cores, {where}")
    for name, r in best.items():
        planned = f"  planned {r['planned_s']:.2f} s (measured/planned {r['wall_s'] / r['planned_s']:.2f})" \
            if r["planned_s"] else ""
        print(f"  {name:10s} {r['wall_s']:.2f} s/step (generation {r['generation_s']:.2f} s)  {r['tokens']:.0f} "
              f"completion tokens/step  {r['tokens'] / r['wall_s']:.0f} tokens/s  "
              f"{r['all_tokens'] / r['cpu_s']:.1f} tokens/CPU s (whole run){planned}  "
              f"reward {r['reward'][0]:.3f} -> {r['reward'][1]:.3f}")
    colo = best["colocated"]
    for name in ("node-wait", "node-ahead"):
        r = best[name]
        print(f"  {name}/colocated: {r['tokens'] / r['wall_s'] / (colo['tokens'] / colo['wall_s']):.2f}x tokens/s, "
              f"{r['all_tokens'] / r['cpu_s'] / (colo['all_tokens'] / colo['cpu_s']):.2f}x tokens per CPU second")
    return 0


if __name__ == "__main__":
    sys.exit(main())
