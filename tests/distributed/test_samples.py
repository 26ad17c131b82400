"""`train.sample_every` on 2 gloo ranks: FSDP2 (full and LoRA) and DDP generate on every rank, rank 0
logs, and the losses are exactly those of the same run without sampling (one torchrun for all jobs)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from procs import Workers, job_recipe, run_checked, write_chat_data

from homelab_ft.train.metrics import read_metrics

STEPS = 4
SAMPLING = {"sample_every": 2, "sample_prompts": ["the quick brown fox", "what is the capital"], "sample_max_new_tokens": 6}
RUNS = {
    "full_shard": {"method": "full", "sharding": {"strategy": "full_shard"}},
    "lora_fsdp": {"method": "lora", "sharding": {"strategy": "full_shard"}},
    "lora_ddp": {"method": "lora", "sharding": {"strategy": "no_shard"}},
}


def _recipe(tmp: Path, model_dir: Path, name: str, *, method: str, sharding: dict, sampled: bool) -> dict:
    return job_recipe(tmp, model_dir, name, procs=2, method=method, sharding=sharding,
                      lora={"dropout": 0.1},  # dropout draws random numbers: sampling must leave them be
                      data={"max_length": 96}, train={"max_steps": STEPS, "lr": 5e-3, **(SAMPLING if sampled else {})})


@pytest.fixture(scope="module")
def results(tmp_path_factory, tiny_model_dir) -> tuple[Path, dict]:
    tmp = tmp_path_factory.mktemp("samples")
    write_chat_data(tmp / "train.jsonl", 32)
    jobs = [{"kind": "train", "name": f"{name}_{sampled}", "recipe": _recipe(tmp, tiny_model_dir, f"{name}_{sampled}",
                                                                              sampled=sampled, **run)}
            for name, run in RUNS.items() for sampled in (False, True)]
    spec = tmp / "spec.json"
    spec.write_text(json.dumps({"base_dir": str(tmp), "jobs": jobs}))
    run_checked(Workers(spec, tmp / "out.json", nprocs=2))
    return tmp, json.loads((tmp / "out.json").read_text())


@pytest.mark.parametrize("name", list(RUNS))
def test_sampling_leaves_training_alone(results, name):
    _, out = results
    assert out[f"{name}_True"]["losses"] == out[f"{name}_False"]["losses"]


@pytest.mark.parametrize("name", list(RUNS))
def test_rank_zero_logs_the_replies(results, name):
    tmp, _ = results
    rows = [r for r in read_metrics(tmp / "runs" / f"{name}_True" / "metrics.jsonl") if "samples" in r]
    assert [r["step"] for r in rows] == [2, 4]  # once per due step: rank 1 writes nothing
    for row in rows:
        assert [s["prompt"] for s in row["samples"]] == SAMPLING["sample_prompts"]
        assert all(isinstance(s["completion"], str) for s in row["samples"])
