"""What each family can do, read from transformers' classes (model/family.py, model/targets.py,
model/quant.py): the attention default, what `all-linear` wraps, QLoRA's unquantizable rule, and
the one-line refusals, over every family of tests/families.py (issue 20 point 3)."""

from __future__ import annotations

import logging

import pytest
import torch
from families import FAMILIES, save_tiny, tiny_config

from homelab_ft.errors import UserError
from homelab_ft.model import family, loading, quant, targets
from homelab_ft.plan.planner import default_request
from homelab_ft.plan.price import params
from homelab_ft.recipe.config import LoraConfig, ModelConfig, QuantConfig
from homelab_ft.rules import lora_targets


def _meta(model_type: str, config=None):
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config or tiny_config(model_type))


@pytest.mark.parametrize("model_type", FAMILIES)
def test_auto_attention_is_one_the_family_supports(model_type):
    config = tiny_config(model_type)
    cls = family.causal_lm_class(config)
    chosen = family.attention("auto", config=config)
    assert chosen == ("sdpa" if cls._supports_sdpa else "eager")
    family.check(config, attn_implementation="auto", activation_checkpointing=True, sharded=True)


def test_gemma2_and_gpt_oss_load_with_the_default_and_refuse_sdpa(tmp_path, caplog):
    """sdpa was the default and transformers refuses it for both (issue 20: neither could load)."""
    for model_type in ("gemma2", "gpt_oss"):
        model_dir = save_tiny(tmp_path / model_type, model_type, with_tokenizer=False)
        with caplog.at_level(logging.INFO, logger="homelab_ft.model.family"):
            model = loading.load_model(ModelConfig(path=str(model_dir)), model_dir, dtype=torch.float32,
                                       device=torch.device("cpu"))
        assert model.config._attn_implementation == "eager"
        assert "attention: eager" in caplog.text
        with pytest.raises(UserError, match=rf"^model.attn_implementation: {model_type} .* does not support sdpa; "
                                            "set model.attn_implementation: auto"):
            family.check(tiny_config(model_type), attn_implementation="sdpa", activation_checkpointing=False,
                         sharded=False)


def test_refusals_name_the_family_and_the_fix(monkeypatch):
    config = tiny_config("llama")
    cls = family.causal_lm_class(config)
    monkeypatch.setattr(cls, "supports_gradient_checkpointing", False)
    with pytest.raises(UserError, match="^llama .*activation checkpointing; set train.activation_checkpointing: false"):
        family.check(config, attn_implementation="auto", activation_checkpointing=True, sharded=False)
    monkeypatch.setattr(cls, "_no_split_modules", None)
    with pytest.raises(UserError, match="^llama .*FSDP cannot shard it; use sharding.strategy: no_shard"):
        family.check(config, attn_implementation="auto", activation_checkpointing=False, sharded=True)


@pytest.mark.parametrize("model_type", FAMILIES)
def test_all_linear_is_every_plain_linear_the_owner_calls(model_type):
    """The resolved suffixes match exactly PEFT's own all-linear set less routers with a forward of
    their own and Mamba projections whose weight the fused kernel reads."""
    from peft.tuners.tuners_utils import check_target_module_exists

    model = _meta(model_type)
    resolved = targets.lora_targets(model)
    peft_set = {name for name, _ in lora_targets._candidates(model)}
    matched = {name for name, _ in model.named_modules() if name and check_target_module_exists(
        type("C", (), {"target_modules": resolved, "exclude_modules": None, "layers_to_transform": None,
                       "layers_pattern": None})(), name)}
    assert matched <= peft_set and matched
    for name in peft_set - matched:  # what was left out is a router or a weight a kernel reads
        module = model.get_submodule(name)
        assert not targets.linear_forward(type(module)) or lora_targets._weight_read_by_owner(model, name), name
    left_out = {name.rsplit(".", 1)[-1] for name in peft_set - matched}
    expected = {"llama4_text": {"router"}, "phimoe": {"router"}, "falcon_h1": {"out_proj"},
                "nemotron_h": {"out_proj"}, "granitemoehybrid": {"out_proj"}}
    assert left_out == expected.get(model_type, set())


def test_quantized_linear_layers_stay_targets():
    """bitsandbytes' 4-bit layers and the shardable subclass (quant.linear4bit_class, each with its own
    forward) are linear layers PEFT wraps, unlike a model's router; and a config's list needs no weights."""
    import bitsandbytes as bnb

    from homelab_ft.model import quant

    assert targets.linear_forward(bnb.nn.Linear4bit) and targets.linear_forward(quant.linear4bit_class())
    assert targets.linear_forward(torch.nn.Linear)
    assert targets.for_config(tiny_config("llama4_text")) == targets.lora_targets(_meta("llama4_text"))
    assert "router" not in targets.for_config(tiny_config("llama4_text"))


