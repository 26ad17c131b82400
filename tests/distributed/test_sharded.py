"""2-process gloo runs of the real trainer on CPU against one process on the whole batch.

Four launches for the whole module (procs.Workers, forked from a preloaded server), two at a time:
a 2-process run of many jobs beside a one-process run of the references, then a 2-node x 1-process
HYBRID_SHARD run (each rank a node of its own, as torchrun on two machines numbers them) beside
one-process resumes from the 2-process checkpoints (`homelab-ft launch`'s node commands run on
two network namespaces in test_netns_train.py). One process with micro-batch 2B sees exactly the
rows that 2 ranks with B see (sampling.py), and rows differ in length, so ranks train unequal
token counts.

Most jobs use an untied tiny Llama, whose embeddings and LM head are FSDP2 units of their own; the
`tied_*` jobs use one with `tie_word_embeddings=True` (SmolLM2, Llama 3.2, Qwen2.5 small, Gemma),
whose one shared Parameter stays in the root unit: its file stores only the embedding, and a
sharded build that lost the tie started SmolLM2-135M at loss ln(vocab) = 10.8 instead of 0.6.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from families import save_tiny
from procs import Workers, job_recipe, run_beside, write_chat_data

PARITY_FAMILIES = ("nemotron_h", "qwen3_moe")
"""A hybrid and an MoE family of tests/families.py, full fine-tuned under FSDP2 like the Llamas."""
TOL = 1e-5
STEPS = 6
UNEVEN_EVAL = {"eval_fraction": 0.2}


def _recipe(tmp: Path, model_dir: Path, name: str, *, procs: int, method: str = "full", nodes: int = 1,
            train: dict | None = None, sharding: dict | None = None, data: dict | None = None,
            lora: dict | None = None) -> dict:
    # LoRA's dropout stays 0 (tiny_run's default): dropout draws per-rank random masks
    return job_recipe(
        tmp, model_dir, name, procs=procs, method=method, sharding={"strategy": "full_shard", **(sharding or {})},
        lora=lora or {}, data={"max_length": 160, **(data or {})},
        # Chunks of 16 trained tokens: several chunks per micro-batch, so the parity below covers
        # the chunked loss (loss.py) under FSDP2 and DDP; the `unchunked_*` jobs run today's full logits.
        train={"max_steps": STEPS, "micro_batch_size": 4 // procs, "grad_accum_steps": 2,
               "lr": 5e-3 if method == "lora" else 1e-3, "save_every": 3, "keep_last": 5, "loss_chunk_tokens": 16,
               **(train or {})},
        cluster={"nodes": nodes, "gpus_per_node": procs // nodes})


@pytest.fixture(scope="module")
def results(tmp_path_factory, tiny_model_dir) -> dict:
    from tiny import make_llama

    tmp = tmp_path_factory.mktemp("sharded")
    write_chat_data(tmp / "train.jsonl", 64)
    tied_dir = make_llama(tmp / "tied-llama", tie_word_embeddings=True)
    family_dirs = {family: save_tiny(tmp / family, family) for family in PARITY_FAMILIES}
    two = {
        "full_shard": _recipe(tmp, tiny_model_dir, "full_shard", procs=2),
        "shard_grad_op": _recipe(tmp, tiny_model_dir, "shard_grad_op", procs=2, sharding={"strategy": "shard_grad_op"}),
        "offload": _recipe(tmp, tiny_model_dir, "offload", procs=2, sharding={"cpu_offload": True}),
        "checkpointing": _recipe(tmp, tiny_model_dir, "checkpointing", procs=2, train={"activation_checkpointing": True}),
        "lora_fsdp": _recipe(tmp, tiny_model_dir, "lora_fsdp", procs=2, method="lora"),
        "lora_ddp": _recipe(tmp, tiny_model_dir, "lora_ddp", procs=2, method="lora", sharding={"strategy": "no_shard"}),
        "tied_full": _recipe(tmp, tied_dir, "tied_full", procs=2),
        # 13 held-out rows in micro-batches of 2: 7 eval batches, so rank 1 has one fewer than rank 0
        "eval_uneven": _recipe(tmp, tiny_model_dir, "eval_uneven", procs=2, data=UNEVEN_EVAL, train={"max_steps": 2}),
        "unchunked_fsdp": _recipe(tmp, tied_dir, "unchunked_fsdp", procs=2, train={"loss_chunk_tokens": 0}),
        "head_lora_ddp": _recipe(tmp, tiny_model_dir, "head_lora_ddp", procs=2, method="lora",
                                 sharding={"strategy": "no_shard"}, lora={"target_modules": ["q_proj", "lm_head"]}),
        # LoRA on the head under FSDP2: the head (its adapters with it) is a unit of its own
        "head_lora_fsdp": _recipe(tmp, tiny_model_dir, "head_lora_fsdp", procs=2, method="lora",
                                  lora={"target_modules": ["q_proj", "lm_head"]}),
        "unchunked_head_lora_ddp": _recipe(tmp, tiny_model_dir, "unchunked_head_lora_ddp", procs=2, method="lora",
                                           sharding={"strategy": "no_shard"}, train={"loss_chunk_tokens": 0},
                                           lora={"target_modules": ["q_proj", "lm_head"]}),
    }
    for family, model_dir in family_dirs.items():  # FSDP2 full fine-tunes of a hybrid and an MoE family
        two[f"fam_{family}"] = _recipe(tmp, model_dir, f"fam_{family}", procs=2)
    # optimizer in backward: no accumulation and no clipping (config.py refuses both with it)
    in_bwd = {"grad_accum_steps": 1, "max_grad_norm": 0.0, "optimizer_in_backward": True}
    two["optim_bwd"] = _recipe(tmp, tied_dir, "optim_bwd", procs=2, train=in_bwd)
    # untied: the head's own unit reduce-scatters (and so steps) right after the loss, mid-backward
    two["optim_bwd_untied"] = _recipe(tmp, tiny_model_dir, "optim_bwd_untied", procs=2, train=in_bwd)
    resume2 = _recipe(tmp, tiny_model_dir, "resume2", procs=2, train={"resume": True})
    jobs = [{"kind": "train", "name": k, "recipe": r} for k, r in two.items()]
    jobs.append({"kind": "train", "name": "resume2", "recipe": resume2,
                 "copy_run": {"src": two["full_shard"]["output"]["dir"], "keep_step": 3}})
    jobs.append({"kind": "lora_hf_load", "name": "lora_hf_load", "model_dir": str(tiny_model_dir)})
    jobs.append({"kind": "lora_hf_load", "name": "tied_lora_load", "model_dir": str(tied_dir)})
    jobs.append({"kind": "ddp_reduce", "name": "ddp_reduce"})
    jobs.append({"kind": "ends", "name": "ends", "model_dir": str(tiny_model_dir)})
    jobs.append({"kind": "ends", "name": "tied_ends", "model_dir": str(tied_dir)})
    jobs.append({"kind": "memory", "name": "memory", "model_dir": str(tiny_model_dir), "strategy": "full_shard"})
    jobs.append({"kind": "export", "name": "export", "recipe": two["full_shard"],
                 "checkpoint": str(Path(two["full_shard"]["output"]["dir"]) / "checkpoints" / f"step_{STEPS:06d}"),
                 "out": str(tmp / "export")})
    jobs.append({"kind": "export", "name": "tied_export", "recipe": two["tied_full"],
                 "checkpoint": str(Path(two["tied_full"]["output"]["dir"]) / "checkpoints" / f"step_{STEPS:06d}"),
                 "out": str(tmp / "tied_export")})
    spec = tmp / "two.json"
    spec.write_text(json.dumps({"base_dir": str(tmp), "jobs": jobs}))
    one = [
        {"kind": "train", "name": "ref_full", "recipe": _recipe(tmp, tiny_model_dir, "ref_full", procs=1)},
        {"kind": "train", "name": "ref_lora", "recipe": _recipe(tmp, tiny_model_dir, "ref_lora", procs=1, method="lora")},
        {"kind": "train", "name": "resume1", "recipe": _recipe(tmp, tiny_model_dir, "resume1", procs=1, train={"resume": True}),
         "copy_run": {"src": two["full_shard"]["output"]["dir"], "keep_step": 3}},
        {"kind": "token_counts", "name": "tokens", "recipe": two["full_shard"], "world_size": 2},
        {"kind": "train", "name": "ref_tied", "recipe": _recipe(tmp, tied_dir, "ref_tied", procs=1)},
        {"kind": "train", "name": "ref_head_lora", "recipe": _recipe(tmp, tiny_model_dir, "ref_head_lora", procs=1,
                                                                     method="lora", lora={"target_modules": ["q_proj", "lm_head"]})},
        {"kind": "train", "name": "ref_eval", "recipe": _recipe(tmp, tiny_model_dir, "ref_eval", procs=1, data=UNEVEN_EVAL,
                                                                train={"max_steps": 2})},
        {"kind": "train", "name": "tied_resume1", "recipe": _recipe(tmp, tied_dir, "tied_resume1", procs=1, train={"resume": True}),
         "copy_run": {"src": two["tied_full"]["output"]["dir"], "keep_step": 3}},
        {"kind": "train", "name": "ref_no_accum", "recipe": _recipe(tmp, tied_dir, "ref_no_accum", procs=1,
                                                                    train={**in_bwd, "optimizer_in_backward": False})},
        {"kind": "train", "name": "ref_no_accum_untied", "recipe": _recipe(tmp, tiny_model_dir, "ref_no_accum_untied", procs=1,
                                                                           train={**in_bwd, "optimizer_in_backward": False})},
        {"kind": "train", "name": "optim_bwd_resume1", "recipe": _recipe(tmp, tied_dir, "optim_bwd_resume1", procs=1,
                                                                         train={**in_bwd, "resume": True}),
         "copy_run": {"src": two["optim_bwd"]["output"]["dir"], "keep_step": 3}},
    ]
    one += [{"kind": "train", "name": f"ref_fam_{family}", "recipe": _recipe(tmp, model_dir, f"ref_fam_{family}", procs=1)}
            for family, model_dir in family_dirs.items()]
    # The references beside the 2-process run; the resumes from its checkpoints beside the hybrid run.
    after = [job for job in one if "copy_run" in job]
    (tmp / "one.json").write_text(json.dumps({"base_dir": str(tmp), "jobs": [j for j in one if j not in after]}))
    (tmp / "after.json").write_text(json.dumps({"base_dir": str(tmp), "jobs": after}))
    run_beside(Workers(spec, tmp / "two.out.json", nprocs=2),
               Workers(tmp / "one.json", tmp / "one.out.json"))
    out = json.loads((tmp / "two.out.json").read_text())

    # HYBRID_SHARD: two nodes of one rank each (LOCAL_WORLD_SIZE=1, as torchrun sets it on each node)
    hybrid = _recipe(tmp, tiny_model_dir, "hybrid", procs=2, nodes=2, sharding={"strategy": "hybrid_shard"})
    (tmp / "hybrid.json").write_text(json.dumps({"base_dir": str(tmp), "jobs": [
        {"kind": "train", "name": "hybrid", "recipe": hybrid}]}))
    run_beside(Workers(tmp / "hybrid.json", tmp / "hybrid.out.json", nprocs=2, procs_per_node=1),
               Workers(tmp / "after.json", tmp / "after.out.json"))
    hybrid_out = json.loads((tmp / "hybrid.out.json").read_text())
    assert (hybrid_out["world_size"], hybrid_out["num_nodes"]) == (2, 2)
    out["hybrid"] = hybrid_out["hybrid"]

    out.update(json.loads((tmp / "one.out.json").read_text()))
    out.update(json.loads((tmp / "after.out.json").read_text()))
    return out


def _max_diff(a: list[float], b: list[float]) -> float:
    assert len(a) == len(b), (a, b)
    return max(abs(x - y) for x, y in zip(a, b, strict=True))


@pytest.mark.parametrize("name", ["full_shard", "shard_grad_op", "offload", "checkpointing", "hybrid"])
def test_full_finetune_matches_one_process(results, name):
    rank0, rank1 = results["tokens"]["per_rank"]
    assert any(a != b for a, b in zip(rank0, rank1, strict=True))  # the ranks trained unequal token counts
    ref = results["ref_full"]["losses"]
    assert len(ref) == STEPS and ref[-1] < ref[0]  # it trains, so parity is not trivially of a frozen model
    assert _max_diff(results[name]["losses"], ref) <= TOL


@pytest.mark.parametrize("family", PARITY_FAMILIES)
def test_full_finetune_of_other_families_matches_one_process(results, family):
    """FSDP2 over the blocks transformers declares (`_no_split_modules`) of a hybrid (Mamba and
    attention layers, MoE, `backbone.*` checkpoint keys) and of an MoE family, against one process."""
    ref = results[f"ref_fam_{family}"]["losses"]
    assert len(ref) == STEPS and ref[-1] < ref[0]
    assert _max_diff(results[f"fam_{family}"]["losses"], ref) <= TOL


@pytest.mark.parametrize("name", ["lora_fsdp", "lora_ddp"])
def test_lora_matches_one_process(results, name):
    ref = results["ref_lora"]["losses"]
    assert ref[-1] < ref[0]
    assert _max_diff(results[name]["losses"], ref) <= TOL


def test_sharded_state_is_half_per_rank(results):
    mem = results["memory"]
    for kind in ("params", "grads", "optim"):
        assert abs(mem[kind] - 0.5) <= 0.005, (kind, mem)


def test_resume_gives_same_losses(results):
    full = results["full_shard"]["losses"]
    assert _max_diff(results["resume2"]["losses"], full[3:]) <= TOL
    # on one process from the two-process checkpoint (DCP reshards on load)
    assert _max_diff(results["resume1"]["losses"], full[3:]) <= TOL


@pytest.mark.parametrize("name", ["export", "tied_export"])
def test_export_loads_with_same_logits(results, name):
    exp = results[name]
    assert exp["max_abs_diff"] <= 1e-5
    assert exp["read_back"] == 0.0
    assert exp["diff_from_base"] > 1e-3  # the export holds the trained weights, not the base
    # A tied head is one Parameter in the sharded model and is not written: from_pretrained re-ties it.
    assert exp["head_tied"] == (name == "tied_export")
    assert exp["head_written"] == (name == "export")


def test_tied_embeddings_full_shard_matches_one_process(results):
    """The sharded build of a tied model starts where from_pretrained on one process starts
    (not at the uniform-prediction loss of an uninitialised head) and trains identically."""
    ref, got = results["ref_tied"]["losses"], results["tied_full"]["losses"]
    assert len(ref) == STEPS and ref[-1] < ref[0]
    assert abs(got[0] - ref[0]) <= TOL, (got[0], ref[0])
    assert _max_diff(got, ref) <= TOL
    # resumed on one process from the two-process checkpoint of step 3
    assert _max_diff(results["tied_resume1"]["losses"], got[3:]) <= TOL


@pytest.mark.parametrize("name", ["lora_hf_load", "tied_lora_load"])
def test_lora_on_a_base_read_per_rank(results, name):
    """The per-rank safetensors path: adapters initialised once at full size, then sliced; and
    the rank-0 broadcast path. Both start as the base model, tied head included."""
    got = results[name]
    assert got["logit_diff"] <= 1e-6
    assert got["rank0_logit_diff"] <= 1e-6
    assert got["b_zero"] and got["a_nonzero"] and got["a_rows_distinct"]
    assert got["head_tied"] == (name == "tied_lora_load")


def test_eval_loss_with_uneven_batches_per_rank_matches_one_process(results):
    """Sharded eval forwards are collective, so the rank with no batch left re-runs one and counts
    nothing: the 2-rank eval loss is the one-process loss over the same rows."""
    two, one = results["eval_uneven"], results["ref_eval"]
    assert two["eval_loss"] is not None and abs(two["eval_loss"] - one["eval_loss"]) <= TOL


@pytest.mark.parametrize(("chunked", "unchunked"), [("tied_full", "unchunked_fsdp"),
                                                     ("head_lora_ddp", "unchunked_head_lora_ddp")])
def test_chunked_loss_matches_full_logits_on_two_ranks(results, chunked, unchunked):
    """The chunked loss on 2 ranks (FSDP2 with a tied head in the root unit; DDP with LoRA on the
    head) trains exactly as today's full-logits loss: same losses at every step."""
    ref = results[unchunked]["losses"]
    assert len(ref) == STEPS and ref[-1] < ref[0]
    assert _max_diff(results[chunked]["losses"], ref) <= TOL


