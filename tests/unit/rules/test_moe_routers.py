"""`lora.train_router` (issue 21): the routers moe_routers.py finds in transformers' module tree, what
`plan` and the trainer say is trained (one count), and the refusals the planner and trainer share."""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import pytest
import torch
from families import tiny_config

from homelab_ft.errors import UserError
from homelab_ft.model import loading
from homelab_ft.plan.planner import default_request, plan
from homelab_ft.plan.price import params
from homelab_ft.plan.report import lora_text
from homelab_ft.plan.shape.shapes import model_shape
from homelab_ft.recipe.config import LoraConfig
from homelab_ft.rules import moe_routers, refusals
from homelab_ft.rung import Rung, RungError

CPU = params.Cluster(device="cpu", nodes=1, gpus_per_node=1, device_bytes=16 << 30, host_ram_bytes=16 << 30,
                     inter_link_gbit=1.0, tflops=1.0)

ROUTERS = {
    # model_type: (a router's name in the first MoE block, its own parameters)
    "qwen3_moe": ("model.layers.0.mlp.gate", {"weight": (4, 64)}),
    "mixtral": ("model.layers.0.mlp.gate", {"weight": (4, 64)}),
    "gpt_oss": ("model.layers.0.mlp.router", {"weight": (4, 64), "bias": (4,)}),
    "deepseek_v3": ("model.layers.1.mlp.gate", {"weight": (4, 64)}),
    "glm4_moe": ("model.layers.1.mlp.gate", {"weight": (4, 64)}),
    "qwen2_moe": ("model.layers.0.mlp.gate", {"weight": (4, 64)}),  # not its [1, hidden] shared_expert_gate
}


def _meta(model_type: str):
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(tiny_config(model_type))


def _shape(model_type: str):
    config = tiny_config(model_type)
    with tempfile.TemporaryDirectory() as folder:
        config.save_pretrained(folder)
        return model_shape(json.loads((Path(folder) / "config.json").read_text()))


@pytest.mark.parametrize("model_type", sorted(ROUTERS))
def test_routers_are_found_from_the_module_tree(model_type):
    model = _meta(model_type)
    name, own = ROUTERS[model_type]
    found = moe_routers.routers(model)
    assert name in found and len(found) == sum(1 for _ in _fused(model))
    assert {n: tuple(p.shape) for n, p in found[name].named_parameters(recurse=False)} == own
    assert all(k.startswith(tuple(found)) for k in moe_routers.router_parameters(model))


def _fused(model):
    return [m for m in model.modules() if hasattr(m, "has_gate") and hasattr(m, "is_transposed")]


def test_a_dense_model_has_no_router():
    assert moe_routers.routers(_meta("llama")) == {}
    assert all(b.router_params == 0 for b in _shape("llama").blocks)


@pytest.mark.parametrize("model_type", ["qwen3_moe", "gpt_oss", "deepseek_v3", "glm4_moe", "qwen3_next"])
@pytest.mark.parametrize("train_router", [False, True])
def test_plan_counts_what_the_trainer_trains(model_type, train_router):
    """The `lora` line's trainable count (params.trainable_params) equals loading.count_params on the
    model the trainer builds, with and without the routers. Before loading.peft_v5_targets, PEFT
    rewrote DeepSeek-V3's, GLM-4-MoE's and Qwen3-Next's shared-expert targets into target_parameters
    (their adapters gone, PEFT's ParamWrapper on the experts, refused with lora.dropout > 0)."""
    from transformers import AutoModelForCausalLM

    shape = _shape(model_type)
    request = default_request(method="lora", lora={"r": 4, "target_modules": ("all-linear",), "train_router": train_router})
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_config(model_type), dtype=torch.float32)
    lora = loading.attach_lora(model, LoraConfig(r=4, alpha=8, dropout=0.05, train_router=train_router),
                               compute_dtype=torch.float32)
    trainable, _ = loading.count_params(lora)
    assert not lora.peft_config["default"].target_parameters  # the experts are moe_experts' (ExpertLora)
    assert params.trainable_params(shape, request) == trainable
    routers = sum(p.numel() for n, p in lora.named_parameters() if p.requires_grad and ".lora_" not in n)
    every = sum(b.num_blocks * b.router_params for b in shape.blocks)
    assert every > 0 and routers == params.router_params(shape, request) == (every if train_router else 0)
    text = lora_text(shape, request)
    assert text.endswith(f"; {trainable:,} trainable parameters at r=4"), text
    assert ("routers trained in full" in text) == train_router and ("routers frozen" in text) != train_router


def test_lora_line_names_attention_experts_and_routers():
    """Before: `all-linear: q_proj, k_proj, v_proj, o_proj (4 per block; no routers or Mamba projections
    to leave out)` on an MoE model, without the experts' adapters that are most of what trains."""
    text = lora_text(_shape("qwen3_moe"), default_request(method="lora", lora={"r": 4, "target_modules": ("all-linear",)}))
    assert text.startswith("all-linear: self_attn.{q_proj, k_proj, v_proj, o_proj} in 4 blocks; "
                           "mlp.experts.{gate_up_proj, down_proj} of each of 4 experts in 4 blocks; "
                           "routers frozen (lora.train_router: false); "), text
    dense = lora_text(_shape("llama"), default_request(method="lora", lora={"r": 4, "target_modules": ("q_proj", "v_proj")}))
    assert dense.startswith("target_modules q_proj,v_proj: self_attn.{q_proj, v_proj} in 4 blocks; "), dense
    assert "router" not in dense


