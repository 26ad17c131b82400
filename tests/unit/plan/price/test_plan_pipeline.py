"""The planner's pipeline (plan/price/pipeline.py, issue 22): per-stage memory against a hand computation,
the bubble, the point-to-point bytes and their time on the link, the split over uneven GPUs, the
ranking on a slow and a fast link, and the advice lines. Torch-free, like the planner."""

from __future__ import annotations

import dataclasses
import functools
import json
from pathlib import Path

import pytest

from homelab_ft.errors import UserError
from homelab_ft.plan.hardware import cluster_overrides, resolve_cluster
from homelab_ft.plan.inputs import Cluster
from homelab_ft.plan.planner import default_request, plan, plan_for_recipe
from homelab_ft.plan.price import pipeline
from homelab_ft.plan.price.memory import CUDA_CONTEXT_BYTES, CUDA_FRAGMENTATION_BYTES, GiB
from homelab_ft.plan.price.network import LOOP_ALL_REDUCES, collective_s
from homelab_ft.plan.report import format_plan
from homelab_ft.plan.shape.shapes import model_shape
from homelab_ft.recipe.config import load_recipe
from homelab_ft.rung import Rung

ROOT = Path(__file__).resolve().parents[4]
CONFIGS = ROOT / "tests" / "configs"

@functools.cache
def tiny():
    """A Llama small enough to price by hand: per block q,k,v,o 64x64 + gate,up,down 64x128 + 2 norms;
    derived when a test first needs it, not at collection (in each xdist worker)."""
    return model_shape({"model_type": "llama", "vocab_size": 128, "hidden_size": 64, "num_hidden_layers": 4,
                        "num_attention_heads": 4, "num_key_value_heads": 4, "intermediate_size": 128,
                        "max_position_embeddings": 512})


BLOCK_PARAMS = 4 * 64 * 64 + 3 * 64 * 128 + 2 * 64


def block_act_bytes() -> float:
    """Kept per token and block in bf16: what autograd saves, measured on the model transformers builds
    (plan/shape/saved.py; about 8h + 2q + 2kv + 4i elements for a Llama block), the same on every block here."""
    return tiny().blocks[0].saved_bytes_per_token(2, 32)


def shape(name: str):
    return model_shape(json.loads((CONFIGS / f"{name}.json").read_text()))


def gpus(count: int = 1, vram_gib: float = 24, *, nodes: int = 2, link_gbit: float = 1.0,
         node_gib: tuple[float, ...] = ()) -> Cluster:
    return Cluster(device="cuda", nodes=nodes, gpus_per_node=count, device_bytes=int(min(node_gib or (vram_gib,)) * GiB),
                   host_ram_bytes=64 * GiB, inter_link_gbit=link_gbit, tflops=40.0,
                   node_device_bytes=tuple(int(g * GiB) for g in node_gib))


def tiny_rung(**changes) -> Rung:
    return dataclasses.replace(Rung(method="full", strategy="no_shard", cpu_offload=False, nodes=2, procs_per_node=1,
                                    pipeline_stages=2, stage_blocks=(2, 2)), **changes)


TINY_REQUEST = default_request(data={"max_length": 32}, train={"micro_batch_size": 2, "grad_accum_steps": 4, "activation_checkpointing": False, "activation_offload": False, "loss_chunk_tokens": 0})


