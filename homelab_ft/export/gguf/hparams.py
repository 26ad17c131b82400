"""The hyperparameter keys of a GGUF file, from the model's config, as llama.cpp reads them.

The keys are those convert_hf_to_gguf.py's TextModel.set_gguf_parameters writes for every text
model (context, widths, heads, norm epsilon, rope, expert counts), plus what its per-family
classes add: Gemma 2's soft-capping, the sliding windows of Gemma 2/3, Phi-3 and Olmo 3 (the
per-layer pattern from `layer_types`), Gemma 3's local rope base, Granite's multipliers, GLM-4.5's
router (shared experts, leading dense blocks, scaling, sigmoid gating, expert groups), DeepSeek-V3's
multi-head latent attention, and the keys an image-text model's language model adds to its twin's
(`gguf_keys` of text_view.py: M-RoPE sections, deepstack layers). Which keys apply is decided
by what the config has, not by its name, except the few a family's converter writes by hand.
"""

from __future__ import annotations

import logging
import math

import numpy as np

from homelab_ft.export.gguf.arch import Target, rope_parameters

log = logging.getLogger(__name__)

FILE_TYPES = {"f32": "ALL_F32", "f16": "MOSTLY_F16", "bf16": "MOSTLY_BF16", "q8_0": "MOSTLY_Q8_0",
              "q4_0": "MOSTLY_Q4_0", "q5_1": "MOSTLY_Q5_1"}
"""gguf type -> gguf.LlamaFileType member, `general.file_type`."""


def head_dim(config) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def write_hparams(writer, config, *, target: Target, gguf_type: str) -> None:
    import gguf

    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(1 if target.layout.mla else config.num_key_value_heads)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_vocab_size(config.vocab_size)
    dim = head_dim(config)
    if target.layout.mla:
        _write_mla(writer, config)
        dim = config.qk_rope_head_dim  # the rotated width
    elif dim != config.hidden_size // config.num_attention_heads or target.arch_name.startswith("gemma"):
        writer.add_key_length(dim)
        writer.add_value_length(dim)
    _write_rope(writer, config, dim=dim)
    _write_attention_extras(writer, config, target=target)
    _write_experts(writer, config, target=target)
    _write_multipliers(writer, config)
    for method, value in (getattr(config, "gguf_keys", None) or {}).items():
        getattr(writer, method)(value)
    writer.add_file_type(getattr(gguf.LlamaFileType, FILE_TYPES[gguf_type]))
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)


def _write_mla(writer, config) -> None:
    """Multi-head latent attention as DeepseekV2Model writes it: one KV head of kv_lora_rank +
    the rotated width (llama.cpp's absorbed attention), the decompressed head sizes as the `_mla`
    lengths, and the two ranks (no q_lora_rank where the model projects q directly)."""
    writer.add_kv_lora_rank(config.kv_lora_rank)
    if getattr(config, "q_lora_rank", None) is not None:
        writer.add_q_lora_rank(config.q_lora_rank)
    writer.add_key_length(config.kv_lora_rank + config.qk_rope_head_dim)
    writer.add_value_length(config.kv_lora_rank)
    writer.add_key_length_mla(config.qk_nope_head_dim + config.qk_rope_head_dim)
    writer.add_value_length_mla(config.v_head_dim)


def _write_rope(writer, config, *, dim: int) -> None:
    import gguf

    rope = rope_parameters(config)
    writer.add_rope_freq_base(float(rope["rope_theta"]))
    partial = rope.get("partial_rotary_factor") or getattr(config, "partial_rotary_factor", None) or 1.0
    writer.add_rope_dimension_count(int(dim * partial))  # transformers 5 keeps GLM's in rope_parameters
    if rope.get("rope_type") == "linear":
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(rope["factor"])
    elif rope.get("rope_type") == "yarn":
        writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        writer.add_rope_scaling_factor(rope["factor"])
        writer.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
        if rope.get("attention_factor") is not None:  # Olmo2Model writes it
            writer.add_rope_scaling_attn_factors(rope["attention_factor"])
    swa = rope.get("swa") or {}
    if swa.get("rope_theta") is not None and swa["rope_theta"] != rope["rope_theta"]:
        writer.add_rope_freq_base_swa(float(swa["rope_theta"]))  # Gemma 3's local layers


