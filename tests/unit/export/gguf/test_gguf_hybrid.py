"""Hybrids of Mamba 2 and attention layers written as llama.cpp reads them: Granite 4 hybrid
(granitemoehybrid) as convert_hf_to_gguf.py's GraniteHybridModel writes it (Mamba2Model's mixer
tensors, GraniteMoeModel's fused experts) and models/granite-hybrid.cpp reads it; Falcon-H1 as
FalconH1Model writes it (its muP multipliers folded into the weights) and models/falcon-h1.cpp."""

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


MULTIPLIERS = {"mlp_multipliers": [0.5, 1.7], "attention_in_multiplier": 0.9, "key_multiplier": 0.3,
               "attention_out_multiplier": 1.3, "ssm_out_multiplier": 0.7, "ssm_in_multiplier": 1.1,
               "ssm_multipliers": [0.5, 0.8, 1.2, 1.3, 0.6], "embedding_multiplier": 3.0, "lm_head_multiplier": 0.2}
"""Falcon-H1's muP multipliers, none 1 (transformers' default config has all 1)."""


def test_falcon_h1s_multipliers_are_folded_into_the_weights(tmp_path, write_f32):
    """llama.cpp's falcon-h1 graph multiplies by none of them: each is in the weight whose input or
    output it scales, the mamba in_proj's per block (z, x, B, C, dt: compute_mup_vector)."""
    from safetensors import safe_open
    from transformers import AutoConfig

    model_dir = save_tiny(tmp_path / "falcon", "falcon_h1", **MULTIPLIERS)
    config = AutoConfig.from_pretrained(model_dir)
    _, fields, tensors = write_f32(model_dir, tmp_path / "falcon.gguf")
    with safe_open(str(model_dir / "model.safetensors"), framework="pt") as f:
        raw = {name: f.get_tensor(name).numpy() for name in ("model.embed_tokens.weight", "lm_head.weight",
                                                            "model.layers.1.self_attn.k_proj.weight",
                                                            "model.layers.1.mamba.in_proj.weight")}
    np.testing.assert_allclose(tensors["token_embd.weight"], raw["model.embed_tokens.weight"] * 3.0, rtol=1e-6)
    np.testing.assert_allclose(tensors["output.weight"], raw["lm_head.weight"] * 0.2, rtol=1e-6)
    np.testing.assert_allclose(tensors["blk.1.attn_k.weight"], raw["model.layers.1.self_attn.k_proj.weight"] * 0.9 * 0.3,
                               rtol=1e-6)
    inner, bc = config.mamba_d_ssm, config.mamba_n_groups * config.mamba_d_state
    in_proj = raw["model.layers.1.mamba.in_proj.weight"]
    for start, stop, block in ((0, inner, 0.5), (2 * inner, 2 * inner + bc, 1.2), (2 * inner + 2 * bc, None, 0.6)):
        np.testing.assert_allclose(tensors["blk.1.ssm_in.weight"][start:stop], in_proj[start:stop] * 1.1 * block, rtol=1e-6)
    assert fields["ssm.inner_size"] == inner and fields["attention.head_count_kv"] == config.num_key_value_heads
    check = gguf_check.verify_gguf(tmp_path / "falcon.gguf", model_dir, gguf_type="f32")
    assert check.max_abs_diff <= 1e-6  # multiplied, then divided back: float32 ulps


def test_a_falcon_h1_llama_cpp_runs_otherwise_is_refused(tmp_path):
    model_dir = save_tiny(tmp_path / "falcon", "falcon_h1")
    for name, config, refusal in [
        ("gate", {"mamba_rms_norm": True, "mamba_norm_before_gate": True}, "mamba_norm_before_gate = True but"),
        ("tied", {"tie_word_embeddings": True, "lm_head_multiplier": 0.5}, "tie_word_embeddings = True but"),
    ]:
        with pytest.raises(gguf_arch.GgufUnsupported, match=refusal):
            gguf_arch.check_architecture(with_config(tmp_path / name, model_dir, **config))


NEMOTRON_DENSE = {"layers_block_type": ["linear_attention", "mlp", "full_attention", "mlp"]}
"""Nemotron-H 8B / Nemotron Nano 9B v2's blocks (Mamba, relu2 MLP, attention); families.AS_RELEASED's
is Nemotron 3 Nano's, with MoE blocks."""


@pytest.fixture(scope="module")
def nemotron(tmp_path_factory, write_f32):
    from families import AS_RELEASED

    out = {}
    for name, config in (("moe", AS_RELEASED["nemotron_h"]), ("dense", NEMOTRON_DENSE)):
        model_dir = save_tiny(tmp_path_factory.mktemp(name), "nemotron_h", **config)
        out[name] = model_dir, *write_f32(model_dir, model_dir / "f32.gguf")
    return out