def test_optimizer_in_backward_matches_one_adamw_and_resumes(results):
    """FSDP2 on 2 ranks stepping each parameter from its gradient hook trains as one process with
    one AdamW; its checkpoint (per-parameter optimizer states under DCP) resumes on one process."""
    ref, got = results["ref_no_accum"]["losses"], results["optim_bwd"]["losses"]
    assert len(ref) == STEPS and ref[-1] < ref[0]
    assert _max_diff(got, ref) <= TOL
    assert _max_diff(results["optim_bwd_resume1"]["losses"], got[3:]) <= TOL
    untied = results["ref_no_accum_untied"]["losses"]
    assert _max_diff(results["optim_bwd_untied"]["losses"], untied) <= TOL


@pytest.mark.parametrize("name", ["head_lora_fsdp", "head_lora_ddp"])
def test_lora_on_the_head_matches_one_process(results, name):
    """LoRA on lm_head with the chunked loss: FSDP2 (the head, adapters included, a unit of its
    own) and DDP on 2 ranks train as one process does."""
    ref = results["ref_head_lora"]["losses"]
    assert len(ref) == STEPS and ref[-1] < ref[0]
    assert _max_diff(results[name]["losses"], ref) <= TOL


def test_untied_ends_are_units_of_their_own(results):
    """The embeddings are sharded again as soon as their forward ends and are not gathered in
    backward; the LM head stays gathered through the chunked loss, is all-gathered once and
    reduce-scattered once per micro-batch (5 chunks here: not once per chunk), and is sharded
    again before backward reaches the blocks."""
    got = results["ends"]
    assert got["embed_unit"] and got["head_unit"]
    assert got["gathered_after_forward"] == {"embed": False, "head": True}
    assert got["gathered_after_backward"] == {"embed": False, "head": False}
    assert got["grads"] == {"embed": True, "head": True}
    events = [tuple(e) for e in got["events"]]
    backward = events.index(("backward", ""))
    assert [e for e in events if e[1] == "lm_head"] == [("all_gather", "lm_head"), ("post_backward", "lm_head")]
    assert events.index(("post_backward", "lm_head")) > backward
    assert [e for e in events if e[0] == "block_backward"] == [("block_backward", "head gathered=False")]
    assert [e for e in events if e[1] == "model.embed_tokens"] == [("all_gather", "model.embed_tokens"),
                                                                    ("post_backward", "model.embed_tokens")]
    assert events.index(("post_backward", "model.embed_tokens")) > backward


def test_tied_ends_stay_in_the_root_unit(results):
    """A tied embedding is one Parameter for both ends: it stays in the root unit, gathered from
    the first forward to the end of backward (the root's post-backward)."""
    got = results["tied_ends"]
    assert not got["embed_unit"] and not got["head_unit"]
    assert got["gathered_after_forward"] == {"embed": True, "head": True}
    assert got["gathered_after_backward"] == {"embed": False, "head": False}
    events = [tuple(e) for e in got["events"]]
    assert [e for e in events if e[0] == "block_backward"] == [("block_backward", "head gathered=True")]
    assert [e for e in events if e[1] == "" and e[0] != "backward"] == [("all_gather", ""), ("post_backward", "")]


def test_ddp_on_gloo_reduces_fp32_gradients_in_fp32(results):
    """sharding.reduce_dtype under no_shard: torch's bf16 compression hook for DDP needs NCCL, so
    on gloo fp32 gradients are all-reduced in fp32 whatever reduce_dtype says, as the planner
    prices a CPU cluster's traffic (on GPUs the hook halves it; tests/gpu cannot run it here)."""
    assert results["ddp_reduce"] == {"float32": 1 + 1.5 / 4096, "bfloat16": 1 + 1.5 / 4096}