def test_stage_memory_matches_a_hand_computation():
    """Full fine-tune in bf16, 2 stages of 2 blocks, 4 micro-batches of 2 x 32 tokens under 1F1B."""
    tokens = 2 * 32
    first = pipeline.stage_memory(tiny(), rung=tiny_rung(), request=TINY_REQUEST, cluster=gpus(), stage_index=0,
                                  num_blocks=2)
    params = 2 * BLOCK_PARAMS + 128 * 64  # its blocks and the embedding
    assert (first.weights, first.gradients, first.optimizer) == (2 * params, 2 * params, 4 * params)
    assert first.activations == 2 * 2 * tokens * block_act_bytes()  # 1F1B: 2 micro-batches in flight on stage 0
    assert first.logits == 0 and first.gathered == 0
    forward_backward = 2 * params + 4 * params + 2 * params + first.activations  # + the accumulated gradients
    assert first.total == forward_backward + CUDA_CONTEXT_BYTES + CUDA_FRAGMENTATION_BYTES

    last = pipeline.stage_memory(tiny(), rung=tiny_rung(), request=TINY_REQUEST, cluster=gpus(), stage_index=1,
                                 num_blocks=2)
    params = 2 * BLOCK_PARAMS + 64 + 128 * 64  # its blocks, the final norm and the (untied) head
    assert (last.weights, last.gradients, last.optimizer) == (2 * params, 2 * params, 4 * params)
    assert last.activations == 1 * 2 * tokens * block_act_bytes()  # the last stage: one micro-batch at a time
    assert last.logits == tokens * 128 * (2 + 4 + 4 + 4)  # bf16 logits, fp32 copy, log-softmax, its gradient
    gpipe = pipeline.stage_memory(tiny(), rung=tiny_rung(pipeline_schedule="gpipe"), request=TINY_REQUEST,
                                  cluster=gpus(), stage_index=1, num_blocks=2)
    assert gpipe.activations == 4 * last.activations  # GPipe keeps every micro-batch


def test_tied_embeddings_live_on_both_ends():
    tied = dataclasses.replace(tiny(), tie_word_embeddings=True)
    last = pipeline.stage_memory(tied, rung=tiny_rung(), request=TINY_REQUEST, cluster=gpus(), stage_index=1,
                                 num_blocks=2)
    assert last.weights == 2 * (2 * BLOCK_PARAMS + 64 + 128 * 64)  # the head's copy of the embedding


def test_in_flight_and_bubble():
    assert [pipeline.in_flight("1f1b", stages=4, stage_index=i, micro_batches=8) for i in range(4)] == [4, 3, 2, 1]
    assert pipeline.in_flight("1f1b", stages=4, stage_index=0, micro_batches=2) == 2
    assert pipeline.in_flight("gpipe", stages=4, stage_index=3, micro_batches=8) == 8
    assert pipeline.bubble_fraction(stages=2, micro_batches=8) == pytest.approx(1 / 9)
    assert pipeline.bubble_fraction(stages=4, micro_batches=4) == pytest.approx(3 / 7)
    est = pipeline.estimate(tiny(), rung=tiny_rung(), request=TINY_REQUEST, cluster=gpus())
    assert est.bubble_s == pytest.approx(est.compute_s * 1 / 4)  # (S - 1) / M of the slowest stage's compute
    # (M + S - 1) slots of a stage's work: the bubble is (S-1)/(M+S-1) of compute + bubble
    assert est.bubble_s / (est.compute_s + est.bubble_s) == pytest.approx(pipeline.bubble_fraction(stages=2, micro_batches=4))


def test_p2p_bytes_and_their_time_on_the_link():
    assert pipeline.p2p_bytes(tiny(), rung=Rung("full", "no_shard", False), request=TINY_REQUEST, cluster=gpus()) == 2 * 32 * 64 * 2
    cluster = dataclasses.replace(gpus(), tflops=1e-4)  # a stage's work outlasts a transfer
    est = pipeline.estimate(tiny(), rung=tiny_rung(), request=TINY_REQUEST, cluster=cluster)
    assert est.comm_bytes == 2 * 4 * 2 * 32 * 64 * 2  # forward and back, 4 micro-batches, one boundary
    one = cluster.inter_hop_s + 2 * 32 * 64 * 2 / cluster.inter_bytes_per_s
    loop = LOOP_ALL_REDUCES * collective_s(8, ranks=2, all_reduce=True, bytes_per_s=cluster.inter_bytes_per_s,
                                           hop_s=cluster.inter_hop_s)
    assert est.comm_s == pytest.approx(2 * 4 * one + loop)
    # fill and drain are exposed; the other transfers hide behind the stages' work
    assert est.comm_s - est.comm_hidden_s == pytest.approx(2 * one + loop)
    assert est.step_s == pytest.approx(est.compute_s * 5 / 4 + 2 * one + loop)