def test_router_refusals_are_one_line_and_shared():
    dense = _shape("llama")
    with pytest.raises(UserError, match=r"^lora.train_router: true, but model.path m \(llama") as err:
        plan(dense, request=default_request(method="lora", lora={"train_router": True}), cluster=CPU, model="m")
    assert "\n" not in str(err.value) and "set lora.train_router: false" in str(err.value)
    moe = _shape("qwen3_moe")
    two = params.Cluster(**{**CPU.__dict__, "gpus_per_node": 2, "device": "cuda"})
    with pytest.raises(RungError, match="does not train in a pipeline yet: set sharding.pipeline_stages=1"):
        plan(moe, request=default_request(method="lora", sharding={"pipeline_stages": 2}, train={"grad_accum_steps": 2},
                                     lora={"train_router": True}), cluster=two)
    options = plan(moe, request=default_request(method="lora", sharding={"pipeline_stages": "auto"}, train={"grad_accum_steps": 2}, lora={"train_router": True}), cluster=two).options
    adapters = [o for o in options if o.method != "full"]
    assert {o.rung.strategy for o in adapters} >= {"no_shard", "full_shard"}  # DDP and FSDP2 train it
    assert not any(o.rung.pipeline_enabled for o in adapters)
    assert any(o.rung.pipeline_enabled for o in plan(moe, request=default_request(method="lora", sharding={"pipeline_stages": "auto"}, train={"grad_accum_steps": 2}), cluster=two).options)  # priced without it
    # the trainer's check (train/build.py, preflight) is the same function
    assert refusals.trained_router(Rung("lora", "no_shard", False, procs_per_node=2, pipeline_stages=2), train_router=True)
    assert refusals.trained_router(Rung("lora", "no_shard", False, procs_per_node=2), train_router=True) is None


def test_attach_refuses_a_dense_model():
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_config(tiny_config("llama"), dtype=torch.float32)
    with pytest.raises(UserError, match=r"lora.train_router: true, but model.path \(llama\) has no MoE router"):
        loading.attach_lora(model, LoraConfig(r=4, train_router=True), compute_dtype=torch.float32)


def test_a_router_trained_in_fp32_casts_around_a_bf16_base():
    """lora.dtype=float32 on a bf16 base: the router's weight is fp32 (its AdamW state too), its
    logits and routing weights come back in bf16, as a frozen router's would."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_config("qwen3_moe"), dtype=torch.bfloat16)
    lora = loading.attach_lora(model, LoraConfig(r=4, train_router=True), compute_dtype=torch.bfloat16)
    router = next(iter(moe_routers.routers(lora).values()))
    assert router.weight.dtype == torch.float32 and router.weight.requires_grad
    logits, scores, _ = router(torch.randn(3, 64, dtype=torch.bfloat16))
    assert logits.dtype == scores.dtype == torch.bfloat16
    loss = lora(input_ids=torch.tensor([[1, 2, 3, 4]])).logits.float().sum()
    loss.backward()
    assert router.weight.grad is not None and router.weight.grad.dtype == torch.float32
    compute = loading.attach_lora(AutoModelForCausalLM.from_config(tiny_config("qwen3_moe"), dtype=torch.bfloat16),
                                  LoraConfig(r=4, train_router=True, dtype="compute"), compute_dtype=torch.bfloat16)
    assert next(iter(moe_routers.routers(compute).values())).weight.dtype == torch.bfloat16


def test_the_planner_prices_the_trained_routers():
    """With train_router the estimate grows by the routers' gradients and AdamW moments, and by their
    weights moving from the compute dtype to the adapters' (fp32 here on a bf16 GPU base)."""
    from homelab_ft.plan.ladder import option_rung
    from homelab_ft.plan.price.memory import estimate

    shape = _shape("qwen3_moe")
    gpu = params.Cluster(**{**CPU.__dict__, "device": "cuda"})
    frozen, trained = (default_request(method="lora", lora={"r": 4, "target_modules": ("all-linear",), "train_router": t})
                       for t in (False, True))
    rung = option_rung("lora", "no_shard", False, request=frozen, cluster=gpu)
    off, on = (estimate(shape, rung=rung, request=r, cluster=gpu) for r in (frozen, trained))
    routers = params.router_params(shape, trained)
    assert routers == sum(b.num_blocks * b.router_params for b in shape.blocks) > 0
    assert on.trainable_params - off.trainable_params == routers
    assert on.memory.gradients - off.memory.gradients == 4 * routers
    assert on.memory.optimizer - off.memory.optimizer == 8 * routers
    assert on.memory.weights - off.memory.weights == (4 - 2) * routers
