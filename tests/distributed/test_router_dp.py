"""lora.train_router under DDP and FSDP2: 2 gloo processes on CPU equal one process (issue 21), on
tiny qwen3_moe.

The routers are trainable parameters of every replica (DDP all-reduces their gradients with the
adapters') or sharded with their block (FSDP2 reduce-scatters them); one process with micro-batch
2B sees the rows 2 ranks with B see (sampling.py), so the losses and the saved routers must agree
to fp32 rounding. One torchrun launch (both strategies) and one plain process, through
tests/distributed/worker.py.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from families import save_tiny
from procs import Workers, job_recipe, run_beside, write_chat_data

TOL = 1e-5
STEPS = 4
STRATEGIES = ("no_shard", "full_shard")


def _recipe(tmp: Path, model_dir: Path, name: str, *, procs: int, strategy: str = "no_shard") -> dict:
    recipe = job_recipe(tmp, model_dir, name, procs=procs, lora={"train_router": True},
                        train={"max_steps": STEPS, "micro_batch_size": 4 // procs, "grad_accum_steps": 1, "lr": 1e-2,
                               "warmup_steps": 0, "eval_every": 0, "save_every": STEPS})
    return {**recipe, "sharding": {"strategy": strategy}}  # named for the one process too


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> tuple[Path, dict, Path]:
    tmp = tmp_path_factory.mktemp("router-dp")
    model_dir = save_tiny(tmp / "moe", "qwen3_moe")
    write_chat_data(tmp / "train.jsonl", 16, seed=0)
    jobs = {"2": [{"kind": "train", "name": s, "recipe": _recipe(tmp, model_dir, s, procs=2, strategy=s)}
                  for s in STRATEGIES],
            "1": [{"kind": "train", "name": "one", "recipe": _recipe(tmp, model_dir, "one", procs=1)}]}
    for procs, job in jobs.items():
        (tmp / f"{procs}.json").write_text(json.dumps({"base_dir": str(tmp), "jobs": job}))
    run_beside(Workers(tmp / "2.json", tmp / "2.out.json", nprocs=2),
               Workers(tmp / "1.json", tmp / "1.out.json"))
    out = json.loads((tmp / "2.out.json").read_text())
    out.update(json.loads((tmp / "1.out.json").read_text()))
    return tmp, out, model_dir


# slow (make test-all): ~20 s of torchrun; make test keeps trained routers' one-process training, resume and export (tests/e2e/test_moe_run.py) and FSDP2 parity of MoE adapters (test_moe_qlora_fsdp.py)
@pytest.mark.slow
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_trained_routers_on_two_processes_match_one(runs, strategy):
    from safetensors.torch import load_file

    from homelab_ft.store.model_state import ROUTERS

    tmp, out, model_dir = runs
    one, two = out["one"]["losses"], out[strategy]["losses"]
    assert len(one) == len(two) == STEPS and max(abs(a - b) for a, b in zip(one, two, strict=True)) <= TOL
    routers = [load_file(str(tmp / "runs" / name / "checkpoints" / f"step_{STEPS:06d}" / "adapter" / ROUTERS))
               for name in ("one", strategy)]
    base = load_file(str(model_dir / "model.safetensors"))
    assert sorted(routers[0]) == sorted(routers[1]) and routers[0]
    for key, tensor in routers[0].items():
        assert (tensor - base[key]).abs().max() > 1e-4  # trained
        assert torch.allclose(tensor, routers[1][key], atol=TOL, rtol=0)