def test_a_slow_link_paces_the_pipeline():
    slow = gpus(link_gbit=0.0001)
    est = pipeline.estimate(tiny(), rung=tiny_rung(), request=TINY_REQUEST, cluster=slow)
    one = slow.inter_hop_s + 2 * 32 * 64 * 2 / slow.inter_bytes_per_s
    per_micro = est.compute_s / 4
    assert one > per_micro
    exposed = min(2 * 4 * one, 2 * one + 4 * (one - per_micro))
    assert est.comm_s - est.comm_hidden_s == pytest.approx(exposed + (est.comm_s - 2 * 4 * one))


def test_uneven_gpus_split_by_what_each_has_left():
    """A 24 GiB and a 12 GiB card: when memory binds the smaller card takes fewer blocks, as the plan says."""
    seventy = shape("llama-3-70b")
    request = default_request(method="qlora", data={"max_length": 1024}, train={"micro_batch_size": 1, "grad_accum_steps": 8, "activation_checkpointing": True})
    rung = Rung(method="qlora", strategy="no_shard", cpu_offload=False, nodes=2, procs_per_node=1, pipeline_stages=2,
                activation_checkpointing=True)
    uneven = gpus(node_gib=(24, 12))
    split = pipeline.stage_split(seventy, rung=rung, request=request, cluster=uneven)
    assert sum(split) == 80 and split[0] > 1.8 * split[1]  # nothing fits: in proportion to the room left
    even = pipeline.stage_split(seventy, rung=rung, request=request, cluster=gpus(node_gib=(24, 24)))
    assert abs(even[0] - even[1]) <= 2

    eight = shape("llama-3-8b")
    lora = request.changed(method="lora", train={"micro_batch_size": 2, "grad_accum_steps": 4}, data={"max_length": 2048}, sharding={"pipeline_stages": "auto"})
    p = plan(eight, request=lora, cluster=gpus(node_gib=(24, 12)))
    assert p.chosen is not None and p.chosen.rung.pipeline_enabled
    stages = p.chosen.stages
    assert p.chosen.rung.stage_blocks == tuple(s.num_blocks for s in stages) and sum(p.chosen.rung.stage_blocks) == 32
    assert [s.device_bytes for s in stages] == [24 * GiB, 12 * GiB]
    assert all(s.memory_total <= s.budget_bytes for s in stages)
    text = format_plan(p)
    assert (f"stage 0: blocks 0-{stages[0].num_blocks - 1} on node 0 (24.0 GiB), "
            f"stage 1: blocks {stages[0].num_blocks}-31 on node 1 (12.0 GiB)") in text
    carried = json.loads(p.to_json())["chosen"]
    assert carried["rung"]["stage_blocks"] == list(p.chosen.rung.stage_blocks)
    assert [s["num_blocks"] for s in carried["stages"]] == list(p.chosen.rung.stage_blocks)


def test_equal_gpus_with_room_balance_compute_not_memory():
    """The last stage also runs the LM head (a quarter of a 1B Llama's matmuls): it takes fewer blocks."""
    one_b = shape("llama-3.2-1b")
    request = default_request(method="full", data={"max_length": 2048}, train={"micro_batch_size": 2, "grad_accum_steps": 4, "activation_checkpointing": True})
    rung = Rung(method="full", strategy="no_shard", cpu_offload=False, nodes=2, procs_per_node=1, pipeline_stages=2,
                activation_checkpointing=True)
    split = pipeline.stage_split(one_b, rung=rung, request=request, cluster=gpus(vram_gib=16))
    assert split[0] > split[1] and sum(split) == 16
    est = pipeline.estimate(one_b, rung=dataclasses.replace(rung, stage_blocks=split), request=request,
                            cluster=gpus(vram_gib=16))
    a, b = (s.compute_s for s in est.stages)
    assert abs(a - b) / max(a, b) < 0.15


