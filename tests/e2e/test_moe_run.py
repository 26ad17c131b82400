"""MoE QLoRA and LoRA through the real `homelab-ft train` and `export` on a tiny random qwen3_moe
(issue 21): 4-bit experts on one process, adapters on every expert, resume, the merged export."""

from __future__ import annotations

import pytest
import torch
import yaml
from families import save_tiny
from procs import write_chat_data

from homelab_ft.cli.main import main
from homelab_ft.train.metrics import read_metrics

pytest.importorskip("bitsandbytes")


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    folder = tmp_path_factory.mktemp("moe-data")
    write_chat_data(folder / "train.jsonl", 8, answer_prefix="answer: ", max_q_words=3, max_a_words=3)
    return folder


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory):
    return save_tiny(tmp_path_factory.mktemp("moe-base"), "qwen3_moe")


def _recipe(tmp_path, data_dir, model_dir, method: str, *, steps: int = 2, **extra) -> object:
    recipe = {
        "method": method,
        "model": {"path": str(model_dir)},
        "lora": {"r": 4, "alpha": 8, "dropout": 0.0},
        "data": {"sources": [{"path": str(data_dir / "train.jsonl")}], "max_length": 64},
        "train": {"max_steps": steps, "micro_batch_size": 2, "grad_accum_steps": 1, "lr": 1e-2, "warmup_steps": 0,
                  "eval_every": 0, "save_every": 0, "device": "cpu"},
        **extra,
    }
    path = tmp_path / f"{method}.yaml"
    path.write_text(yaml.safe_dump(recipe))
    return path


def _losses(run) -> dict:
    return {r["step"]: r["loss"] for r in read_metrics(run / "metrics.jsonl") if "loss" in r}


def test_moe_qlora_trains_with_4bit_experts(tmp_path, data_dir, moe_dir, capfd):
    """Before: `method: qlora` on qwen3_moe was refused (fused experts stayed in bf16)."""
    run = tmp_path / "run"
    assert main(["train", str(_recipe(tmp_path, data_dir, moe_dir, "qlora")), "--run-dir", str(run)]) == 0
    out, err = capfd.readouterr()
    assert "4-bit experts: 4 fused-experts modules packed (nf4)" in out + err
    losses = _losses(run)
    assert sorted(losses) == [1, 2] and all(torch.isfinite(torch.tensor(v)) for v in losses.values())
