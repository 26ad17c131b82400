"""GGUF for the families llama.cpp runs beyond the original seven: how each is found, laid out and
refused (tests/families.py's tiny models). Every family written and run against the merged model
(f32 identical, q8_0 within its bound, the default export's quality line) is tests/e2e/test_gguf_families.py."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from families import AS_RELEASED, save_tiny, with_config

from homelab_ft.errors import UserError
from homelab_ft.export.gguf import arch as gguf_arch
from homelab_ft.export.gguf import check as gguf_check
from homelab_ft.export.gguf import export as gguf_export
from homelab_ft.export.gguf import hparams as gguf_hparams


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    cache = {}

    def get(model_type: str) -> Path:
        if model_type not in cache:
            cache[model_type] = save_tiny(tmp_path_factory.mktemp(model_type), model_type,
                                          **AS_RELEASED.get(model_type, {}))
        return cache[model_type]

    return get


def test_the_architecture_comes_from_transformers_and_gguf_py():
    """Spelt as gguf-py spells it, or the parent in transformers' modular source."""
    assert gguf_arch.arch_candidates("olmo3")[0] == "olmo2"
    assert gguf_arch.arch_candidates("mixtral")[0] == "llama"
    assert gguf_arch.arch_candidates("gemma3_text")[0] == "gemma3"
    assert gguf_arch.arch_candidates("qwen3_moe")[0] == "qwen3moe"
    assert gguf_arch.arch_candidates("qwen3_5_text")[0] == "qwen35"
    assert gguf_arch.arch_candidates("gpt_oss")[0] == "gpt-oss"
    assert gguf_arch.arch_candidates("deepseek_v3") == ["deepseek2"]
    assert gguf_arch.arch_candidates("no_such_model") == []


def test_experts_are_stacked_as_llama_cpp_holds_them(tiny, tmp_path):
    """transformers saves one tensor per expert; llama.cpp holds a block's experts as one 3-D tensor."""
    from gguf import GGUFReader
    from safetensors import safe_open

    model_dir = tiny("qwen3_moe")
    path = tmp_path / "moe.gguf"
    gguf_export.write_gguf(model_dir, path, gguf_type="f32", name="tiny")
    reader = GGUFReader(path)
    tensors = {t.name: t for t in reader.tensors}
    down = tensors["blk.1.ffn_down_exps.weight"]
    assert [int(d) for d in down.shape] == [32, 64, 4]  # gguf lists dims innermost first: 4 experts of 64 x 32
    with safe_open(str(model_dir / "model.safetensors"), framework="pt") as f:
        expert = f.get_tensor("model.layers.1.mlp.experts.2.down_proj.weight").float().numpy()
    np.testing.assert_array_equal(np.asarray(down.data).reshape(4, 64, 32)[2], expert)
    assert reader.fields["qwen3moe.expert_count"].contents() == 4
    assert reader.fields["qwen3moe.expert_used_count"].contents() == 2


def test_gemma_norms_are_found_by_running_them(tiny, tmp_path):
    """Gemma's RMSNorm computes x * (1 + w): found by probing the module, written as 1 + w."""
    from gguf import GGUFReader
    from safetensors import safe_open

    target = gguf_arch.check_architecture(tiny("gemma"))
    assert "blk.0.attn_norm.weight" in target.offset_norms and "output_norm.weight" in target.offset_norms
    assert not gguf_arch.check_architecture(tiny("olmo2")).offset_norms  # x * w, as llama.cpp
    path = tmp_path / "gemma.gguf"
    gguf_export.write_gguf(tiny("gemma"), path, gguf_type="f32", name="tiny")
    stored = next(t for t in GGUFReader(path).tensors if t.name == "blk.0.attn_norm.weight")
    with safe_open(str(tiny("gemma") / "model.safetensors"), framework="pt") as f:
        weight = f.get_tensor("model.layers.0.input_layernorm.weight").float().numpy()
    np.testing.assert_array_equal(np.asarray(stored.data), weight + np.float32(1.0))


