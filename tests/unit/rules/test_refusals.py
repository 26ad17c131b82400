"""One test per trainer refusal (homelab_ft/rules/refusals.py): the ladder does not offer the option the
trainer would refuse, `plan` names why (its `refused` lines and JSON), and the trainer's own check
(distributed/stages.check_recipe, run by preflight) refuses it with the same line. Torch-free but
for the last check, which imports torch.distributed.pipelining."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from homelab_ft.plan.inputs import Cluster
from homelab_ft.plan.planner import default_request, plan
from homelab_ft.plan.price.memory import GiB
from homelab_ft.plan.report import format_plan
from homelab_ft.plan.shape.shapes import model_shape
from homelab_ft.recipe.config import recipe_from_dict
from homelab_ft.rules import refusals
from homelab_ft.rung import Rung, RungError

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
TWO_NODES = Cluster(device="cuda", nodes=2, gpus_per_node=1, device_bytes=16 * GiB, host_ram_bytes=64 * GiB,
                    inter_link_gbit=1.0, tflops=40.0)
"""The issue-31 cluster: two 16 GB machines over 1 GbE, where a pipeline is the fastest option."""


def _shape(name: str = "llama-3.2-1b"):
    return model_shape(json.loads((CONFIGS / f"{name}.json").read_text()))


# (recipe sections, what the refusal line says): each turns the pipelines off that the plain request gets
CASES = {
    "micro_batches": ({"train": {"grad_accum_steps": 1}}, "train.grad_accum_steps >= 2"),
    "activation_offload": ({"train": {"activation_checkpointing": True, "activation_offload": True}},
                           "train.activation_offload is not run pipelined yet"),
    "objective": ({"objective": "dpo"}, "objective=dpo is not run pipelined yet; set objective: sft"),
    "objective_grpo": ({"objective": "grpo", "grpo": {"reward_funcs": ["exact_answer"]}},
                       "objective=grpo is not run pipelined yet; set objective: sft"),
    "eight_bit_base": ({"method": "qlora", "quant": {"bits": 8}}, "an 8-bit base is not run pipelined yet"),
    "dora": ({"method": "lora", "lora": {"use_dora": True}}, "lora.use_dora is not run pipelined yet"),
    "samples": ({"train": {"sample_every": 10, "sample_prompts": ["hi"]}}, "train.sample_every is not run pipelined"),
    "host_embedding": ({"method": "lora", "train": {"embedding_offload": True}},
                       "train.embedding_offload=true: a pipeline places the embeddings on its first stage"),
}
BASE = {"method": "full", "train": {"grad_accum_steps": 4}}


def _request(sections: dict):
    merged = {**BASE, **sections, "train": {**BASE["train"], **sections.get("train", {})}}
    return default_request(**merged)


def test_the_plain_request_gets_pipelines():
    """What every case below takes away: on two 16 GB machines a pipeline is offered, and wins."""
    got = plan(_shape(), request=_request({}), cluster=TWO_NODES)
    assert any(o.rung.pipeline_enabled for o in got.options) and got.chosen.rung.pipeline_enabled
    assert not got.refused


def test_a_held_out_split_keeps_the_pipeline():
    """The pipelined loop evaluates through its stages (evaluate_pipeline): a held-out split turns nothing off."""
    got = plan(_shape(), request=_request({"data": {"eval_fraction": 0.1}}), cluster=TWO_NODES)
    assert got.chosen.rung.pipeline_enabled and not got.refused


@pytest.mark.parametrize("rule", sorted(CASES))
def test_the_ladder_does_not_offer_what_the_trainer_refuses(rule):
    sections, line = CASES[rule]
    shape = _shape("qwen2.5-7b") if rule == "host_embedding" else _shape()  # an untied embedding
    got = plan(shape, request=_request(sections), cluster=TWO_NODES)
    method = got.request.method  # the other rungs are priced too (for the advice), with their own refusals
    assert not any(o.rung.pipeline_enabled for o in got.options if o.method == method)
    refused = [r for r in got.refused if r.label.startswith(f"{method} pipeline")]
    assert refused and all(line in r.reason for r in refused), got.refused
    assert line in format_plan(got) and any(line in r["reason"] for r in got.to_dict()["refused"])
    # named instead of `auto`: the plan refuses the recipe with the same line
    named = {**sections, "sharding": {"pipeline_stages": 2}}
    with pytest.raises(RungError, match=re.escape(line.split(" is not")[0])):
        plan(shape, request=_request(named), cluster=TWO_NODES)


def test_blocks_a_named_pipeline_cannot_fill():
    tiny = model_shape({"model_type": "llama", "vocab_size": 128, "hidden_size": 64, "num_hidden_layers": 2,
                        "num_attention_heads": 4, "num_key_value_heads": 4, "intermediate_size": 128,
                        "max_position_embeddings": 512})
    four = Cluster(device="cuda", nodes=1, gpus_per_node=4, device_bytes=16 * GiB, host_ram_bytes=64 * GiB)
    auto = plan(tiny, request=_request({}), cluster=four)
    assert {o.rung.pipeline_stages for o in auto.options} <= {1, 2}  # never more stages than blocks
    with pytest.raises(RungError, match="the model has 2 decoder block"):
        plan(tiny, request=_request({"sharding": {"pipeline_stages": 4}}), cluster=four)


def test_four_bit_experts_and_trained_routers():
    """The MoE rules: refused pipelines name their reason, the unpipelined options stay."""
    moe = _shape("qwen3-30b-a3b")
    two = Cluster(device="cuda", nodes=1, gpus_per_node=2, device_bytes=24 * GiB, host_ram_bytes=64 * GiB)
    qlora = plan(moe, request=_request({"method": "qlora", "data": {"max_length": 2048}}), cluster=two)
    assert [r.label for r in qlora.refused] == ["qlora pipeline 2 stages"]
    assert "4-bit experts in a stage are not built" in qlora.refused[0].reason
    router = plan(moe, request=_request({"method": "lora", "lora": {"train_router": True}}), cluster=two)
    [lora] = [r for r in router.refused if r.label.startswith("lora pipeline")]
    assert "lora.train_router: true does not train in a pipeline yet" in lora.reason


def test_a_refused_rung_is_shown_not_dropped():
    """rung._validate's refusals too: 8-bit AdamW cannot step FSDP2 shards."""
    got = plan(_shape(), request=_request({"train": {"optimizer": "adamw_8bit"}}), cluster=TWO_NODES)
    assert any(r.label == "qlora full_shard" and "cannot update FSDP2-sharded parameters" in r.reason
               for r in got.refused)
    assert "refused  " in format_plan(got)


