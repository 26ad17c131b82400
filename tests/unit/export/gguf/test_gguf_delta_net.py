"""Qwen 3.5 (dense and MoE) and Qwen3-Next, whose linear-attention layers are a gated delta net:
written as llama.cpp's qwen35 / qwen35moe / qwen3next as convert_hf_to_gguf.py's Qwen3NextModel and
Qwen3_5TextModel write them and models/qwen35.cpp, qwen35moe.cpp, qwen3next.cpp read them."""

from __future__ import annotations

import numpy as np
import pytest
from families import save_tiny, with_config

from homelab_ft.export.gguf import arch as gguf_arch
from homelab_ft.export.gguf import check as gguf_check
from homelab_ft.export.gguf import export as gguf_export
from homelab_ft.export.gguf import reshape as gguf_reshape
from homelab_ft.export.gguf import vocab as gguf_vocab


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    cache = {}

    def get(model_type: str):
        if model_type not in cache:
            cache[model_type] = save_tiny(tmp_path_factory.mktemp(model_type), model_type)
        return cache[model_type]

    return get


def test_qwen35_linear_attention_is_written_with_llama_cpps_sizes_and_value_head_order(tiny, tmp_path, write_f32):
    """The tiny model has 2 key heads and 4 value heads, so the value heads are reordered to the
    tiled order (gguf_reshape.v_heads_tiled) wherever they run along an axis, and A is -exp(A_log)."""
    from safetensors import safe_open
    from transformers import AutoConfig

    model_dir = tiny("qwen3_5_text")
    config = AutoConfig.from_pretrained(model_dir)
    arch, fields, tensors = write_f32(model_dir, tmp_path / "q35.gguf")
    assert arch == "qwen35"
    assert (fields["ssm.conv_kernel"], fields["ssm.state_size"], fields["ssm.group_count"], fields["ssm.time_step_rank"],
            fields["ssm.inner_size"]) == (config.linear_conv_kernel_dim, config.linear_key_head_dim,
                                          config.linear_num_key_heads, config.linear_num_value_heads,
                                          config.linear_value_head_dim * config.linear_num_value_heads)
    assert fields["full_attention_interval"] == 4 and config.layer_types[3] == "full_attention"
    # qwen35.cpp requires sections; [11, 11, 10, 0] would abort ggml's rope (sum > the 4 rotated dims):
    # each of the 2 rotated pairs keeps its interleaved section, as llama.cpp b11739 runs it (tests/e2e)
    assert fields["rope.dimension_sections"] == [1, 1, 0, 0]
    assert fields["rope.dimension_count"] == config.head_dim // 4  # partial_rotary_factor 0.25
    with safe_open(str(model_dir / "model.safetensors"), framework="pt") as f:
        a_log = f.get_tensor("model.layers.0.linear_attn.A_log").numpy()
        dt_bias = f.get_tensor("model.layers.0.linear_attn.dt_bias").numpy()
        conv = f.get_tensor("model.layers.0.linear_attn.conv1d.weight").numpy()
    tiled = [0, 2, 1, 3]  # value head j of key head g (index 2g + j) at position 2j + g
    np.testing.assert_allclose(tensors["blk.0.ssm_a"], -np.exp(a_log)[tiled], rtol=1e-6)
    np.testing.assert_array_equal(tensors["blk.0.ssm_dt.bias"], dt_bias[tiled])
    assert tensors["blk.0.ssm_conv1d.weight"].shape == (conv.shape[0], conv.shape[2])  # squeezed, as the converter
    assert "blk.0.attn_qkv.weight" in tensors and "blk.0.attn_gate.weight" in tensors and "blk.0.ssm_alpha.weight" in tensors
    assert tensors["blk.3.attn_q.weight"].shape[0] == 2 * config.num_attention_heads * config.head_dim  # query + gate
    assert gguf_check.verify_gguf(tmp_path / "q35.gguf", model_dir, gguf_type="f32").max_abs_diff <= 1e-6


