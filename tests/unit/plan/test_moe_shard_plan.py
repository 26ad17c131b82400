"""The planner on sharded MoE QLoRA (issue 21 point 3): it offers only what the trainer builds (FSDP2
and DDP, no pipeline), and prices the QuantStates of the packed experts whole on every rank, as
distributed/sharded_experts.py keeps them."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import build_recipe
import pytest
import torch
from families import tiny_config

from homelab_ft.errors import UserError
from homelab_ft.model import moe_experts
from homelab_ft.plan.inputs import Cluster
from homelab_ft.plan.planner import default_request, plan
from homelab_ft.plan.price import params
from homelab_ft.plan.report import format_plan
from homelab_ft.plan.shape.shapes import model_shape
from homelab_ft.recipe.config import QuantConfig, recipe_from_dict
from homelab_ft.rung import Rung, RungError

pytest.importorskip("bitsandbytes")

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
TWO_24GB = Cluster(device="cuda", nodes=1, gpus_per_node=2, device_bytes=24 << 30, host_ram_bytes=64 << 30)


@pytest.mark.parametrize("stages", ["auto", 2])
def test_planner_never_offers_a_pipeline_of_4bit_experts(stages):
    """Before: the planner could choose a pipelined MoE QLoRA that train/build.py refuses."""
    shape = model_shape(json.loads((CONFIGS / "qwen3-30b-a3b.json").read_text()))
    request = default_request(method="qlora", sharding={"pipeline_stages": stages}, data={"max_length": 2048}, train={"micro_batch_size": 1, "grad_accum_steps": 4})
    if stages == 2:  # the pipeline the recipe names is refused by the plan, as the trainer refuses it
        with pytest.raises(RungError, match="does not pipeline yet"):
            plan(shape, request=request, cluster=TWO_24GB)
        return
    got = plan(shape, request=request, cluster=TWO_24GB)
    assert not any(o.rung.pipeline_enabled and o.method == "qlora" for o in got.options)  # never offered
    assert [r.label for r in got.refused if "does not pipeline yet" in r.reason] == ["qlora pipeline 2 stages"]
    assert "refused  qlora pipeline 2 stages: method: qlora on an MoE model does not pipeline yet" in format_plan(got)
    # full_shard: what the trainer now builds (before: refused, like the pipeline)
    assert got.chosen.method == "qlora" and got.chosen.rung.fsdp_enabled and not got.chosen.rung.pipeline_enabled


def test_planner_choice_on_two_processes_is_one_the_trainer_builds(tmp_path):
    """`strategy: auto` on 2 processes for a tiny MoE QLoRA: what the planner picks passes the trainer's own
    refusals (train/build.py for pipelines, sharded_qlora.check_model for FSDP2), checked from config.json."""
    from homelab_ft.distributed import sharded_qlora
    from homelab_ft.rung import pipelined
    from homelab_ft.train import build

    tiny_config("qwen3_moe").save_pretrained(tmp_path)
    recipe = recipe_from_dict(build_recipe.tiny_run(
        tmp_path, method="qlora", rows=tmp_path / "x.jsonl", lora=None, output=None,
        train={"max_steps": None, "micro_batch_size": 1, "grad_accum_steps": 2},
        cluster={"nodes": 1, "gpus_per_node": 2}, sharding={"pipeline_stages": "auto"}), source="test")
    from homelab_ft.plan.planner import plan_for_recipe

    cpu = Cluster(device="cpu", nodes=1, gpus_per_node=2, device_bytes=4 << 30, host_ram_bytes=8 << 30)
    got = plan_for_recipe(recipe, cluster=cpu)
    assert got.chosen is not None and got.chosen.method == "qlora"
    rung = pipelined(got.chosen.rung, recipe.sharding)
    assert not rung.pipeline_enabled
    config = json.loads((tmp_path / "config.json").read_text())
    if rung.fsdp_enabled:
        sharded_qlora.check_model(config, recipe, rung=rung, device_type="cpu")
    with pytest.raises(UserError, match="does not pipeline yet"):
        build.refuse_pipelined_experts(got.shape.facts, rung=Rung("qlora", "no_shard", False, procs_per_node=2,
                                                                  pipeline_stages=2))


@pytest.mark.parametrize("model_type", ["qwen3_moe", "mixtral", "gpt_oss"])
def test_replicated_quant_states_include_the_experts(model_type, tmp_path):
    """What every rank of a sharded 4-bit base keeps whole: the dense layers' constants and every
    expert's (QuantState absmax, nested absmax, offset), as built by moe_experts.quantize."""
    from transformers import AutoModelForCausalLM

    config = tiny_config(model_type)
    config.save_pretrained(tmp_path)
    shape = model_shape(json.loads((tmp_path / "config.json").read_text()))
    request = default_request(method="qlora", quant={"bits": 4, "double_quant": True})
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    built = 0
    for module in moe_experts.fused_experts(model).values():
        moe_experts.quantize(module, quant_type=QuantConfig().quant_type, double_quant=True)
        packed = sum(getattr(module, f"{p}_4bit").numel() for p in moe_experts.projections(module))
        built += moe_experts.packed_bytes(module) - packed  # uint8 storage: one byte per element
        built += sum(4 * (s.code.numel() + s.state2.code.numel()) for p in moe_experts.projections(module)
                     for s in moe_experts.states(module, p))  # and each state's own codes (fp32)
    dense = dataclasses.replace(shape, blocks=tuple(dataclasses.replace(b, expert_stacks=()) for b in shape.blocks))
    assert built > 0
    assert params.quant_state_bytes(shape, request) - params.quant_state_bytes(dense, request) == built
