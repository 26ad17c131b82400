"""Hybrids of Mamba 2 and attention layers written as llama.cpp reads them: Granite 4 hybrid
(granitemoehybrid) as convert_hf_to_gguf.py's GraniteHybridModel writes it (Mamba2Model's mixer
tensors, GraniteMoeModel's fused experts) and models/granite-hybrid.cpp reads it."""

from __future__ import annotations

import numpy as np
import pytest
from families import save_tiny, with_config

from homelab_ft.export.gguf import arch as gguf_arch
from homelab_ft.export.gguf import check as gguf_check
from homelab_ft.export.gguf import export as gguf_export


@pytest.fixture(scope="module")
def granite(tmp_path_factory, write_f32):
    """The tiny Granite 4 hybrid (3 Mamba layers, then attention; 4 experts and a shared MLP), and one
    without routed experts (Granite 4.0-H Micro's kind), each written as f32."""
    out = {}
    for name, config in (("moe", {}), ("dense", {"num_local_experts": 0})):
        model_dir = save_tiny(tmp_path_factory.mktemp(name), "granitemoehybrid", **config)
        out[name] = model_dir, *write_f32(model_dir, model_dir / "f32.gguf")[1:]
    return out


def test_mamba_layers_are_told_by_zero_kv_heads_and_their_tensors_are_mamba2models(granite):
    from safetensors import safe_open
    from transformers import AutoConfig

    model_dir, fields, tensors = granite["moe"]
    config = AutoConfig.from_pretrained(model_dir)
    assert fields["attention.head_count_kv"] == [0, 0, 0, config.num_key_value_heads]  # layer_types: 3 Mamba, 1 attention
    assert (fields["ssm.inner_size"], fields["ssm.time_step_rank"], fields["ssm.state_size"], fields["ssm.group_count"]) == (
        config.mamba_n_heads * config.mamba_d_head, config.mamba_n_heads, config.mamba_d_state, config.mamba_n_groups)
    assert fields["rope.scaling.finetuned"] is False  # position_embedding_type None: no rope, which llama.cpp turns by default
    with safe_open(str(model_dir / "model.safetensors"), framework="pt") as f:
        a_log = f.get_tensor("model.layers.0.mamba.A_log").numpy()
        d = f.get_tensor("model.layers.0.mamba.D").numpy()
        experts = f.get_tensor("model.layers.1.block_sparse_moe.input_linear.weight").numpy()
    np.testing.assert_allclose(tensors["blk.0.ssm_a"], -np.exp(a_log)[:, None], rtol=1e-6)  # (heads, 1): {1, heads}
    np.testing.assert_array_equal(tensors["blk.0.ssm_d"], d[:, None])
    assert tensors["blk.0.ssm_norm.weight"].shape == (config.mamba_n_groups, config.mamba_n_heads * config.mamba_d_head)
    ff = config.intermediate_size
    np.testing.assert_array_equal(tensors["blk.1.ffn_gate_exps.weight"], experts[:, :ff])
    np.testing.assert_array_equal(tensors["blk.1.ffn_up_exps.weight"], experts[:, ff:])
    assert fields["expert_shared_feed_forward_length"] == config.shared_intermediate_size
    assert "blk.3.attn_q.weight" in tensors and "blk.3.ssm_in.weight" not in tensors
    assert gguf_check.verify_gguf(model_dir / "f32.gguf", model_dir, gguf_type="f32").max_abs_diff == 0.0


def test_without_experts_the_shared_mlp_is_the_mlp(granite):
    from transformers import AutoConfig

    model_dir, fields, tensors = granite["dense"]
    config = AutoConfig.from_pretrained(model_dir)
    assert fields["feed_forward_length"] == config.shared_intermediate_size  # what granite-hybrid.cpp sizes ffn_* by
    assert {"blk.0.ffn_gate.weight", "blk.0.ffn_up.weight", "blk.0.ffn_down.weight"} <= set(tensors)
    assert "expert_count" not in fields and not any("shexp" in name for name in tensors)
    assert gguf_check.verify_gguf(model_dir / "f32.gguf", model_dir, gguf_type="f32").max_abs_diff == 0.0


def test_rope_is_switched_on_by_the_config_and_what_llama_cpp_runs_otherwise_is_refused(granite, tmp_path):
    from gguf import GGUFReader

    model_dir = granite["moe"][0]
    rope = with_config(tmp_path / "rope", model_dir, position_embedding_type="rope")
    gguf_export.write_gguf(rope, rope / "f32.gguf", gguf_type="f32", name="tiny")
    assert GGUFReader(rope / "f32.gguf").fields["granitehybrid.rope.scaling.finetuned"].contents() is True
    for name, config, refusal in [
        ("expand", {"mamba_expand": 3}, "mamba_expand = 3 but llama.cpp runs this architecture with 2"),
        ("conv", {"mamba_conv_bias": False}, "mamba_conv_bias = False but llama.cpp runs"),
    ]:
        with pytest.raises(gguf_arch.GgufUnsupported, match=refusal):
            gguf_arch.check_architecture(with_config(tmp_path / name, model_dir, **config))
