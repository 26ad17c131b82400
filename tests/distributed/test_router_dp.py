"""lora.train_router under DDP: 2 gloo processes on CPU equal one process (issue 21), on tiny qwen3_moe.

The routers are trainable parameters of every replica, so DDP all-reduces their gradients with
the adapters'; one process with micro-batch 2B sees the rows 2 ranks with B see (sampling.py), so
the losses and the trained routers must agree to fp32 rounding. One torchrun launch and one plain
process through tests/distributed/worker.py.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from families import save_tiny
from procs import run_checked, write_chat_data

WORKER = Path(__file__).with_name("worker.py")
TOL = 1e-5
STEPS = 4


def _recipe(tmp: Path, model_dir: Path, name: str, *, procs: int) -> dict:
    return {
        "name": name, "method": "lora", "model": {"path": str(model_dir)},
        "lora": {"r": 4, "alpha": 8, "dropout": 0.0, "train_router": True},
        "data": {"sources": [{"path": str(tmp / "train.jsonl")}], "max_length": 64},
        "train": {"max_steps": STEPS, "micro_batch_size": 4 // procs, "grad_accum_steps": 1, "lr": 1e-2,
                  "warmup_steps": 0, "eval_every": 0, "save_every": STEPS, "device": "cpu"},
        "output": {"dir": str(tmp / "runs" / name), "tensorboard": False},
        "cluster": {"nodes": 1, "gpus_per_node": procs},
        "sharding": {"strategy": "no_shard"},
    }


def test_trained_routers_under_ddp_match_one_process(tmp_path):
    from safetensors.torch import load_file

    from homelab_ft.store.model_state import ROUTERS

    model_dir = save_tiny(tmp_path / "moe", "qwen3_moe")
    write_chat_data(tmp_path / "train.jsonl", 16, seed=0)
    jobs = {procs: [{"kind": "train", "name": f"p{procs}", "recipe": _recipe(tmp_path, model_dir, f"p{procs}", procs=procs)}]
            for procs in (1, 2)}
    for procs, job in jobs.items():
        (tmp_path / f"{procs}.json").write_text(json.dumps({"base_dir": str(tmp_path), "jobs": job}))
    run_checked([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
                 str(WORKER), str(tmp_path / "2.json"), str(tmp_path / "2.out.json")])
    run_checked([sys.executable, str(WORKER), str(tmp_path / "1.json"), str(tmp_path / "1.out.json")])
    one = json.loads((tmp_path / "1.out.json").read_text())["p1"]["losses"]
    two = json.loads((tmp_path / "2.out.json").read_text())["p2"]["losses"]
    assert len(one) == len(two) == STEPS and max(abs(a - b) for a, b in zip(one, two, strict=True)) <= TOL
    routers = [load_file(str(tmp_path / "runs" / name / "checkpoints" / f"step_{STEPS:06d}" / "adapter" / ROUTERS))
               for name in ("p1", "p2")]
    base = load_file(str(model_dir / "model.safetensors"))
    assert sorted(routers[0]) == sorted(routers[1]) and routers[0]
    for key, tensor in routers[0].items():
        assert (tensor - base[key]).abs().max() > 1e-4  # trained
        assert torch.allclose(tensor, routers[1][key], atol=TOL, rtol=0)
