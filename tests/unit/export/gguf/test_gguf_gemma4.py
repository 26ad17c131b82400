"""Gemma 4 (text) as llama.cpp's gemma4, as convert_hf_to_gguf.py's Gemma4Model writes it and
models/gemma4.cpp reads it: head sizes per layer type, proportional rope as rope_freqs, per-layer
embeddings, the layer scale, KV sharing, the MoE block's router scales; what llama.cpp runs
otherwise refused."""

from __future__ import annotations

import json

import numpy as np
import pytest
from families import save_tiny, with_config

from homelab_ft.export.gguf import arch as gguf_arch
from homelab_ft.export.gguf import check as gguf_check
from homelab_ft.export.gguf import export as gguf_export
from homelab_ft.export.gguf import hparams as gguf_hparams

SHARED = {"num_hidden_layers": 6, "layer_types": ["sliding_attention", "sliding_attention", "full_attention"] * 2,
          "num_kv_shared_layers": 3, "use_double_wide_mlp": True}
"""Gemma 4's E models: the last layers read the KV cache of the last sliding and full layer before
them, and their MLPs are twice as wide."""

MOE = {"enable_moe_block": True, "num_experts": 4, "top_k_experts": 2, "moe_intermediate_size": 32,
       "attention_k_eq_v": True, "num_global_key_value_heads": 1}
"""Gemma 4 26B-A4B-like: an MoE block beside the MLP, full layers' values their keys, fewer KV heads there."""


@pytest.fixture(scope="module")
def written(tmp_path_factory, write_f32):
    out = {}
    for name, config in (("base", {}), ("shared", SHARED), ("moe", MOE)):
        model_dir = save_tiny(tmp_path_factory.mktemp(name), "gemma4_text", **config)
        out[name] = model_dir, *write_f32(model_dir, model_dir / "f32.gguf")[1:]
    return out


