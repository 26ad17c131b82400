"""FSDP-QLoRA: the 4-bit base sharded over 2 gloo processes on CPU, against one process.

Two launches for the module: one torchrun of 2 processes (the sharded-base checks first, in a
fresh process, so its RSS peak is its own; then the training runs and a resume), and one plain
process (the references, a resume from the 2-process checkpoint, the export). One process with
micro-batch 2B sees exactly the rows that 2 ranks with B see (sampling.py), and rows differ in
length, so ranks train unequal token counts. Both sides quantise with the same
`bnb.functional.quantize_4bit` call (uint8 storage on one process, fp32 storage sharded), and
every QLoRA rung initialises its adapters from the seed alone, so the losses agree to rounding.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from procs import Workers, job_recipe, run_checked, write_chat_data

pytest.importorskip("bitsandbytes")

TOL = 1e-5
STEPS = 6


def _recipe(tmp: Path, model_dir: Path, name: str, *, procs: int, sharding: dict | None = None,
            train: dict | None = None) -> dict:
    # LoRA's dropout stays 0 (tiny_run's default): dropout draws per-rank random masks
    return job_recipe(tmp, model_dir, name, procs=procs, method="qlora",
                      sharding={"strategy": "full_shard", **(sharding or {})},
                      data={"eval_sources": [{"path": str(tmp / "eval.jsonl")}], "max_length": 160},
                      train={"max_steps": STEPS, "micro_batch_size": 4 // procs, "grad_accum_steps": 2, "lr": 5e-3,
                             "eval_every": 3, "save_every": 3, "keep_last": 5, **(train or {})})


@pytest.fixture(scope="module")
def results(tmp_path_factory, tiny_model_dir) -> dict:
    from tiny import make_llama

    tmp = tmp_path_factory.mktemp("qlora-fsdp")
    write_chat_data(tmp / "train.jsonl", 64, seed=0)
    write_chat_data(tmp / "eval.jsonl", 8, seed=1)
    # Blocks of 15.7M params (63 MB in fp32): big enough that a whole-model load (4 blocks, 250 MB)
    # stands out of the RSS noise of a Python process by far.
    wide = make_llama(tmp / "wide-llama", hidden_size=1024, intermediate_size=4096, num_hidden_layers=4,
                      num_attention_heads=8, num_key_value_heads=4)
    # 40 x 27 = 1080 values pack into 135 fp32 elements: an odd length, split 68 + 67 over 2 ranks.
    odd = make_llama(tmp / "odd-llama", hidden_size=40, intermediate_size=27, num_attention_heads=2, num_key_value_heads=1)
    two = {
        "fsdp": _recipe(tmp, tiny_model_dir, "fsdp", procs=2),
        "offload": _recipe(tmp, tiny_model_dir, "offload", procs=2, sharding={"cpu_offload": True}),
        "grad_op": _recipe(tmp, tiny_model_dir, "grad_op", procs=2, sharding={"strategy": "shard_grad_op"}),
    }
    jobs = [{"kind": "qlora_shards", "name": "wide", "recipe": _recipe(tmp, wide, "wide", procs=2)},
            {"kind": "qlora_shards", "name": "odd", "recipe": _recipe(tmp, odd, "odd", procs=2)}]
    jobs += [{"kind": "train", "name": k, "recipe": r} for k, r in two.items()]
    jobs.append({"kind": "train", "name": "resume2", "recipe": _recipe(tmp, tiny_model_dir, "resume2", procs=2, train={"resume": True}),
                 "copy_run": {"src": two["fsdp"]["output"]["dir"], "keep_step": 3}})
    (tmp / "two.json").write_text(json.dumps({"base_dir": str(tmp), "jobs": jobs}))
    run_checked(Workers(tmp / "two.json", tmp / "two.out.json", nprocs=2))
    one = [
        {"kind": "train", "name": "ref", "recipe": _recipe(tmp, tiny_model_dir, "ref", procs=1)},
        {"kind": "train", "name": "resume1", "recipe": _recipe(tmp, tiny_model_dir, "resume1", procs=1, train={"resume": True}),
         "copy_run": {"src": two["fsdp"]["output"]["dir"], "keep_step": 3}},
        {"kind": "token_counts", "name": "tokens", "recipe": two["fsdp"], "world_size": 2},
        {"kind": "export_run", "name": "export", "run_dir": two["fsdp"]["output"]["dir"], "out": str(tmp / "export"),
         "model_dir": str(tiny_model_dir)},
    ]
    (tmp / "one.json").write_text(json.dumps({"base_dir": str(tmp), "jobs": one}))
    run_checked(Workers(tmp / "one.json", tmp / "one.out.json"))
    out = json.loads((tmp / "two.out.json").read_text())
    out.update(json.loads((tmp / "one.out.json").read_text()))
    return out


def _max_diff(a: list[float], b: list[float]) -> float:
    assert len(a) == len(b), (a, b)
    return max(abs(x - y) for x, y in zip(a, b, strict=True))


@pytest.mark.parametrize("name", ["wide", "odd"])
def test_sharded_forward_equals_unsharded_4bit(results, name):
    """Same quantised bytes, gathered: the logits are bit-identical to the one-GPU 4-bit model."""
    assert results[name]["forward_max_abs_diff"] == 0.0


def test_each_rank_stores_half_of_the_4bit_base(results):
    assert abs(results["wide"]["storage_ratio"] - 0.5) <= 0.005
    assert abs(results["odd"]["storage_ratio"] - 0.5) <= 0.01  # 68 of 135 elements


def test_loading_peak_is_shards_plus_about_one_block(results):
    """Process RSS while building: at most this rank's shards (+ the replicated quantisation
    states) + 1.5 blocks; a whole-model load would be ~4 blocks above that."""
    wide = results["wide"]
    assert wide["baseline_valid"], wide
    budget = wide["local_model_bytes"] + wide["quant_state_bytes"] + 1.5 * wide["block_bytes"]
    assert wide["load_peak_bytes"] <= budget, wide


@pytest.mark.parametrize("name", ["fsdp", "offload", "grad_op"])
def test_sharded_qlora_matches_one_process(results, name):
    rank0, rank1 = results["tokens"]["per_rank"]
    assert any(a != b for a, b in zip(rank0, rank1, strict=True))  # the ranks trained unequal token counts
    ref = results["ref"]["losses"]
    assert len(ref) == STEPS and ref[-1] < ref[0]  # it trains, so parity is not that of a frozen model
    assert _max_diff(results[name]["losses"], ref) <= TOL


def test_resume_gives_same_losses(results):
    full = results["fsdp"]["losses"]
    assert _max_diff(results["resume2"]["losses"], full[3:]) <= TOL
    # on one process (the 4-bit base whole, uint8 storage) from the two-process checkpoint
    assert _max_diff(results["resume1"]["losses"], full[3:]) <= TOL


def test_export_merges_into_the_full_precision_base(results):
    exp = results["export"]
    assert exp["max_abs_diff"] <= 1e-4  # merged vs full-precision base + adapter, checked by export
    assert exp["diff_from_base"] > 1e-3  # the adapter trained and was merged
