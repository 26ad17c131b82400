"""DPO across ranks: 2-process gloo runs against one process on the whole batch.

One process with micro-batch 2B sees exactly the pairs that 2 ranks with B see (sampling.py); the
pairs differ in length, and the loss is a mean over the step's pairs on all ranks, so the gradients
(and every logged loss) must match. LoRA under DDP and under FSDP2 take their reference from the
same forward with adapters disabled; the full fine-tune under FSDP2 scores its reference in a
pre-pass shared out over the ranks, each run with its own cache so both pre-passes are compared.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from procs import Workers, job_recipe, run_beside, write_pair_data, write_unpaired_data

LOSSES = (("orpo", "lora", "no_shard"), ("simpo", "full", "full_shard"), ("kto", "lora", "no_shard"),
          ("kto", "full", "full_shard"))
"""(dpo.loss, method, strategy) of the other losses' runs compared with one process: the reference-free
ones, and KTO (unpaired rows, its KL reference point over the step on all ranks) on both rungs."""
TOL = 1e-5
STEPS = 4


def _recipe(tmp: Path, model_dir: Path, name: str, *, procs: int, method: str, strategy: str = "no_shard",
            train: dict | None = None, cache: str | None = None, loss: str = "sigmoid") -> dict:
    return job_recipe(
        tmp, model_dir, name, procs=procs, method=method, sharding={"strategy": strategy},
        rows="unpaired.jsonl" if loss == "kto" else "pairs.jsonl", objective="dpo",
        # KTO's rows are unpaired: no chosen answer for RPO's term
        dpo={"beta": 0.5, "sft_weight": 0.0 if loss == "kto" else 0.1, "loss": loss},
        # 6 pairs held out: every run evaluates at its last step, right before its checkpoint
        data={"max_length": 96, "eval_fraction": 0.125, "cache_dir": str(tmp / "cache" / (cache or name))},
        train={"max_steps": STEPS, "micro_batch_size": 4 // procs, "grad_accum_steps": 2,
               "lr": 5e-3 if method == "lora" else 1e-3, "save_every": 2, "keep_last": 5, **(train or {})})


@pytest.fixture(scope="module")
def results(tmp_path_factory, tiny_model_dir) -> dict:
    tmp = tmp_path_factory.mktemp("dpo")
    write_pair_data(tmp / "pairs.jsonl", 48)
    write_unpaired_data(tmp / "unpaired.jsonl", 24)
    two = {
        "lora_ddp": _recipe(tmp, tiny_model_dir, "lora_ddp", procs=2, method="lora"),
        "lora_fsdp": _recipe(tmp, tiny_model_dir, "lora_fsdp", procs=2, method="lora", strategy="full_shard"),
        "full_fsdp": _recipe(tmp, tiny_model_dir, "full_fsdp", procs=2, method="full", strategy="full_shard"),
    }
    # the other losses: ORPO under DDP LoRA, SimPO under FSDP2 full, KTO under both
    for loss, method, strategy in LOSSES:
        two[f"{method}_{loss}"] = _recipe(tmp, tiny_model_dir, f"{method}_{loss}", procs=2, method=method,
                                          strategy=strategy, loss=loss)
    jobs = [{"kind": "train", "name": k, "recipe": r} for k, r in two.items()]
    for name in ("lora_ddp", "full_fsdp"):
        jobs.append({"kind": "train", "name": f"{name}_resume",
                     "recipe": _recipe(tmp, tiny_model_dir, f"{name}_resume", procs=2, method=two[name]["method"],
                                       strategy=two[name]["sharding"]["strategy"], train={"resume": True}, cache=name),
                     "copy_run": {"src": two[name]["output"]["dir"], "keep_step": 2}})
    spec = tmp / "two.json"
    spec.write_text(json.dumps({"base_dir": str(tmp), "jobs": jobs}))
    one = [{"kind": "train", "name": f"ref_{m}", "recipe": _recipe(tmp, tiny_model_dir, f"ref_{m}", procs=1, method=m)}
           for m in ("lora", "full")]
    one += [{"kind": "train", "name": f"ref_{m}_{loss}",
             "recipe": _recipe(tmp, tiny_model_dir, f"ref_{m}_{loss}", procs=1, method=m, loss=loss)}
            for loss, m, _ in LOSSES]
    spec1 = tmp / "one.json"
    spec1.write_text(json.dumps({"base_dir": str(tmp), "jobs": one}))
    run_beside(Workers(spec, tmp / "two.out.json", nprocs=2),
               Workers(spec1, tmp / "one.out.json"))
    out = json.loads((tmp / "two.out.json").read_text())
    out.update(json.loads((tmp / "one.out.json").read_text()))
    for name in ("lora_ddp", "full_fsdp", "ref_full"):
        rows = [json.loads(line) for line in (tmp / "runs" / name / "metrics.jsonl").read_text().splitlines()]
        out[name]["margins"] = [r["reward_margin"] for r in rows if "reward_margin" in r]
    return out


def _max_diff(a: list[float], b: list[float]) -> float:
    assert len(a) == len(b), (a, b)
    return max(abs(x - y) for x, y in zip(a, b, strict=True))


@pytest.mark.parametrize("name", ["lora_ddp", "lora_fsdp"])
def test_lora_dpo_matches_one_process(results, name):
    ref = results["ref_lora"]["losses"]
    assert len(ref) == STEPS and ref[-1] < ref[0]
    assert _max_diff(results[name]["losses"], ref) <= TOL


def test_full_dpo_with_cached_reference_matches_one_process(results):
    """Each run scored its own reference (the 2-rank pre-pass against the 1-process one)."""
    ref = results["ref_full"]["losses"]
    assert len(ref) == STEPS and ref[-1] < ref[0]
    assert _max_diff(results["full_fsdp"]["losses"], ref) <= TOL
    assert _max_diff(results["full_fsdp"]["margins"], results["ref_full"]["margins"]) <= TOL


@pytest.mark.parametrize(("name", "ref"), [("lora_ddp", "ref_lora"), ("lora_fsdp", "ref_lora"), ("full_fsdp", "ref_full")])
def test_eval_over_ranks_matches_one_process(results, name, ref):
    """The held-out DPO loss over 2 ranks (3 pairs each) is the one-process loss over the 6 pairs."""
    assert results[ref]["eval_loss"] is not None
    assert abs(results[name]["eval_loss"] - results[ref]["eval_loss"]) <= TOL


@pytest.mark.parametrize("name", ["lora_ddp", "full_fsdp"])
def test_resume_at_step_2_gives_the_same_losses(results, name):
    assert _max_diff(results[f"{name}_resume"]["losses"], results[name]["losses"][2:]) <= TOL


@pytest.mark.parametrize(("loss", "method"), [(loss, method) for loss, method, _ in LOSSES])
def test_other_losses_match_one_process(results, loss, method):
    """ORPO (DDP LoRA), SimPO (FSDP2 full) and KTO (both) over 2 ranks train as one process, held-out
    loss included; KTO's z0 is the mean over the step's rows of both ranks."""
    ref = results[f"ref_{method}_{loss}"]
    assert len(ref["losses"]) == STEPS and ref["losses"][-1] < ref["losses"][0]
    assert _max_diff(results[f"{method}_{loss}"]["losses"], ref["losses"]) <= TOL
    assert abs(results[f"{method}_{loss}"]["eval_loss"] - ref["eval_loss"]) <= TOL
