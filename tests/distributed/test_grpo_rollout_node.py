"""grpo.rollout=node: a trainer and a rollout rank in one 2-process job (`homelab-ft train`, run in
this process by procs.homelab_ft_here, which starts torchrun), against the same recipe run colocated
in one process.

The rollout rank generates what the colocated engine would (same seeded sampling, same weights:
the adapters are sent before a rollout whenever they changed), so the sampled completions, rewards,
losses and the greedy held-out reward must EQUAL the one-process run's, step by step. Every sync
sends exactly the adapters' bytes (numel x element size of the trainable tensors)."""

from __future__ import annotations

import json
import random
import shutil
import subprocess
import time

import build_recipe
import pytest
from procs import homelab_ft_here

STEPS = 4
REWARDS = """
def low_share(prompts, completions, completion_ids, **columns):
    return [sum(i < 100 for i in ids) / max(len(ids), 1) for ids in completion_ids]


def boom(prompts, completions, completion_ids, **columns):
    raise ValueError("no reward today")
"""
SAME = ("loss", "grad_norm", "reward", "reward_std", "completions/mean_length", "completions/clipped_ratio",
        "frac_reward_zero_std", "rewards/low_share/mean")


def recipe(tmp, model_dir, name: str, *, method: str, rollout: str) -> dict:
    return build_recipe.tiny_run(
        model_dir, method=method, rows="prompts.jsonl", name=name, objective="grpo",
        grpo={"num_generations": 4, "max_completion_length": 6, "reward_funcs": ["rewards.py:low_share"],
              "rollout": rollout, "log_completions_every": 1},
        data={"max_length": 32, "eval_fraction": 0.2, "cache_dir": str(tmp / "cache" / name)},
        train={"max_steps": STEPS, "grad_accum_steps": 2, "lr": 2e-2, "save_every": 2, "eval_every": 2, "num_threads": 1},
        cluster={"nodes": 1, "gpus_per_node": 2 if rollout == "node" else 1, "device": "cpu"},
        sharding={"strategy": "no_shard"})