def test_granite_multipliers_become_llama_cpp_scales(tiny, tmp_path):
    from gguf import GGUFReader
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(tiny("granite"))
    path = tmp_path / "granite.gguf"
    gguf_export.write_gguf(tiny("granite"), path, gguf_type="f32", name="tiny")
    fields = GGUFReader(path).fields
    for key, attribute in [("granite.attention.scale", "attention_multiplier"), ("granite.embedding_scale",
                           "embedding_multiplier"), ("granite.residual_scale", "residual_multiplier"),
                           ("granite.logit_scale", "logits_scaling")]:
        assert fields[key].contents() == pytest.approx(getattr(config, attribute)), key


def test_olmo3_sliding_pattern_and_smollm3_rope_layers(tiny, tmp_path):
    from gguf import GGUFReader

    path = tmp_path / "olmo3.gguf"
    gguf_export.write_gguf(tiny("olmo3"), path, gguf_type="f32", name="tiny")
    fields = GGUFReader(path).fields
    assert fields["olmo2.attention.sliding_window"].contents() == 8
    assert fields["olmo2.attention.sliding_window_pattern"].contents() == [True, True, True, False]
    odd = save_tiny(tmp_path / "odd", "smollm3", no_rope_layers=[1, 0, 1, 0])
    with pytest.raises(UserError, match=r"no_rope_layers = \[1, 0, 1, 0\] but llama.cpp runs .* with \[1, 1, 1, 0\]"):
        gguf_export.check_writable(odd)


def test_a_setting_llama_cpp_fixes_otherwise_is_refused(tmp_path):
    """transformers' default Qwen3-MoE config leaves the top-k weights unnormalised, which
    llama.cpp's qwen3moe graph always normalises: it would run another model."""
    model_dir = save_tiny(tmp_path / "qwen3_moe", "qwen3_moe")
    with pytest.raises(gguf_arch.GgufUnsupported, match="norm_topk_prob = .* but llama.cpp runs this architecture with"):
        gguf_export.check_writable(model_dir)


def test_gemma3_sliding_pattern_is_written_and_a_new_one_names_the_build_it_needs(tiny, tmp_path):
    """Gemma 3's pattern goes into `gemma3.attention.sliding_window_pattern` (llama.cpp b11739 reads
    it; older builds fix every 6th layer full). The shrunk default config's 3:1 pattern was refused;
    now it is written, checked in its own config, and RUNNING.md's sentence names both patterns.
    The released 5:1 pattern is written too and needs no newer build."""
    from gguf import GGUFReader

    odd = save_tiny(tmp_path / "odd", "gemma3_text", query_pre_attn_scalar=16)
    layer_types = json.loads((odd / "config.json").read_text())["layer_types"]
    assert layer_types.count("full_attention") >= 1 and layer_types != AS_RELEASED["gemma3_text"]["layer_types"]
    for model_dir in (odd, tiny("gemma3_text")):
        path = tmp_path / f"{model_dir.name}.gguf"
        gguf_export.write_gguf(model_dir, path, gguf_type="f32", name="tiny")
        kinds = json.loads((model_dir / "config.json").read_text())["layer_types"]
        written = GGUFReader(path).fields["gemma3.attention.sliding_window_pattern"].contents()
        assert written == [kind == "sliding_attention" for kind in kinds]
        assert gguf_check.verify_gguf(path, model_dir, gguf_type="f32").max_abs_diff == 0.0
    assert gguf_arch.runtime_needs(tiny("gemma3_text")) == []
    [need] = gguf_arch.runtime_needs(odd)
    full = [i for i, kind in enumerate(layer_types) if kind == "full_attention"]
    assert f"full context on layers {full}, where" in need and "b11739 or newer" in need
    builtin = "no layer" if len(layer_types) < 6 else "layers [5"
    assert f"set_swa_pattern(6)) use {builtin}" in need, need


def test_a_family_llama_cpp_names_but_homelab_ft_has_not_read_is_refused(tiny):
    with pytest.raises(gguf_arch.GgufUnsupported, match="'olmoe' cannot be written as GGUF.*runs it as 'olmoe' but "
                                                          "homelab-ft has not read that conversion"):
        gguf_export.check_writable(tiny("olmoe"))


