"""QLoRA under adapter-only data parallelism: 2 gloo processes on CPU against one process.

Each rank holds the whole 4-bit base; DDP all-reduces only the LoRA gradients (distributed.py,
`no_shard`). One process with micro-batch 2B sees exactly the rows that 2 ranks with B see
(sampling.py), so the per-step losses must agree to fp32 rounding. Eval passes run between
steps, so the CPU guard (quant.after_load) is exercised on every rank too. One torchrun launch
(seconds on 2 cores) and one plain process, both through tests/distributed/worker.py.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from procs import Workers, job_recipe, run_beside, write_chat_data

pytest.importorskip("bitsandbytes")

TOL = 1e-5
STEPS = 6


def _recipe(tmp: Path, model_dir: Path, name: str, *, procs: int, quant: dict | None = None) -> dict:
    # LoRA's dropout stays 0 (tiny_run's default): dropout draws per-rank random masks
    return job_recipe(tmp, model_dir, name, procs=procs, method="qlora", sharding={"strategy": "no_shard"},
                      quant=quant or {}, data={"eval_sources": [{"path": str(tmp / "eval.jsonl")}], "max_length": 160},
                      train={"max_steps": STEPS, "micro_batch_size": 4 // procs, "grad_accum_steps": 2, "lr": 5e-3,
                             "eval_every": 2, "save_every": STEPS})


@pytest.fixture(scope="module")
def results(tmp_path_factory, tiny_model_dir) -> dict:
    tmp = tmp_path_factory.mktemp("qlora-dp")
    write_chat_data(tmp / "train.jsonl", 64, seed=0)
    write_chat_data(tmp / "eval.jsonl", 8, seed=1)
    # 8-bit is left out until checkpoint.save handles Linear8bitLt (see test_qlora.py's whole-run test)
    variants = {"nf4": {}, "fp4": {"quant_type": "fp4", "double_quant": False}}
    two = [{"kind": "train", "name": f"ddp_{k}", "recipe": _recipe(tmp, tiny_model_dir, f"ddp_{k}", procs=2, quant=q)}
           for k, q in variants.items()]
    one = [{"kind": "train", "name": f"ref_{k}", "recipe": _recipe(tmp, tiny_model_dir, f"ref_{k}", procs=1, quant=q)}
           for k, q in variants.items()]
    (tmp / "two.json").write_text(json.dumps({"base_dir": str(tmp), "jobs": two}))
    (tmp / "one.json").write_text(json.dumps({"base_dir": str(tmp), "jobs": one}))
    run_beside(Workers(tmp / "two.json", tmp / "two.out.json", nprocs=2),
               Workers(tmp / "one.json", tmp / "one.out.json"))
    out = json.loads((tmp / "two.out.json").read_text())
    out.update(json.loads((tmp / "one.out.json").read_text()))
    out["run_dirs"] = {job["name"]: job["recipe"]["output"]["dir"] for job in two + one}
    return out


@pytest.mark.parametrize("variant", ["nf4", "fp4"])
def test_qlora_ddp_matches_one_process(results, variant):
    ref, got = results[f"ref_{variant}"]["losses"], results[f"ddp_{variant}"]["losses"]
    assert len(ref) == len(got) == STEPS
    assert ref[-1] < ref[0]  # it trains, so parity is not that of a frozen model
    assert max(abs(a - b) for a, b in zip(got, ref, strict=True)) <= TOL


def test_qlora_ddp_checkpoint_holds_only_the_adapter(results):
    """Checkpoints of the data-parallel run hold the adapter, not the 4-bit base (what DDP reduces
    is checked in tests/unit/model/test_quant.py)."""
    from safetensors import safe_open

    run = Path(results["run_dirs"]["ddp_nf4"])
    adapter = run / "checkpoints" / f"step_{STEPS:06d}" / "adapter" / "adapter_model.safetensors"
    with safe_open(adapter, "pt") as fh:
        keys = list(fh.keys())
    assert keys and all("lora_" in k for k in keys)
