"""grpo.rollout=node with grpo.max_staleness=1: the rollout rank generates the next step's batch
while the trainer trains this one, and the loss corrects the one-step lag by truncated importance
sampling (`homelab-ft train`, run in this process by procs.homelab_ft_here, which starts torchrun with 2
gloo processes).

With save_every 2 over 4 steps, steps 2 and 4 are fetched ahead (sampled by the adapters before
steps 1 and 3 updated them) and steps 1 and 3 are sampled fresh (step 3 follows a checkpoint); a
held-out pass after every step finds a batch in flight and must collect it before its own request.
"""

from __future__ import annotations

import json
import shutil

import build_recipe
import pytest
from procs import homelab_ft_here
from test_grpo_rollout_node import write_inputs

STEPS = 4
RATIO, DIFF = "sampling/importance_sampling_ratio/mean", "sampling/sampling_logp_difference/mean"
SAME = ("loss", "grad_norm", "reward", "reward_std", "completions/mean_length", RATIO, DIFF)


def _recipe(tmp, model_dir) -> dict:
    return build_recipe.tiny_run(
        model_dir, rows="prompts.jsonl", name="ahead", objective="grpo",
        grpo={"num_generations": 4, "max_completion_length": 6, "reward_funcs": ["rewards.py:low_share"],
              "rollout": "node", "max_staleness": 1, "log_completions_every": 1},
        data={"max_length": 32, "eval_fraction": 0.2, "cache_dir": str(tmp / "cache")},
        train={"max_steps": STEPS, "grad_accum_steps": 2, "lr": 2e-2, "save_every": 2, "eval_every": 1, "num_threads": 1},
        cluster={"nodes": 1, "gpus_per_node": 2, "device": "cpu"}, sharding={"strategy": "no_shard"})


def _train(tmp, body: dict, run, *extra: str) -> dict:
    path = build_recipe.write_recipe(tmp / "ahead.yaml", body)
    proc = homelab_ft_here(["train", str(path), "--run-dir", str(run), *extra])
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r for r in rows if "loss" in r}


@pytest.fixture(scope="module")
def ahead(tmp_path_factory, tiny_model_dir) -> dict:
    tmp = write_inputs(tmp_path_factory.mktemp("rollahead"))  # the prompts and rewards.py:low_share
    body = _recipe(tmp, tiny_model_dir)
    return {"tmp": tmp, "body": body, "run": tmp / "run", "steps": _train(tmp, body, tmp / "run")}


def test_batches_fetched_ahead_are_one_step_stale_and_corrected(ahead):
    steps = ahead["steps"]
    assert sorted(steps) == list(range(1, STEPS + 1)) and all(RATIO in r and DIFF in r for r in steps.values())
    for fresh in (1, 3):  # sampled by the trainer's own adapters: the rollout rank's log-probs are the trainer's
        assert steps[fresh][RATIO] == 1.0 and steps[fresh][DIFF] == 0.0, steps[fresh]
    for stale in (2, 4):  # sampled before the previous step's update
        assert steps[stale][DIFF] > 0 and steps[stale][RATIO] != 1.0, steps[stale]
    assert all(r["grad_norm"] > 0 for r in steps.values())


def test_a_resume_after_a_checkpoint_repeats_the_overlapped_run(ahead, tmp_path):
    """Nothing is fetched ahead across a checkpoint, so steps 3-4 after a resume from step 2 are
    the uninterrupted run's, stale batch and importance weights included."""
    run = tmp_path / "resumed"
    shutil.copytree(ahead["run"], run)
    shutil.rmtree(run / "checkpoints" / "step_000004")
    resumed = _train(ahead["tmp"], ahead["body"], run, "--resume")
    for step in (3, 4):
        assert all(resumed[step][key] == ahead["steps"][step][key] for key in SAME), (step, resumed[step])