def test_phimoe_is_refused_for_the_graph_llama_cpp_runs_it_on(tiny):
    """llama.cpp runs PhiMoE on Phi-3's graph: RMSNorm plus bias for PhiMoE's LayerNorm, softmax
    top-k for its sparsemixer router. Our own check would pass (it runs transformers' graph), so
    the refusal is the only thing that keeps such a file from being written."""
    with pytest.raises(gguf_arch.GgufUnsupported, match="'phimoe' cannot be written.*RMSNorm plus a bias.*LayerNorm"):
        gguf_export.check_writable(tiny("phimoe"))


def _written(model_dir: Path, path: Path):
    """(path, reader, the `<arch>.*` keys without the prefix) of `model_dir` written as f32."""
    from gguf import GGUFReader

    gguf_export.write_gguf(model_dir, path, gguf_type="f32", name="tiny")
    reader = GGUFReader(path)
    arch = reader.fields["general.architecture"].contents()
    return path, reader, {name.removeprefix(f"{arch}."): field.contents() for name, field in reader.fields.items()
                          if name.startswith(f"{arch}.")}


def test_glm4_moe_router_keys_are_read_back(tmp_path):
    """GLM-4.5's DeepSeek-style router as Glm4MoeModel writes it and models/glm4-moe.cpp reads it:
    leading dense blocks, shared experts, sigmoid gating, routed scaling, the selection bias as
    `exp_probs_b.bias`, half the head rotated; q/k norms (GLM-4.5 355B) in their place."""
    import gguf
    import torch
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file
    from transformers import AutoConfig

    model_dir = save_tiny(tmp_path / "glm", "glm4_moe", first_k_dense_replace=2, n_shared_experts=2,
                          routed_scaling_factor=2.5, norm_topk_prob=False, use_qk_norm=True)
    state = load_file(str(model_dir / "model.safetensors"))  # a trained selection bias: transformers inits zeros
    for name in [n for n in state if n.endswith("e_score_correction_bias")]:
        state[name] = torch.randn(state[name].shape, generator=torch.Generator().manual_seed(0))
    save_file(state, str(model_dir / "model.safetensors"), metadata={"format": "pt"})
    config = AutoConfig.from_pretrained(model_dir)
    path, reader, fields = _written(model_dir, tmp_path / "glm.gguf")
    assert fields["leading_dense_block_count"] == config.first_k_dense_replace == 2
    assert fields["expert_shared_count"] == config.n_shared_experts == 2
    assert fields["expert_count"] == config.n_routed_experts and fields["expert_used_count"] == config.num_experts_per_tok
    assert fields["expert_feed_forward_length"] == config.moe_intermediate_size
    assert fields["expert_gating_func"] == gguf.ExpertGatingFuncType.SIGMOID
    assert fields["expert_weights_scale"] == pytest.approx(config.routed_scaling_factor)
    assert fields["expert_weights_norm"] is False
    assert fields["rope.dimension_count"] == gguf_hparams.head_dim(config) // 2  # partial_rotary_factor 0.5
    assert "nextn_predict_layers" not in fields  # none written: llama.cpp would skip that many real blocks
    tensors = {t.name: t for t in reader.tensors}
    assert "blk.1.ffn_gate.weight" in tensors and "blk.1.ffn_gate_inp.weight" not in tensors  # dense
    assert "blk.2.ffn_gate_exps.weight" in tensors and "blk.0.attn_q_norm.weight" in tensors
    with safe_open(str(model_dir / "model.safetensors"), framework="pt") as f:
        bias = f.get_tensor("model.layers.2.mlp.gate.e_score_correction_bias").float().numpy()
    np.testing.assert_array_equal(np.asarray(tensors["blk.2.exp_probs_b.bias"].data), bias)
    assert gguf_check.verify_gguf(path, model_dir, gguf_type="f32").max_abs_diff == 0.0