def test_qwen3_next_keeps_in_proj_qkvz_whole_as_ssm_in(tiny, tmp_path, write_f32):
    """gguf-py 0.19 maps in_proj_qkvz to ssm_in, which qwen3next.cpp cuts per key head as
    transformers does (its value heads stay grouped; it repeats q and k interleaved to match)."""
    from safetensors import safe_open

    model_dir = tiny("qwen3_next")
    arch, fields, tensors = write_f32(model_dir, tmp_path / "next.gguf")
    assert arch == "qwen3next"
    with safe_open(str(model_dir / "model.safetensors"), framework="pt") as f:
        qkvz = f.get_tensor("model.layers.0.linear_attn.in_proj_qkvz.weight").numpy()
        a_log = f.get_tensor("model.layers.0.linear_attn.A_log").numpy()
    np.testing.assert_array_equal(tensors["blk.0.ssm_in.weight"], qkvz)
    np.testing.assert_allclose(tensors["blk.0.ssm_a"], -np.exp(a_log), rtol=1e-6)
    assert "blk.0.ssm_ba.weight" in tensors and "blk.0.ffn_gate_inp_shexp.weight" in tensors
    assert fields["expert_shared_feed_forward_length"] == 32
    assert gguf_check.verify_gguf(tmp_path / "next.gguf", model_dir, gguf_type="f32").max_abs_diff <= 1e-6


def test_what_llama_cpp_runs_otherwise_is_refused(tiny, tmp_path):
    base = tiny("qwen3_5_moe_text")
    for name, config, refusal in [
        ("pattern", {"layer_types": ["linear_attention", "full_attention"] * 2}, "layer_types = .* but llama.cpp runs"),
        ("heads", {"linear_value_head_dim": 32}, "linear_value_head_dim = 32 but llama.cpp runs this architecture with 16"),
        ("bias", {"attention_bias": True}, "attention_bias = True but llama.cpp runs this architecture with False"),
    ]:
        with pytest.raises(gguf_arch.GgufUnsupported, match=refusal):
            gguf_arch.check_architecture(with_config(tmp_path / name, base, **config))
    with pytest.raises(gguf_arch.GgufUnsupported, match="norm_topk_prob = False but llama.cpp runs this architecture"):
        gguf_arch.check_architecture(with_config(tmp_path / "norm", tiny("qwen3_next"), norm_topk_prob=False))
    interval = with_config(tmp_path / "interval", base, full_attention_interval=2,
                       layer_types=["linear_attention", "full_attention"] * 2)
    gguf_arch.check_architecture(interval)  # the pattern llama.cpp builds from the interval the file carries


def test_mtp_layers_are_left_out_and_qwen35_split_rules_are_the_converters(tiny, tmp_path):
    """A released Qwen 3.5 holds its multi-token-prediction block as `mtp.*`, which transformers drops
    on load and the converter leaves out with --no-mtp; the Qwen 3.5 tokenizer's split regex is
    llama.cpp's `qwen35`."""
    import shutil

    import torch
    from safetensors.torch import load_file, save_file
    from transformers import AutoConfig

    model_dir = tmp_path / "mtp"
    shutil.copytree(tiny("qwen3_5_moe_text"), model_dir)
    state = load_file(str(model_dir / "model.safetensors"))
    state["mtp.fc.weight"] = torch.zeros(64, 128)
    save_file(state, str(model_dir / "model.safetensors"), metadata={"format": "pt"})
    target = gguf_arch.check_architecture(model_dir)
    plan = gguf_export.plan_tensors(model_dir, AutoConfig.from_pretrained(model_dir), target=target, gguf_type="f32")
    assert not any(source.startswith("mtp.") for item in plan for _, source in item.sources)
    assert target.layout.reshaped == gguf_reshape.QWEN35_DELTA_NET
    assert gguf_vocab._bpe_pre(model_dir) == "qwen35"