def write_inputs(tmp):
    """The prompts and the reward file beside the recipes; returns `tmp`."""
    rng = random.Random(0)
    rows = [{"prompt": [{"role": "user", "content": " ".join(str(rng.randint(1, 99)) for _ in range(rng.randint(1, 6)))}],
             "answer": str(i)} for i in range(40)]
    (tmp / "prompts.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp / "rewards.py").write_text(REWARDS)
    return tmp


def metrics(run) -> dict:
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return {"steps": [r for r in rows if "loss" in r], "evals": [r for r in rows if "eval_reward" in r],
            "samples": [r for r in rows if "samples" in r], "run": run}


def _args(tmp, body: dict, *extra: str, run=None) -> list[str]:
    """`train` on `body` written beside the inputs (run directory: runs/<name>, or `run`)."""
    path = build_recipe.write_recipe(tmp / f"{body['name']}.yaml", body)
    run = run or tmp / "runs" / body["name"]
    return ["train", str(path), "--run-dir", str(run), *extra]


def _command(tmp, body: dict, *extra: str, run=None) -> subprocess.CompletedProcess:
    """`homelab-ft train` run by this process (procs.homelab_ft_here): its torchrun agent and ranks are real."""
    return homelab_ft_here(_args(tmp, body, *extra, run=run))


def train_here(tmp, body: dict) -> dict:
    """A one-process (colocated) run in this process: the CLI's own path, without a fresh
    interpreter's ~8 CPU s of imports."""
    from homelab_ft.cli.main import main

    assert main(_args(tmp, body)) == 0
    return metrics(tmp / "runs" / body["name"])


def train_both(tmp, node: dict, colocated: dict) -> tuple[dict, dict]:
    """The node run (`homelab-ft train` in this process: torchrun, a trainer and a rollout rank),
    then the colocated one (train_here); the metrics of each."""
    proc = _command(tmp, node)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return metrics(tmp / "runs" / node["name"]), train_here(tmp, colocated)


def adapter_bytes(model_dir, method: str) -> int:
    """The adapters' size as the trainer builds them: sum of numel x element size of the trainable tensors."""
    import torch

    from homelab_ft.recipe.config import recipe_from_dict
    from homelab_ft.rung import rung_for
    from homelab_ft.train.build import dtypes_for, load_whole
    from homelab_ft.train.rollout_node import adapter_tensors

    recipe = recipe_from_dict(build_recipe.tiny_run(model_dir, method=method, lora={"dropout": None}, data=None,
                                                    train=None, output=None), source="test")
    rung, cpu = rung_for(recipe), torch.device("cpu")
    model = load_whole(recipe, model_dir=model_dir, rung=rung, device=cpu,
                       dtype=dtypes_for(recipe, rung=rung, device=cpu).compute)
    return sum(t.numel() * t.element_size() for t in adapter_tensors(model))


@pytest.fixture(scope="module", params=["lora", "qlora"])
def runs(request, tmp_path_factory, tiny_model_dir) -> dict:
    method = request.param
    if method == "qlora":  # the rollout rank's base in 4 bits, as the trainer's
        pytest.importorskip("bitsandbytes")
    tmp = write_inputs(tmp_path_factory.mktemp(f"rollnode_{method}"))
    node, colocated = train_both(tmp, recipe(tmp, tiny_model_dir, f"node_{method}", method=method, rollout="node"),
                                   recipe(tmp, tiny_model_dir, f"colo_{method}", method=method, rollout="colocated"))
    return {"method": method, "tmp": tmp, "model_dir": tiny_model_dir, "bytes": adapter_bytes(tiny_model_dir, method),
            "node": node, "colocated": colocated}


def assert_same_run(node: dict, colo: dict) -> None:
    """Step by step the same completions, rewards, losses and greedy held-out rewards."""
    assert [r["step"] for r in node["steps"]] == list(range(1, STEPS + 1))
    for a, b in zip(node["steps"], colo["steps"], strict=True):
        for key in SAME:
            assert a[key] == b[key], (a["step"], key, a[key], b[key])
    assert [s["samples"] for s in node["samples"]] == [s["samples"] for s in colo["samples"]]  # the completions
    assert [e["eval_reward"] for e in node["evals"]] == [e["eval_reward"] for e in colo["evals"]]  # greedy
    assert len(node["evals"]) == 3 and node["steps"][-1]["grad_norm"] > 0


def assert_syncs(node: dict, size: int) -> None:
    """Every sync sent exactly the adapters; the baseline eval sends the first ones, step 1 finds them
    unchanged, and every update is sent once, before the next rollout or held-out pass."""
    rows = node["steps"] + node["evals"]
    assert size > 0 and all(r["rollout/adapter_bytes"] == r["rollout/syncs"] * size for r in rows), (size, rows)
    assert [r["rollout/syncs"] for r in sorted(rows, key=lambda r: (r["step"], "loss" in r))] == \
        [1.0, 0.0, 1.0, 1.0, 0.0, 1.0, 1.0]
    assert all(r["rollout/sync_s"] >= 0 for r in rows)


def test_the_rollout_rank_generates_what_the_colocated_engine_would(runs):
    assert_same_run(runs["node"], runs["colocated"])


def test_each_sync_sends_exactly_the_adapters(runs):
    assert_syncs(runs["node"], runs["bytes"])
    info = json.loads((runs["node"]["run"] / "run.json").read_text())
    assert info["world_size"] == 1  # the trainer trained as one process


def test_colocated_runs_log_no_syncs(runs):
    assert not any("rollout/syncs" in r for r in runs["colocated"]["steps"])


def test_a_failing_trainer_stops_the_rollout_rank(tmp_path, tiny_model_dir):
    """The trainer's error (a reward function that raises, in the baseline held-out pass) ends the
    job with its one line and exit 2: the trainer sends stop in a finally, the rollout rank returns,
    and neither waits out a timeout."""
    tmp = write_inputs(tmp_path)
    body = recipe(tmp, tiny_model_dir, "boom", method="lora", rollout="node")
    body["grpo"]["reward_funcs"] = ["rewards.py:boom"]
    start = time.monotonic()
    proc = _command(tmp, body)
    assert proc.returncode == 2, proc.stdout[-3000:] + proc.stderr[-6000:]
    assert "boom" in proc.stderr and "no reward today" in proc.stderr
    assert time.monotonic() - start < 120


def test_a_resumed_node_run_repeats_the_uninterrupted_one(runs, tmp_path):
    """A crash after step 2, then --resume: the trainer loads its checkpoint alone (the rollout rank
    holds none), the first rollout sends the resumed adapters, and steps 3-4 repeat the first run's."""
    if runs["method"] != "lora":
        pytest.skip("one method is enough for the resume path")
    run = tmp_path / "resumed"
    shutil.copytree(runs["node"]["run"], run)
    shutil.rmtree(run / "checkpoints" / "step_000004")
    body = recipe(runs["tmp"], runs["model_dir"], "node_lora", method="lora", rollout="node")
    proc = _command(runs["tmp"], body, "--resume", run=run)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    resumed = {r["step"]: r for r in metrics(run)["steps"]}
    first = {r["step"]: r for r in runs["node"]["steps"]}
    for step in (3, 4):
        assert all(resumed[step][key] == first[step][key] for key in SAME), step
    assert resumed[3]["rollout/syncs"] == 1.0 and resumed[3]["rollout/adapter_bytes"] == runs["bytes"]