def test_ranking_on_a_slow_link_and_a_fast_one():
    """8B LoRA on two 16 GB machines: over 1 GbE the pipeline wins (FSDP moves ~3x the weights per
    micro-batch); over a fast link FSDP wins (no bubble)."""
    request = default_request(method="lora", data={"max_length": 2048}, train={"micro_batch_size": 2, "grad_accum_steps": 4, "activation_checkpointing": True}, sharding={"pipeline_stages": "auto"})
    slow = plan(shape("llama-3-8b"), request=request, cluster=gpus(vram_gib=16, link_gbit=1.0))
    assert slow.chosen.rung.pipeline_enabled
    fsdp = [o for o in slow.options if o.fits and o.allowed and not o.rung.pipeline_enabled]
    assert all(slow.chosen.batch_s < o.batch_s for o in fsdp)
    fast = plan(shape("llama-3-8b"), request=request, cluster=gpus(vram_gib=16, link_gbit=400.0))
    assert not fast.chosen.rung.pipeline_enabled
    assert any(o.rung.pipeline_enabled and o.fits for o in fast.options)


def test_pipelines_only_where_asked_or_on_gpus():
    request = default_request(train={"grad_accum_steps": 4}, sharding={"pipeline_stages": "auto"})
    assert not any(o.rung.pipeline_enabled for o in plan(shape("llama-3.2-1b"), request=request, cluster=gpus(nodes=1)).options)
    cpu = dataclasses.replace(gpus(count=2, nodes=1), device="cpu")
    assert not any(o.rung.pipeline_enabled for o in plan(shape("llama-3.2-1b"), request=request, cluster=cpu).options)
    named = plan(shape("llama-3.2-1b"), request=request.changed(sharding={"pipeline_stages": 2}), cluster=cpu)
    assert all(o.rung.pipeline_enabled == o.allowed for o in named.options)
    # pipeline_stages: 1 (the default): priced for the advice, never taken
    none = plan(shape("llama-3.2-1b"), request=request.changed(sharding={"pipeline_stages": 1}), cluster=gpus())
    assert all(not o.allowed for o in none.options if o.rung.pipeline_enabled)
    assert any(o.rung.pipeline_enabled for o in none.options) and not none.chosen.rung.pipeline_enabled
    too_few = plan(shape("llama-3.2-1b"), request=default_request(train={"grad_accum_steps": 1}, sharding={"pipeline_stages": "auto"}),
                   cluster=gpus())
    assert not any(o.rung.pipeline_enabled for o in too_few.options)  # a schedule needs a micro-batch per stage


def test_advice_lines_are_true():
    request = default_request(method="full", sharding={"strategy": "full_shard"}, data={"max_length": 2048}, train={"micro_batch_size": 2, "grad_accum_steps": 4, "activation_checkpointing": True})
    p = plan(shape("llama-3.2-1b"), request=request, cluster=gpus(vram_gib=16))
    [line] = [w for w in p.warnings if w.startswith("communication dominates")]
    assert "hybrid_shard" not in line  # one GPU per node
    assert "grad_accum_steps amortise" not in line
    assert "a pipeline, full pipeline 2 stages" in line
    assert "(not requested: sharding.strategy=auto)" in line  # pipeline_stages: auto is the default
    assert "train.micro_batch_size=4 train.grad_accum_steps=2 (same batch)" in line
    # the larger micro-batch it names is shorter, as it says
    shorter = plan(shape("llama-3.2-1b"), request=request.changed(train={"micro_batch_size": 4, "grad_accum_steps": 2}),
                   cluster=gpus(vram_gib=16))
    assert shorter.chosen.step_s < p.chosen.step_s
    # several GPUs per node: hybrid_shard keeps the weight traffic inside the node, and is named
    hsdp = plan(shape("llama-3.2-1b"), request=request.changed(sharding={"strategy": "shard_grad_op"}),
                cluster=gpus(count=2, vram_gib=16))
    [line] = [w for w in hsdp.warnings if w.startswith("communication dominates")]
    assert "hybrid_shard, lora hybrid_shard" in line  # faster than the chosen step, so named
    assert "full hybrid_shard" not in line  # slower here (a full gradient crosses per micro-batch): not advice