def _write_attention_extras(writer, config, *, target: Target) -> None:
    """Soft-capping (Gemma 2) and sliding windows: the window wherever the config sets one, with
    the per-layer pattern from `layer_types` where llama.cpp reads it (`Layout.swa_pattern`: Olmo 2,
    Gemma 3; the others run every layer windowed, none, or Gemma 2's fixed alternation)."""
    if getattr(config, "attn_logit_softcapping", None) is not None or target.arch_name == "gemma2":
        writer.add_attn_logit_softcapping(getattr(config, "attn_logit_softcapping", None) or 0.0)
    if getattr(config, "final_logit_softcapping", None) is not None or target.arch_name == "gemma2":
        writer.add_final_logit_softcapping(getattr(config, "final_logit_softcapping", None) or 0.0)
    window = getattr(config, "sliding_window", None)
    if not window:
        return
    if not target.layout.sliding_window:
        log.warning("llama.cpp runs %s as %r, with no sliding window: past %d tokens it attends to the whole "
                    "context where the model attended to the last %d", target.model_type, target.arch_name, window, window)
        return
    writer.add_sliding_window(window)
    layer_types = getattr(config, "layer_types", None)
    if layer_types and target.layout.swa_pattern is not None:
        writer.add_sliding_window_pattern([kind == "sliding_attention" for kind in layer_types])


def _write_experts(writer, config, *, target: Target) -> None:
    """Expert counts and sizes; for DeepSeek-style routers (GLM-4.5: Glm4MoeModel) also the shared
    experts, the leading dense blocks, the routed scaling and the gating function."""
    import gguf

    num_experts = (getattr(config, "num_experts", None) or getattr(config, "num_local_experts", None)
                   or getattr(config, "n_routed_experts", None))
    if not num_experts:
        return
    writer.add_expert_count(num_experts)
    writer.add_expert_used_count(config.num_experts_per_tok)
    if getattr(config, "moe_intermediate_size", None):
        writer.add_expert_feed_forward_length(config.moe_intermediate_size)
    if getattr(config, "shared_expert_intermediate_size", None):
        writer.add_expert_shared_feed_forward_length(config.shared_expert_intermediate_size)
    if getattr(config, "n_shared_experts", None) is not None:
        writer.add_expert_shared_count(config.n_shared_experts)
    if getattr(config, "first_k_dense_replace", None) is not None:
        writer.add_leading_dense_block_count(config.first_k_dense_replace)
    _write_expert_groups(writer, config)
    if getattr(config, "routed_scaling_factor", None) is not None:
        writer.add_expert_weights_scale(float(config.routed_scaling_factor))
    if getattr(config, "norm_topk_prob", None) is not None:
        writer.add_expert_weights_norm(bool(config.norm_topk_prob))
    if target.layout.expert_gating:
        writer.add_expert_gating_func(getattr(gguf.ExpertGatingFuncType, target.layout.expert_gating))


def _write_expert_groups(writer, config) -> None:
    """DeepSeek-style group-limited routing, `n_group` / `topk_group`, which TextModel writes for
    every model that has them and llama.cpp's build_moe_ffn applies when there is more than one
    group. Left out when every group is picked (no grouping: llama.cpp's loader asserts fewer)."""
    groups, used = getattr(config, "n_group", None), getattr(config, "topk_group", None)
    if groups is None or (groups > 1 and used is not None and used >= groups):
        return
    writer.add_expert_group_count(groups)
    if used is not None:
        writer.add_expert_group_used_count(used)


MULTIPLIERS = {
    "attention_multiplier": "add_attention_scale",
    "embedding_multiplier": "add_embedding_scale",
    "residual_multiplier": "add_residual_scale",
    "logits_scaling": "add_logit_scale",
}
"""Granite's scalar multipliers -> the GGUFWriter method of the key llama.cpp reads them from
(convert_hf_to_gguf.py's GraniteModel renames *_multiplier to *_scale, and writes each only when set)."""


def _write_multipliers(writer, config) -> None:
    for key, method in MULTIPLIERS.items():
        if getattr(config, key, None):
            getattr(writer, method)(float(getattr(config, key)))


def rope_freqs(config) -> np.ndarray | None:
    """Llama 3.1+ frequency scaling as llama.cpp's `rope_freqs` tensor (per-pair divisors), the
    same formula as transformers' `_compute_llama3_parameters`."""
    rope = rope_parameters(config)
    if rope.get("rope_type") != "llama3":
        return None
    dim = head_dim(config)
    freqs = 1.0 / (rope["rope_theta"] ** (np.arange(0, dim, 2, dtype=np.float32) / dim))
    factor, low, high = rope["factor"], rope.get("low_freq_factor", 1.0), rope.get("high_freq_factor", 4.0)
    old = rope.get("original_max_position_embeddings", 8192)
    out = []
    for freq in freqs:
        wavelen = 2 * math.pi / freq
        if wavelen < old / high:
            out.append(1.0)
        elif wavelen > old / low:
            out.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            out.append(1.0 / ((1 - smooth) / factor + smooth))
    return np.array(out, dtype=np.float32)