def test_hybrid_shard_needs_two_nodes_in_one_place():
    one = Cluster(device="cuda", nodes=1, gpus_per_node=2, device_bytes=16 * GiB, host_ram_bytes=64 * GiB)
    with pytest.raises(RungError, match="needs cluster.nodes >= 2"):
        plan(_shape(), request=_request({"sharding": {"strategy": "hybrid_shard"}}), cluster=one)
    with pytest.raises(RungError, match="needs cluster.nodes >= 2"):
        Rung("full", "hybrid_shard", False, procs_per_node=2)


def test_every_rule_is_asked_by_refusals():
    """`refusals.refusals` asks each rule: a rung every rule refuses gets every line, in order."""
    rung = Rung("qlora", "no_shard", False, procs_per_node=4, pipeline_stages=4, quant_bits=8,
                activation_checkpointing=True, activation_offload=True, stage_blocks=(1, 1, 1, 1))
    recipe = recipe_from_dict({"objective": "dpo", "lora": {"use_dora": True, "train_router": True},
                               "data": {"eval_fraction": 0.1},  # no rule: a pipeline evaluates
                               "train": {"grad_accum_steps": 2, "sample_every": 1, "sample_prompts": ["hi"]}})
    found = refusals.refusals(rung, recipe, num_blocks=3, moe_experts=True)
    assert len(found) == 9  # every rule but the embedding table's (embedding_offload: auto)
    assert found[0].startswith("sharding.pipeline_stages=4 needs at least as many micro-batches")
    assert refusals.refusals(Rung("lora", "no_shard", False, procs_per_node=2, pipeline_stages=2),
                             recipe_from_dict({"train": {"grad_accum_steps": 2}}), num_blocks=4, moe_experts=True) == ()


def test_the_trainer_check_is_the_same_rule():
    """preflight's pipeline check (stages.check_recipe) raises the ladder's line."""
    from homelab_ft.distributed.stages import check_recipe

    recipe = recipe_from_dict({"objective": "dpo", "cluster": {"gpus_per_node": 2},
                               "sharding": {"pipeline_stages": 2}, "train": {"grad_accum_steps": 4}})
    rung = Rung("lora", "no_shard", False, procs_per_node=2, pipeline_stages=2)
    with pytest.raises(RungError, match=refusals.objective(rung, objective="dpo")):
        check_recipe(recipe, rung=rung, config={"num_hidden_layers": 4}, moe_experts=False)


@pytest.mark.parametrize(("train", "procs", "refused"), [
    ({"micro_batch_size": 1, "grad_accum_steps": 2}, 1, True),
    ({"micro_batch_size": 1, "grad_accum_steps": 2}, 2, False),   # 1 x 2 x 2 = 4
    ({"micro_batch_size": 3, "grad_accum_steps": 1}, 1, True),
    ({"micro_batch_size": 4, "grad_accum_steps": 1}, 1, False),
])
def test_kto_needs_four_rows_per_step_for_its_kl_estimate(train, procs, refused):
    """KTO's reference point is a mean over the step's rows on all ranks: fewer than 4 is refused in one
    line, by the ladder (no option offered, `plan` says why) and by preflight, before anything exists."""
    cluster = Cluster(device="cuda", nodes=1, gpus_per_node=procs, device_bytes=80 * GiB, host_ram_bytes=256 * GiB)
    request = default_request(method="lora", objective="dpo", dpo={"loss": "kto"}, train=train)
    line = "dpo.loss=kto estimates its KL reference point over each step's rows"
    if refused:  # the recipe's named method: refused in one line; `auto`: nothing offered, `plan` says why
        with pytest.raises(RungError, match=re.escape(line) + ".*to make it >= 4"):
            plan(_shape(), request=request, cluster=cluster)
        with pytest.raises(RungError, match=re.escape(line)):
            plan(_shape(), request=request.changed(method="auto"), cluster=cluster)
    else:
        assert plan(_shape(), request=request, cluster=cluster).options
    sft = plan(_shape(), request=default_request(method="lora", train=train), cluster=cluster)
    assert sft.options and not any(line in r.reason for r in sft.refused)