def test_glm4_moe_nextn_layers_are_left_out_and_expert_groups_written(tiny, tmp_path):
    """A released GLM-4.5 holds its MTP layer as model.layers.<num_hidden_layers>: left out, as
    the converter's --no-mtp. Expert groups are written as TextModel writes them, which llama.cpp's
    build_moe_ffn applies; picking every group is no grouping, and is left out (llama.cpp's loader
    asserts topk_group < n_group)."""
    import shutil

    import torch
    from gguf import GGUFReader
    from safetensors.torch import load_file, save_file
    from transformers import AutoConfig

    model_dir = tmp_path / "glm"
    shutil.copytree(tiny("glm4_moe"), model_dir)
    layers = AutoConfig.from_pretrained(model_dir).num_hidden_layers
    state = load_file(str(model_dir / "model.safetensors"))
    state[f"model.layers.{layers}.eh_proj.weight"] = torch.zeros(64, 128)
    save_file(state, str(model_dir / "model.safetensors"), metadata={"format": "pt"})
    target = gguf_arch.check_architecture(model_dir)
    config = AutoConfig.from_pretrained(model_dir)
    names = {item.gguf_name for item in gguf_export.plan_tensors(model_dir, config, target=target, gguf_type="f32")}
    assert not any(name.startswith(f"blk.{layers}.") for name in names) and f"blk.{layers - 1}.attn_q.weight" in names
    for groups, used, written in [(2, 1, (2, 1)), (2, 2, (None, None)), (1, 1, (1, 1))]:
        model_dir = save_tiny(tmp_path / f"groups{groups}{used}", "glm4_moe", n_group=groups, topk_group=used)
        path = model_dir / "model.gguf"
        gguf_export.write_gguf(model_dir, path, gguf_type="f32", name="tiny")
        fields = GGUFReader(path).fields
        got = tuple(fields[key].contents() if key in fields else None
                    for key in ("glm4moe.expert_group_count", "glm4moe.expert_group_used_count"))
        assert got == written, (groups, used)
        assert gguf_check.verify_gguf(path, model_dir, gguf_type="f32").max_abs_diff == 0.0


def test_deepseek_v3_mla_is_split_as_llama_cpp_absorbs_it(tmp_path):
    """DeepseekV2Model's MLA: one KV head of kv_lora_rank + the rotated width, the decompressed head
    sizes as the `_mla` lengths, kv_b_proj split into attn_k_b (each head's nope rows transposed,
    which llama.cpp multiplies q_nope by) and attn_v_b; the router as GLM's, with expert groups."""
    import gguf
    from safetensors import safe_open
    from transformers import AutoConfig

    model_dir = save_tiny(tmp_path / "ds", "deepseek_v3", v_head_dim=24, n_group=2, topk_group=1, first_k_dense_replace=2)
    config = AutoConfig.from_pretrained(model_dir)
    path, reader, fields = _written(model_dir, tmp_path / "ds.gguf")
    rank, rope, nope, v = config.kv_lora_rank, config.qk_rope_head_dim, config.qk_nope_head_dim, config.v_head_dim
    assert fields["attention.head_count_kv"] == 1 and fields["attention.kv_lora_rank"] == rank
    assert fields["attention.q_lora_rank"] == config.q_lora_rank
    assert (fields["attention.key_length"], fields["attention.value_length"]) == (rank + rope, rank)
    assert (fields["attention.key_length_mla"], fields["attention.value_length_mla"]) == (nope + rope, v)
    assert fields["rope.dimension_count"] == rope
    assert fields["expert_gating_func"] == gguf.ExpertGatingFuncType.SIGMOID
    assert (fields["expert_group_count"], fields["expert_group_used_count"]) == (2, 1)
    assert fields["leading_dense_block_count"] == 2 and fields["expert_shared_count"] == config.n_shared_experts
    assert fields["expert_weights_scale"] == pytest.approx(config.routed_scaling_factor)
    tensors = {t.name: t for t in reader.tensors}
    heads = config.num_attention_heads
    assert [int(d) for d in tensors["blk.2.attn_k_b.weight"].shape] == [nope, rank, heads]  # as deepseek2.cpp creates
    assert [int(d) for d in tensors["blk.2.attn_v_b.weight"].shape] == [rank, v, heads]
    assert "blk.2.attn_kv_b.weight" not in tensors
    with safe_open(str(model_dir / "model.safetensors"), framework="pt") as f:
        kv_b = f.get_tensor("model.layers.2.self_attn.kv_b_proj.weight").float().numpy().reshape(heads, nope + v, rank)
    k_b = np.asarray(tensors["blk.2.attn_k_b.weight"].data).reshape(heads, rank, nope)
    v_b = np.asarray(tensors["blk.2.attn_v_b.weight"].data).reshape(heads, v, rank)
    rng = np.random.default_rng(0)
    q_nope, latent = rng.standard_normal((heads, nope)), rng.standard_normal(rank)
    for h in range(heads):  # llama.cpp's absorbed scores and values are the model's
        np.testing.assert_allclose((k_b[h] @ q_nope[h]) @ latent, q_nope[h] @ (kv_b[h, :nope] @ latent), rtol=1e-5)
        np.testing.assert_allclose(v_b[h] @ latent, kv_b[h, nope:] @ latent, rtol=1e-5)
    assert gguf_check.verify_gguf(path, model_dir, gguf_type="f32").max_abs_diff == 0.0


