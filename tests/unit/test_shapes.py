"""shapes.py against the models transformers actually builds: exact parameter counts per component
for tiny configs of every family, and the total of accelerate's empty-model estimate for the real
configs shipped in tests/configs/."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from homelab_ft.errors import UserError
from homelab_ft.locate import locate_config, read_model_config
from homelab_ft.plan.shapes import SUPPORTED, model_shape

CONFIGS = Path(__file__).parent.parent / "configs"
REAL = sorted(p.stem for p in CONFIGS.glob("*.json"))

_BASE = dict(vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=128)
TINY = {
    "llama": dict(_BASE),
    "llama-biased-tied": dict(_BASE, model_type="llama", attention_bias=True, mlp_bias=True, tie_word_embeddings=True),
    "mistral": dict(_BASE, head_dim=32),
    "qwen2": dict(_BASE),
    "qwen3": dict(_BASE, head_dim=24, attention_bias=True),
    "gemma": dict(_BASE, head_dim=32),
    "gemma2": dict(_BASE, head_dim=16, final_logit_softcapping=30.0),
    "gemma3_text": dict(_BASE, head_dim=32),
    "phi3": dict(_BASE, num_key_value_heads=2, pad_token_id=0),
    "mixtral": dict(_BASE, num_local_experts=4, num_experts_per_tok=2),
    "qwen2_moe": dict(_BASE, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                      shared_expert_intermediate_size=48, mlp_only_layers=[1]),
    "qwen3_moe": dict(_BASE, head_dim=16, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                      decoder_sparse_step=2),
}


def _instantiate(config: dict):
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    kwargs = {k: v for k, v in config.items() if k != "model_type"}
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(AutoConfig.for_model(config["model_type"], **kwargs))


@pytest.mark.parametrize("name", sorted(TINY))
def test_tiny_model_counts_match_torch_per_component(name):
    config = {"model_type": name.split("-")[0], **TINY[name]}
    shape = model_shape(config)
    model = _instantiate(config)
    assert shape.total_params == sum(p.numel() for p in model.parameters())  # tied weights counted once

    inner = model.model
    assert inner.embed_tokens.weight.numel() == shape.embedding_params
    head_is_tied = model.lm_head.weight is inner.embed_tokens.weight
    assert head_is_tied == shape.tie_word_embeddings
    assert shape.lm_head_params == (0 if head_is_tied else model.lm_head.weight.numel())
    kinds = [b for b in shape.blocks for _ in range(b.num_blocks)]
    dense_only = set(config.get("mlp_only_layers", []))
    for index, layer in enumerate(inner.layers):
        named = dict(layer.named_parameters())
        attention = sum(p.numel() for n, p in named.items() if n.startswith("self_attn."))
        norms = sum(p.numel() for n, p in named.items() if n.endswith("layernorm.weight"))
        mlp = sum(named[n].numel() for n in named) - attention - norms
        is_sparse = any(n.startswith("mlp.experts") for n in named)
        kind = next(b for b in shape.blocks if (b.expert_params > 0) == is_sparse)
        assert (attention, mlp, norms) == (kind.attention_params, kind.mlp_params, kind.norm_params), index
        if index in dense_only:
            assert not is_sparse
    assert len(kinds) == len(inner.layers)


@pytest.mark.parametrize("name", sorted(TINY))
def test_tiny_linear_layers_are_the_models_nn_linear(name):
    """What the planner quantizes and targets with LoRA is exactly the blocks' nn.Linear modules."""
    import torch

    config = {"model_type": name.split("-")[0], **TINY[name]}
    shape = model_shape(config)
    model = _instantiate(config)
    linear = sum(m.weight.numel() for n, m in model.model.layers.named_modules() if type(m) is torch.nn.Linear)
    assert linear == shape.linear_weight_params


@pytest.fixture(scope="module")
def accelerate_counts():
    """sum(p.numel()) of the empty (meta) model accelerate's estimate builds, before and after
    re-tying: init_empty_weights re-registers every parameter on meta, which breaks the tie that
    from_config made, so accelerate's own estimate counts a tied head twice."""
    from accelerate import init_empty_weights
    from transformers import AutoConfig, AutoModelForCausalLM

    out = {}
    for name in REAL:
        config = json.loads((CONFIGS / f"{name}.json").read_text())
        with init_empty_weights():
            model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**config))
        untied = sum(p.numel() for p in model.parameters())
        model.tie_weights()
        out[name] = (untied, sum(p.numel() for p in model.parameters()))
    return out


@pytest.mark.parametrize("name", REAL)
def test_real_configs_match_accelerate_empty_model(name, accelerate_counts):
    shape = model_shape(json.loads((CONFIGS / f"{name}.json").read_text()))
    untied, tied = accelerate_counts[name]
    assert shape.total_params == tied
    assert untied == shape.total_params + (shape.embedding_params if shape.tie_word_embeddings else 0)


def test_moe_active_params_count_top_k_experts():
    mixtral = model_shape(json.loads((CONFIGS / "mixtral-8x7b.json").read_text()))
    block = mixtral.blocks[0]
    per_expert = 3 * mixtral.hidden_size * 14336
    assert block.mlp_params - block.mlp_active_params == (8 - 2) * per_expert
    assert mixtral.total_params - mixtral.active_params == mixtral.num_layers * 6 * per_expert


# --------------------------------------------------------------------------------------------
# reading configs


def test_reads_dir_json_path_and_hub_cache(tmp_path, monkeypatch):
    config = json.loads((CONFIGS / "qwen3-8b.json").read_text())
    model_dir = tmp_path / "model"
    model_dir.mkdir()
    (model_dir / "config.json").write_text(json.dumps(config))
    assert read_model_config(str(model_dir)) == config
    assert read_model_config(str(model_dir / "config.json")) == config

    snapshot = tmp_path / "hub" / "models--acme--tiny" / "snapshots" / "abc123"
    snapshot.mkdir(parents=True)
    (snapshot / "config.json").write_text(json.dumps(config))
    (tmp_path / "hub" / "models--acme--tiny" / "refs").mkdir()
    (tmp_path / "hub" / "models--acme--tiny" / "refs" / "main").write_text("abc123")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    assert read_model_config("acme/tiny") == config


def test_uncached_hub_id_falls_back_to_bundled_copy_or_explains(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "empty"))
    config, source = locate_config("meta-llama/Llama-3.1-8B-Instruct")
    assert "bundled" in source and model_shape(config).num_layers == 32
    with pytest.raises(UserError, match=r"acme/missing.*hf download acme/missing"):
        read_model_config("acme/missing")


def test_bad_inputs_are_user_errors(tmp_path):
    with pytest.raises(UserError, match="not found"):
        read_model_config(str(tmp_path / "nope.gguf"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(UserError, match=r"empty has no config.json"):
        read_model_config(str(tmp_path / "empty"))
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(UserError, match="not valid JSON"):
        read_model_config(str(tmp_path / "bad.json"))
    with pytest.raises(UserError) as err:
        model_shape({"model_type": "rwkv", "hidden_size": 64})
    assert "'rwkv'" in str(err.value) and all(t in str(err.value) for t in SUPPORTED)
    with pytest.raises(UserError, match="num_hidden_layers"):
        model_shape({"model_type": "llama", "hidden_size": 64, "num_attention_heads": 4, "vocab_size": 10})
