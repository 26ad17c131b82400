"""gpt-oss as llama.cpp's `gpt-oss` (convert_hf_to_gguf.py's GptOssModel, src/models/openai-moe.cpp):
the interleaved gate_up experts split and transposed, the attention sinks, biases everywhere, the
swiglu constants and the sliding pattern llama.cpp fixes, YaRN's keys, and llama-quantize's
MXFP4_MOE layout (`--gguf-type mxfp4_moe`)."""

from __future__ import annotations

import numpy as np
import pytest
from families import save_tiny, with_config

from homelab_ft.export.gguf import arch as gguf_arch
from homelab_ft.export.gguf import check as gguf_check
from homelab_ft.export.gguf import export as gguf_export


@pytest.fixture(scope="module")
def gpt_oss(tmp_path_factory):
    return save_tiny(tmp_path_factory.mktemp("gpt_oss"), "gpt_oss")


def _fields(reader) -> dict:
    return {name.removeprefix("gpt-oss."): field.contents() for name, field in reader.fields.items()
            if name.startswith("gpt-oss.")}


def test_gpt_oss_is_written_as_llama_cpp_reads_it(gpt_oss, tmp_path):
    from gguf import GGUFReader
    from safetensors import safe_open
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(gpt_oss)
    path = tmp_path / "f32.gguf"
    gguf_export.write_gguf(gpt_oss, path, gguf_type="f32", name="tiny")
    reader = GGUFReader(path)
    tensors = {t.name: t for t in reader.tensors}
    experts, hidden, ff = config.num_local_experts, config.hidden_size, config.intermediate_size
    # gguf lists dims innermost first: openai-moe.cpp creates ffn_gate_exps {n_embd, n_ff_exp, n_expert}
    assert [int(d) for d in tensors["blk.1.ffn_gate_exps.weight"].shape] == [hidden, ff, experts]
    assert [int(d) for d in tensors["blk.1.ffn_down_exps.weight"].shape] == [ff, hidden, experts]
    assert [int(d) for d in tensors["blk.1.ffn_up_exps.bias"].shape] == [ff, experts]
    assert [int(d) for d in tensors["blk.1.attn_sinks.weight"].shape] == [config.num_attention_heads]
    with safe_open(str(gpt_oss / "model.safetensors"), framework="pt") as f:
        gate_up = f.get_tensor("model.layers.1.mlp.experts.gate_up_proj").numpy()
        down = f.get_tensor("model.layers.1.mlp.experts.down_proj").numpy()
        bias = f.get_tensor("model.layers.1.mlp.experts.gate_up_proj_bias").numpy()
    stored = {name: np.asarray(t.data).reshape([int(d) for d in reversed(t.shape)]) for name, t in tensors.items()}
    np.testing.assert_array_equal(stored["blk.1.ffn_gate_exps.weight"][2], gate_up[2][:, ::2].T)
    np.testing.assert_array_equal(stored["blk.1.ffn_up_exps.weight"][2], gate_up[2][:, 1::2].T)
    np.testing.assert_array_equal(stored["blk.1.ffn_down_exps.weight"][3], down[3].T)
    np.testing.assert_array_equal(stored["blk.1.ffn_up_exps.bias"], bias[:, 1::2])
    fields = _fields(reader)
    assert fields["attention.sliding_window"] == config.sliding_window
    assert fields["expert_feed_forward_length"] == ff and fields["expert_count"] == experts
    rope = config.rope_parameters
    assert (fields["rope.scaling.factor"], fields["rope.scaling.original_context_length"]) == (
        rope["factor"], rope["original_max_position_embeddings"])
    assert (fields["rope.scaling.yarn_beta_fast"], fields["rope.scaling.yarn_beta_slow"]) == (32.0, 1.0)
    assert gguf_check.verify_gguf(path, gpt_oss, gguf_type="f32").max_abs_diff == 0.0


def test_mxfp4_moe_holds_the_experts_in_mxfp4_and_the_rest_as_llama_quantize_does(gpt_oss, tmp_path):
    """llama-quant.cpp's MXFP4_MOE: a tensor of more than one expert MXFP4, every other quantized
    tensor Q8_0; routers, biases, sinks and norms stay F32 as convert_hf_to_gguf.py keeps them."""
    import gguf

    path = tmp_path / "mxfp4.gguf"
    gguf_export.write_gguf(gpt_oss, path, gguf_type="mxfp4_moe", name="tiny")
    reader = gguf.GGUFReader(path)
    types = {t.name: t.tensor_type.name for t in reader.tensors if t.name.startswith("blk.0.")}
    assert {types[f"blk.0.ffn_{p}_exps.weight"] for p in ("gate", "up", "down")} == {"MXFP4"}
    assert types["blk.0.attn_q.weight"] == types["blk.0.attn_output.weight"] == "Q8_0"
    assert {types[name] for name in ("blk.0.ffn_gate_inp.weight", "blk.0.attn_sinks.weight", "blk.0.ffn_up_exps.bias",
                                     "blk.0.attn_q.bias", "blk.0.post_attention_norm.weight")} == {"F32"}
    assert reader.fields["general.file_type"].contents() == gguf.LlamaFileType.MOSTLY_MXFP4_MOE
    check = gguf_check.verify_gguf(path, gpt_oss, gguf_type="mxfp4_moe")  # every tensor bit for bit as rounded
    assert check.bound is None and check.max_abs_diff > 0


@pytest.mark.parametrize(("config", "refusal"), [
    ({"swiglu_limit": 5.0}, "swiglu_limit = 5.0 but llama.cpp runs this architecture with 7.0"),
    ({"swiglu_alpha": 1.5}, "swiglu_alpha = 1.5 but llama.cpp runs this architecture with 1.702"),
    ({"attention_bias": False}, "attention_bias = False but llama.cpp runs this architecture with True"),
    ({"layer_types": ["full_attention"] * 4}, r"layer_types = \['full_attention'.* with \['sliding_attention', 'full"),
])
def test_a_gpt_oss_llama_cpp_runs_otherwise_is_refused(gpt_oss, tmp_path, config, refusal):
    """openai-moe.cpp fixes the swiglu's alpha and limit, requires the attention biases and
    alternates sliding and full layers, with no GGUF key for any of them."""
    with pytest.raises(gguf_arch.GgufUnsupported, match=refusal):
        gguf_arch.check_architecture(with_config(tmp_path / "edited", gpt_oss, **config))
