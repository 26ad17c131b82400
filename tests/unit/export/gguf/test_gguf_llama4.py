"""Llama 4 (text) as llama.cpp's llama4, as convert_hf_to_gguf.py's Llama4Model (conversion/llama4.py)
writes it and llama-model.cpp / models/llama4.cpp read it: no q/k permutation (its rope turns
consecutive pairs, as llama.cpp's), the experts' fused gate_up_proj cut into gate and up, the dense
MLP's width as feed_forward_length and the experts' as expert_feed_forward_length, the MoE layer
step; what llama.cpp fixes in C++ (8192-token chunks, a NoPE layer every 4th, its query temperature,
the q/k norm by expert count) refused where a config differs."""

from __future__ import annotations

import numpy as np
import pytest
from families import AS_RELEASED, save_tiny, with_config

from homelab_ft.export.gguf import arch as gguf_arch
from homelab_ft.export.gguf import check as gguf_check

INTERLEAVED = {"interleave_moe_layer_step": 2, "moe_layers": [1, 3]}
"""Llama 4 Maverick's kind: every other layer MoE, the others a dense MLP."""


@pytest.fixture(scope="module")
def llama4(tmp_path_factory, write_f32):
    model_dir = save_tiny(tmp_path_factory.mktemp("llama4"), "llama4_text", **AS_RELEASED["llama4_text"], **INTERLEAVED)
    return model_dir, *write_f32(model_dir, model_dir / "f32.gguf")


def test_llama4_experts_sizes_and_rope_are_llama_cpps(llama4):
    from safetensors import safe_open
    from transformers import AutoConfig

    model_dir, arch, fields, tensors = llama4
    config = AutoConfig.from_pretrained(model_dir)
    assert arch == "llama4"
    assert fields["feed_forward_length"] == config.intermediate_size_mlp  # the dense layers' MLP
    assert fields["expert_feed_forward_length"] == config.intermediate_size
    assert fields["interleave_moe_layer_step"] == 2
    with safe_open(str(model_dir / "model.safetensors"), framework="pt") as f:
        gate_up = f.get_tensor("model.layers.1.feed_forward.experts.gate_up_proj").numpy()  # (experts, hidden, 2 ff)
        down = f.get_tensor("model.layers.1.feed_forward.experts.down_proj").numpy()  # (experts, ff, hidden)
        q = f.get_tensor("model.layers.0.self_attn.q_proj.weight").numpy()
    ff = config.intermediate_size
    np.testing.assert_array_equal(tensors["blk.1.ffn_gate_exps.weight"], gate_up[..., :ff].swapaxes(-1, -2))
    np.testing.assert_array_equal(tensors["blk.1.ffn_up_exps.weight"], gate_up[..., ff:].swapaxes(-1, -2))
    np.testing.assert_array_equal(tensors["blk.1.ffn_down_exps.weight"], down.swapaxes(-1, -2))
    np.testing.assert_array_equal(tensors["blk.0.attn_q.weight"], q)  # not permuted: llama.cpp ropes pairs as Llama 4
    assert "blk.0.ffn_gate.weight" in tensors and "blk.0.ffn_gate_inp.weight" not in tensors  # a dense layer
    assert gguf_check.verify_gguf(model_dir / "f32.gguf", model_dir, gguf_type="f32").max_abs_diff == 0.0


def test_what_llama_cpps_llama4_runs_otherwise_is_refused(llama4, tmp_path):
    model_dir = llama4[0]
    for name, config, refusal in [
        ("chunk", {"attention_chunk_size": 8}, "attention_chunk_size = 8 but llama.cpp runs this architecture with 8192"),
        ("nope", {"no_rope_layers": [1, 1, 0, 1]}, "no_rope_layers = \\[1, 1, 0, 1\\] but llama.cpp"),
        ("moe", {"moe_layers": [0, 1, 2, 3]}, "moe_layers = \\[0, 1, 2, 3\\] but llama.cpp runs this architecture with \\[1, 3\\]"),
        ("qk", {"use_qk_norm": False}, "use_qk_norm = False but llama.cpp runs this architecture with True"),
        ("temperature", {"floor_scale": 4096}, "floor_scale = 4096 but llama.cpp"),
    ]:
        with pytest.raises(gguf_arch.GgufUnsupported, match=refusal):
            gguf_arch.check_architecture(with_config(tmp_path / name, model_dir, **config))