@pytest.mark.parametrize("model_type", ["llama4_text", "phimoe", "falcon_h1", "nemotron_h", "granitemoehybrid"])
def test_all_linear_lora_trains_where_peft_crashed_or_refused(model_type, caplog):
    """issue 20: a router's tuple inside PEFT (llama4, phimoe); `out_proj` refused (falcon_h1, nemotron_h)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_config(model_type), dtype=torch.float32)
    with caplog.at_level(logging.INFO, logger="homelab_ft.model.targets"):
        model = loading.attach_lora(model, LoraConfig(r=4, dropout=0.0))
    assert "lora.target_modules all-linear: " in caplog.text and "not wrapped: " in caplog.text
    ids = torch.randint(3, 300, (2, 8))
    model(ids, labels=ids).loss.backward()
    assert all(p.grad is not None for n, p in model.named_parameters() if p.requires_grad)


def test_all_linear_on_an_image_text_model_is_logged_by_the_language_models_layers(caplog):
    """Idefics3's vision encoder has q/k/v_proj too, so PEFT's suffix list needs the language model's
    layer index (`text_model.layers.0.self_attn.k_proj`); the log names the wrapped layers instead,
    each layer index a `*`, and none of the vision side's."""
    from tiny_vlm import tiny_vlm_config
    from transformers import AutoModelForImageTextToText

    with torch.device("meta"):
        model = AutoModelForImageTextToText.from_config(tiny_vlm_config("idefics3"))
    with caplog.at_level(logging.INFO, logger="homelab_ft.model.targets"):
        resolved = targets.resolve(model, "all-linear")
    assert "text_model.layers.0.self_attn.k_proj" in resolved  # what PEFT is handed: exact, if long
    logged = caplog.text.split("lora.target_modules all-linear: ")[1].split(",")
    assert "model.text_model.layers.*.self_attn.k_proj" in [name.strip() for name in logged]
    assert not [name for name in logged if "vision" in name or ".0." in name]


def test_per_layer_embeddings_do_not_refuse_qlora():
    """Gemma 4 at its real default size: the per-layer embedding table was 45% of the counted
    weights and the 10% rule refused the model; embedding tables are on neither side now."""
    from transformers import CONFIG_MAPPING

    quant.raise_if_unquantizable(_meta("gemma4_text", CONFIG_MAPPING["gemma4_text"]()))
    # fused experts count as quantizable: quant.quantize_experts packs them in 4 bits (moe_experts.py)
    quant.raise_if_unquantizable(_meta("qwen3_moe"))


@pytest.mark.parametrize("model_type", FAMILIES)
def test_quantizable_check_refuses_in_one_line_or_passes(model_type, tmp_path):
    """From config.json as preflight reads it: the Mamba hybrids' `time_step_limit: [0, inf]` is
    written as {"__float__": "Infinity"} and crashed the check (granitemoehybrid, falcon_h1, nemotron_h)."""
    import json

    tiny_config(model_type).save_pretrained(tmp_path)
    try:
        quant.check_quantizable(json.loads((tmp_path / "config.json").read_text()), QuantConfig(), device="cpu")
    except UserError as err:
        assert "\n" not in str(err) and "use method: lora or full" in str(err)


@pytest.mark.parametrize("model_type", FAMILIES)
def test_the_planner_prices_what_all_linear_wraps(model_type):
    """The shape's all-linear layers (plan/shape/derive.py, torch-free once cached) are exactly those
    model/targets hands PEFT (one rule: homelab_ft/rules/lora_targets.py), and `plan` names them."""
    from homelab_ft.plan.report import lora_text
    from homelab_ft.plan.shape.shapes import model_shape

    config = tiny_config(model_type)
    shape = model_shape(config.to_dict())
    model = _meta(model_type)
    wrapped = set(lora_targets.wrapped_names(model))
    chosen = targets.for_config(config)
    for block in shape.blocks:
        layer = next(n for n, m in model.named_modules() if m is _blocks(model)[block.first_layer])
        for lin in block.linears:
            full = f"{layer}.{lin.name}"
            assert lin.all_linear == (full in wrapped), (block.kind, lin.name)
            assert lin.all_linear == any(full == s or full.endswith("." + s) for s in chosen), (lin.name, chosen)
    text = lora_text(shape, default_request(method="lora", lora={"target_modules": ("all-linear",)}))
    leaves = {lin.name.rsplit(".", 1)[-1] for b in shape.blocks for lin in b.linears if lin.all_linear}
    assert text.startswith("all-linear: ") and all(leaf in text for leaf in leaves), text
    skipped = [lin.name for b in shape.blocks for lin in b.linears if not lin.all_linear]
    assert ("left out" in text) == bool(skipped), text


def _blocks(model):
    from homelab_ft.plan.shape.derive import decoder_blocks

    return decoder_blocks(model)


def test_plan_text_names_what_lora_trains():
    from homelab_ft.plan.report import lora_text
    from homelab_ft.plan.shape.shapes import model_shape

    llama = model_shape(tiny_config("llama").to_dict())
    every, two = (default_request(method="lora", lora={"r": 4, "target_modules": targets})
                  for targets in (("all-linear",), ("q_proj", "v_proj")))
    assert lora_text(llama, every) == (
        "all-linear: self_attn.{q_proj, k_proj, v_proj, o_proj} in 4 blocks; mlp.{gate_proj, up_proj, down_proj} "
        f"in 4 blocks; {params.adapter_params(llama, every):,} trainable parameters at r=4")
    assert lora_text(llama, two) == (f"target_modules q_proj,v_proj: self_attn.{{q_proj, v_proj}} in 4 blocks; "
                                     f"{params.adapter_params(llama, two):,} trainable parameters at r=4")
    assert "left out, as routers and Mamba projections PEFT cannot wrap: feed_forward.router" in lora_text(
        model_shape(tiny_config("llama4_text").to_dict()), every)
