"""The reshaping rules (gguf_reshape.py): every rule's join undoes its split exactly, and its
shapes are the split's; the value-head reorder is llama.cpp's tiled order."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from homelab_ft.export.gguf import reshape as gguf_reshape

CONFIG = SimpleNamespace(num_attention_heads=4, qk_nope_head_dim=8, v_head_dim=16, kv_lora_rank=16,
                         linear_num_key_heads=2, linear_num_value_heads=6, linear_key_head_dim=4,
                         linear_value_head_dim=3, mamba_n_groups=3, num_local_experts=3, mlp_multipliers=[0.5, 1.7],
                         attention_in_multiplier=0.9, key_multiplier=0.3, attention_out_multiplier=1.3,
                         ssm_out_multiplier=0.7, embedding_multiplier=3.0, lm_head_multiplier=0.2, ssm_in_multiplier=1.1,
                         ssm_multipliers=[0.5, 0.8, 1.2, 1.3, 0.6], mamba_d_ssm=4, mamba_d_state=2, mamba_n_heads=2)
"""Enough of a config for every rule: MLA's sizes, and a gated delta net with 3 value heads per key head."""

SHAPES = {
    "mlp.experts.gate_up_proj": (3, 8, 10),
    "mlp.experts.gate_up_proj_bias": (3, 10),
    "mlp.experts.down_proj": (3, 5, 8),
    "mlp.experts.down_proj_bias": (3, 8),
    "self_attn.sinks": (4,),
    "mlp.gate.e_score_correction_bias": (4,),
    "self_attn.kv_b_proj.weight": (4 * (8 + 16), 16),
    "linear_attn.in_proj_qkv.weight": (2 * 2 * 4 + 6 * 3, 8),
    "linear_attn.conv1d.weight": (2 * 2 * 4 + 6 * 3, 1, 4),
    "linear_attn.in_proj_z.weight": (6 * 3, 8),
    "linear_attn.in_proj_a.weight": (6, 8),
    "linear_attn.in_proj_b.weight": (6, 8),
    "linear_attn.out_proj.weight": (8, 6 * 3),
    "linear_attn.dt_bias": (6,),
    "linear_attn.A_log": (6,),
    "block_sparse_moe.input_linear.weight": (3, 10, 8),
    "shared_mlp.input_linear.weight": (10, 8),
    "shared_mlp.output_linear.weight": (8, 5),
    "mamba.dt_bias": (4,),
    "mamba.A_log": (4,),
    "mamba.D": (4,),
    "mamba.norm.weight": (12,),
    "layer_scalar": (1,),
    "experts.gate_up_proj": (3, 10, 8),
    "experts.down_proj": (3, 8, 5),
    "router.scale": (8,),
    "router.per_expert_scale": (3,),
    "feed_forward.gate_proj.weight": (6, 4),
    "feed_forward.down_proj.weight": (4, 6),
    "self_attn.q_proj.weight": (8, 4),
    "self_attn.k_proj.weight": (4, 4),
    "self_attn.v_proj.weight": (4, 4),
    "self_attn.o_proj.weight": (4, 8),
    "mamba.out_proj.weight": (4, 4),
    "embed_tokens.weight": (10, 4),
    "lm_head.weight": (10, 4),
    "mamba.in_proj.weight": (2 * 4 + 2 * 3 * 2 + 2, 4),
}

RULES = (*gguf_reshape.GPT_OSS, gguf_reshape.SELECTION_BIAS, gguf_reshape.MLA_KV_B, *gguf_reshape.QWEN35_DELTA_NET,
         *gguf_reshape.QWEN3NEXT_DELTA_NET, *gguf_reshape.GEMMA4, *gguf_reshape.GRANITE_HYBRID, *gguf_reshape.mamba2("mamba"),
         *gguf_reshape.FALCON_H1)


@pytest.mark.parametrize("rule", RULES, ids=lambda rule: f"{rule.suffix}-{rule.parts[0]}")
def test_join_undoes_split_and_the_shapes_are_the_splits(rule):
    array = np.random.default_rng(0).standard_normal(SHAPES[rule.suffix]).astype(np.float32)
    parts = rule.split(array, CONFIG)
    assert [p.shape for p in parts] == list(rule.shapes(array.shape, CONFIG))
    back = rule.join(parts, CONFIG)
    if rule.suffix.endswith("A_log") or rule in gguf_reshape.FALCON_H1:  # -exp then log, x m / m: float32 ulps
        np.testing.assert_allclose(back, array, rtol=1e-6)
    else:
        np.testing.assert_array_equal(back, array)
    key = f"model.layers.3.{rule.suffix}"
    assert rule.applies(key) and not rule.applies(key + "x")
    assert rule.names(key, CONFIG) == [f"model.layers.3.{part}" for part in rule.parts]


def test_gpt_oss_gate_and_up_are_the_even_and_odd_columns():
    """transformers' GptOssExperts._apply_gate: gate = gate_up[..., ::2], up = gate_up[..., 1::2];
    llama.cpp holds each as (experts, ff, hidden)."""
    gate_up = np.arange(3 * 8 * 10, dtype=np.float32).reshape(3, 8, 10)
    gate, up = gguf_reshape.GPT_OSS[0].split(gate_up, CONFIG)
    np.testing.assert_array_equal(gate[1], gate_up[1][:, ::2].T)
    np.testing.assert_array_equal(up[2], gate_up[2][:, 1::2].T)


def test_value_heads_are_tiled_as_llama_cpp_broadcasts_the_key_heads():
    """Value head j of key head g (Hugging Face's index g * 3 + j) goes to j * 2 + g, where
    ggml's repeat of the 2 key heads over 6 value heads reads key head (index mod 2)."""
    heads = np.arange(6, dtype=np.float32)
    tiled = gguf_reshape.v_heads_tiled(heads, CONFIG, axis=0, head_dim=1)
    assert tiled.tolist() == [0, 3, 1, 4, 2, 5]
    assert all(int(head) // 3 == position % 2 for position, head in enumerate(tiled))
    np.testing.assert_array_equal(gguf_reshape.v_heads_tiled(tiled, CONFIG, axis=0, head_dim=1, inverse=True), heads)