def test_a_pipeline_that_nearly_fits_is_named_with_what_it_lacks():
    request = default_request(data={"max_length": 1024}, train={"micro_batch_size": 1, "grad_accum_steps": 8, "activation_checkpointing": True})
    p = plan(shape("llama-3-70b"), request=request, cluster=gpus())
    assert not p.chosen.rung.pipeline_enabled
    [line] = [w for w in p.warnings if w.startswith("communication dominates")]
    assert "a pipeline, qlora pipeline 2 stages" in line and "GiB more per GPU" in line


def test_gpus_flag_per_node():
    assert cluster_overrides(gpus="1x24GB,1x12GB") == [
        "cluster.device=cuda", "cluster.gpus_per_node=1", "cluster.vram_gib=12.0", "cluster.nodes=2",
        "cluster.node_vram_gib=[24.0, 12.0]"]
    with pytest.raises(UserError, match="same number of processes"):
        cluster_overrides(gpus="1x24GB,2x12GB")
    with pytest.raises(UserError, match="describes 2 nodes but --nodes 3"):
        cluster_overrides(gpus="1x24GB,1x12GB", nodes=3)
    recipe = load_recipe(ROOT / "recipes" / "llama-70b-qlora-2x24gb.yaml", cluster_overrides(gpus="1x24GB,1x12GB"))
    cluster = plan_for_recipe(recipe).cluster
    assert cluster.node_device_bytes == (24 * GiB, 12 * GiB) and cluster.device_bytes == 12 * GiB
    bad = load_recipe(ROOT / "recipes" / "llama-70b-qlora-2x24gb.yaml", ["cluster.node_vram_gib=[24, 12, 12]"])
    with pytest.raises(UserError, match="node_vram_gib has 3 entries for cluster.nodes=1"):
        resolve_cluster(bad.cluster, detected=None)


def test_the_issue_jobs():
    """Issue 22's table: the 70B QLoRA over 1 GbE on two 24 GB machines takes a pipeline at under a
    tenth of the 2,750 s/step of FSDP + offload; the 1B full fine-tune on two 16 GB machines plans
    faster than one machine alone, held-out split and all (issue 31: the pipelined loop evaluates
    through its stages)."""
    seventy = plan_for_recipe(load_recipe(ROOT / "recipes" / "llama-70b-qlora-2nodes-1gbe.yaml"))
    assert seventy.chosen.rung.pipeline_enabled and seventy.chosen.step_s < 275
    shipped = ROOT / "recipes" / "llama-70b-qlora-2x24gb.yaml"  # as shipped, moved onto two machines
    moved = plan_for_recipe(load_recipe(shipped, cluster_overrides(gpus="1x24GB", nodes=2, link="1Gbit")))
    assert moved.chosen.rung.pipeline_enabled and moved.chosen.step_s < 275
    tight = plan_for_recipe(load_recipe(shipped, ["planner.headroom=0.1"]))  # the recipe comment's fallback
    assert tight.chosen.label == "qlora full_shard +offload +ckpt"
    recipe = ROOT / "recipes" / "llama-1b-full-2x24gb.yaml"
    flags = ["sharding.strategy=auto"]  # the recipe names full_shard; pipeline_stages: auto is the default
    two = plan_for_recipe(load_recipe(recipe, flags + cluster_overrides(gpus="1x16GB", nodes=2, link="1Gbit")))
    one = plan_for_recipe(load_recipe(recipe, flags + cluster_overrides(gpus="1x16GB", nodes=1)))
    assert two.request.data.eval_sources  # the recipe's held-out split stays on
    assert two.chosen.rung.pipeline_enabled and two.chosen.batch_s < one.chosen.batch_s
    assert not two.refused
    # as shipped (full_shard named) the plan keeps it, and its warning names the pipeline and the key
    shipped_1b = plan_for_recipe(load_recipe(recipe, cluster_overrides(gpus="1x16GB", nodes=2, link="1Gbit")))
    assert not shipped_1b.chosen.rung.pipeline_enabled
    assert any("a pipeline, full pipeline 2 stages" in w and "sharding.strategy=auto" in w for w in shipped_1b.warnings)