def test_nemotron_h_blocks_are_told_apart_by_their_sizes_as_nemotron_h_cpp_reads_them(nemotron):
    """One mixer per block: feed_forward_length only on the MLP / MoE blocks, KV heads only on the
    attention ones (Mamba: neither); MoE blocks make it nemotron_h_moe, their experts stacked under
    gguf-py's merged names; no rope keys (its attention has none); the Mamba 2 mixer as Granite's."""
    from safetensors import safe_open
    from transformers import AutoConfig

    for name, arch, ff in (("moe", "nemotron_h_moe", "moe_intermediate_size"), ("dense", "nemotron_h", "intermediate_size")):
        model_dir, written_arch, fields, tensors = nemotron[name]
        config = AutoConfig.from_pretrained(model_dir)
        assert written_arch == arch
        assert fields["feed_forward_length"] == [0, getattr(config, ff), 0, getattr(config, ff)]
        assert fields["attention.head_count_kv"] == [0, 0, config.num_key_value_heads, 0]
        assert fields["attention.layer_norm_epsilon"] == pytest.approx(config.layer_norm_epsilon)  # nemotron_h requires it
        assert not any(key.startswith("rope.") for key in fields)
        assert fields["ssm.inner_size"] == config.mamba_num_heads * config.mamba_head_dim
        assert tensors["blk.0.ssm_norm.weight"].shape == (config.n_groups, config.mamba_num_heads * config.mamba_head_dim)
        assert ("expert_count" in fields) == (name == "moe")
        assert gguf_check.verify_gguf(model_dir / "f32.gguf", model_dir, gguf_type="f32").max_abs_diff == 0.0
    model_dir, _, fields, tensors = nemotron["moe"]
    with safe_open(str(model_dir / "model.safetensors"), framework="pt") as f:
        up = f.get_tensor("backbone.layers.1.mixer.experts.2.up_proj.weight").numpy()
        bias = f.get_tensor("backbone.layers.1.mixer.gate.e_score_correction_bias").numpy()
    np.testing.assert_array_equal(tensors["blk.1.ffn_up_exps.weight"][2], up)
    np.testing.assert_array_equal(tensors["blk.1.exp_probs_b.bias"], bias)
    assert {"blk.1.ffn_down_shexp.weight", "blk.1.ffn_gate_inp.weight"} <= set(tensors)


def test_what_llama_cpps_nemotron_h_runs_otherwise_is_refused(nemotron, tmp_path):
    model_dir = nemotron["moe"][0]
    for name, config, refusal in [
        ("both", {"layers_block_type": ["linear_attention", "moe", "full_attention", "mlp"]}, "MLP blocks or MoE blocks"),
        ("act", {"mlp_hidden_act": "silu"}, "mlp_hidden_act = silu but llama.cpp runs this architecture with relu2"),
        ("latent", {"moe_latent_size": 32}, "moe_latent_size = 32 but llama.cpp runs this architecture with None"),
        ("bias", {"use_bias": True}, "use_bias = True but llama.cpp runs"),
    ]:
        with pytest.raises(gguf_arch.GgufUnsupported, match=refusal):
            gguf_arch.check_architecture(with_config(tmp_path / name, model_dir, **config))


def test_a_nemotron_h_adapter_gguf_names_the_checkpoints_tensors(nemotron, tmp_path):
    """PEFT wraps the model transformers builds, whose Nemotron-H blocks are `model.layers.*`; the
    checkpoint and the GGUF's names come from `backbone.layers.*` (transformers renames on load):
    the adapter GGUF follows the checkpoint (models/nemotron-h.cpp applies it: tests/e2e)."""
    import torch
    from gguf import GGUFReader
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from homelab_ft.export.gguf.adapter import check_adapter_gguf, write_adapter_gguf

    base = nemotron["moe"][0]
    peft = get_peft_model(AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32),
                          LoraConfig(r=2, lora_alpha=4, target_modules=["in_proj", "q_proj", "down_proj"],
                                     init_lora_weights=False))
    peft.save_pretrained(tmp_path / "adapter")
    write_adapter_gguf(tmp_path / "adapter", base, tmp_path / "adapter.gguf", name="tiny")
    names = {t.name for t in GGUFReader(tmp_path / "adapter.gguf").tensors}
    assert {"blk.0.ssm_in.weight.lora_a", "blk.2.attn_q.weight.lora_b", "blk.1.ffn_down_shexp.weight.lora_a"} <= names
    assert check_adapter_gguf(tmp_path / "adapter.gguf", peft, base) <= 1e-5