def test_deepseek2_refuses_what_llama_cpp_runs_otherwise(tiny, tmp_path):
    """deepseek2.cpp ropes interleaved pairs, has no attention biases and reads no q_lora_rank for
    a 26/27-layer model; DeepSeek-V3's YaRN is not written; of the several model types llama.cpp
    runs as deepseek2, DeepSeek-V3's conversion is the one read."""
    base = tiny("deepseek_v3")
    for name, config, refusal in [
        ("pairs", {"rope_interleave": False}, "rope_interleave = False but llama.cpp runs this architecture with True"),
        ("bias", {"attention_bias": True}, "attention_bias = True but llama.cpp runs this architecture with False"),
        ("lite", {"num_hidden_layers": 27}, "q_lora_rank = 32 but llama.cpp runs this architecture with None"),
        ("yarn", {"rope_parameters": {"rope_type": "yarn", "factor": 40.0, "original_max_position_embeddings": 128,
                                      "rope_theta": 10000.0, "mscale": 1.0, "mscale_all_dim": 1.0}},
         "rope type 'yarn' cannot be written as GGUF by homelab-ft for 'deepseek2': llama.cpp scales .* PR 17945"),
        ("v2", {"model_type": "deepseek_v2"}, "homelab-ft has read for deepseek_v3 only"),
    ]:
        with pytest.raises(gguf_arch.GgufUnsupported, match=refusal):
            gguf_arch.check_architecture(with_config(tmp_path / name, base, **config))
    gguf_arch.check_architecture(with_config(tmp_path / "moonlight", base, num_hidden_layers=27, q_lora_rank=None))


def test_a_multimodal_checkpoint_is_refused_in_one_line(tmp_path):
    """Gemma 3 4B and up ship as Gemma3ForConditionalGeneration (`gemma3`, a text_config and a
    vision tower): refused from its config alone, before any weight is read."""
    from transformers import Gemma3Config

    Gemma3Config().save_pretrained(tmp_path)
    with pytest.raises(gguf_arch.GgufUnsupported, match="multimodal checkpoint .'gemma3' with a text_config"):
        gguf_arch.check_architecture(tmp_path)


def test_a_window_llama_cpp_does_not_apply_is_said(tmp_path, caplog):
    """Mistral as llama.cpp's `llama`, which has no sliding window (as its converter does it)."""
    import logging

    from gguf import GGUFReader

    path = tmp_path / "mistral.gguf"
    with caplog.at_level(logging.WARNING):
        gguf_export.write_gguf(save_tiny(tmp_path / "windowed", "mistral"), path, gguf_type="f32", name="tiny")
    assert "no sliding window: past 8 tokens" in caplog.text
    assert "llama.attention.sliding_window" not in GGUFReader(path).fields