def test_head_sizes_rope_and_per_layer_embeddings_are_gemma4_models(written):
    from transformers import AutoConfig

    model_dir, fields, tensors = written["base"]
    config = AutoConfig.from_pretrained(model_dir)
    heads = dict(zip(config.layer_types, gguf_hparams.per_layer(config, "head_dim"), strict=True))
    assert (fields["attention.key_length"], fields["attention.key_length_swa"]) == (heads["full_attention"],
                                                                                   heads["sliding_attention"])
    assert fields["attention.sliding_window_pattern"] == [kind == "sliding_attention" for kind in config.layer_types]
    assert fields["rope.dimension_count"] == heads["full_attention"]  # proportional: every pair counted ...
    turned = int(0.25 * heads["full_attention"] // 2)  # ... the first quarter of them turned (partial_rotary_factor)
    freqs = tensors["rope_freqs.weight"]
    assert freqs.shape == (heads["full_attention"] // 2,) and (freqs[:turned] == 1).all()
    assert (freqs[turned:] == gguf_hparams.PROPORTIONAL_STILL).all()
    assert fields["rope.freq_base_swa"] == 10000.0 and fields["rope.freq_base"] == 1e6
    assert fields["embedding_length_per_layer_input"] == config.hidden_size_per_layer_input
    assert "per_layer_token_embd.weight" in tensors and "blk.0.inp_gate.weight" in tensors
    assert tensors["blk.0.layer_output_scale.weight"].shape == (1,)
    # none in the config: 0.0 (off), where without the key llama.cpp caps the logits at its default 30
    assert config.final_logit_softcapping is None and fields["final_logit_softcapping"] == 0.0
    assert gguf_check.verify_gguf(model_dir / "f32.gguf", model_dir, gguf_type="f32").max_abs_diff == 0.0


def test_shared_kv_layers_and_double_wide_mlps(written):
    model_dir, fields, tensors = written["shared"]
    assert fields["attention.shared_kv_layers"] == 3
    assert fields["feed_forward_length"] == [96] * 3 + [192] * 3
    assert "blk.2.attn_k.weight" in tensors and "blk.3.attn_k.weight" not in tensors  # shared: no K/V of their own
    assert gguf_check.verify_gguf(model_dir / "f32.gguf", model_dir, gguf_type="f32").max_abs_diff == 0.0


def test_moe_block_router_scales_and_values_from_keys(written):
    from safetensors import safe_open

    model_dir, fields, tensors = written["moe"]
    assert (fields["expert_count"], fields["expert_used_count"], fields["expert_feed_forward_length"]) == (4, 2, 32)
    assert fields["attention.head_count_kv"] == [2, 2, 2, 1]  # num_global_key_value_heads on the full layer
    assert "blk.3.attn_v.weight" not in tensors and "blk.0.attn_v.weight" in tensors  # attention_k_eq_v
    with safe_open(str(model_dir / "model.safetensors"), framework="pt") as f:
        np.testing.assert_array_equal(tensors["blk.1.ffn_down_exps.scale"],
                                      f.get_tensor("model.layers.1.router.per_expert_scale").numpy())
        np.testing.assert_array_equal(tensors["blk.1.ffn_gate_up_exps.weight"],
                                      f.get_tensor("model.layers.1.experts.gate_up_proj").numpy())
    assert "blk.1.ffn_gate_inp.scale" in tensors and "blk.1.pre_ffw_norm_2.weight" in tensors
    assert gguf_check.verify_gguf(model_dir / "f32.gguf", model_dir, gguf_type="f32").max_abs_diff == 0.0


def test_what_llama_cpp_runs_otherwise_is_refused(written, tmp_path):
    base = written["base"][0]
    rope = json.loads((base / "config.json").read_text())["rope_parameters"]
    for name, config, refusal in [
        ("act", {"hidden_activation": "gelu"}, "hidden_activation = gelu but llama.cpp runs"),
        ("bidi", {"use_bidirectional_attention": "all"}, "use_bidirectional_attention = all but llama.cpp runs"),
        ("scaled", {"rope_parameters": {**rope, "full_attention": {**rope["full_attention"], "factor": 8.0}}},
         "a scaled proportional rope"),
        ("sharing", {"num_kv_shared_layers": 1}, "num_kv_shared_layers = 1 but llama.cpp runs"),
        ("heads", {"per_layer_config": {"3": {"head_dim": 512}, "1": {"head_dim": 32}}}, "head_dim differs between layers"),
    ]:
        with pytest.raises(gguf_arch.GgufUnsupported, match=refusal):
            gguf_arch.check_architecture(with_config(tmp_path / name, base, **config))


def test_gemma4s_own_tokenizer_is_refused_in_one_line(written, tmp_path):
    """A SentencePiece-style BPE (byte fallback) is llama.cpp's `gemma4` tokenizer model, not written yet."""
    model_dir = with_config(tmp_path / "spm", written["base"][0])
    spec = json.loads((model_dir / "tokenizer.json").read_text())
    spec["model"]["byte_fallback"] = True
    (model_dir / "tokenizer.json").write_text(json.dumps(spec))
    with pytest.raises(gguf_arch.GgufUnsupported, match="'llama'-kind tokenizer cannot be written .* `gemma4` tokenizer"):
        gguf_export.check_writable(model_dir)


def test_lora_on_the_per_layer_model_projection_is_refused_for_the_adapter_gguf(written, tmp_path):
    """llama.cpp multiplies per_layer_model_proj with plain ggml_mul_mat (models/gemma4.cpp
    project_per_layer_inputs), so a LoRA GGUF's pair for it would load and never apply (0.5 of the
    largest logit off the merged model in llama.cpp b11739): refused in one line; the layer beside it
    (the per-layer input gate) is written."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from homelab_ft.errors import UserError
    from homelab_ft.export.gguf.adapter import write_adapter_gguf

    base = written["base"][0]
    for name, targets in (("ignored", ["per_layer_model_projection"]), ("applied", ["per_layer_input_gate"])):
        peft = get_peft_model(AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32),
                              LoraConfig(r=2, lora_alpha=4, target_modules=targets, init_lora_weights=False))
        peft.save_pretrained(tmp_path / name)
        if name == "ignored":
            with pytest.raises(UserError, match="multiplies per_layer_model_proj.weight without its adapters"):
                write_adapter_gguf(tmp_path / name, base, tmp_path / f"{name}.gguf", name="tiny")
        else:
            write_adapter_gguf(tmp_path / name, base, tmp_path / f"{name}.gguf", name="tiny")
