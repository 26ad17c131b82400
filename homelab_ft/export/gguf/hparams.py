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
              "q4_0": "MOSTLY_Q4_0", "q5_1": "MOSTLY_Q5_1", "mxfp4_moe": "MOSTLY_MXFP4_MOE"}
"""gguf type -> gguf.LlamaFileType member, `general.file_type`."""


def head_dim(config) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def per_layer(config, key: str) -> list:
    """`key` of every layer. transformers 5.25 keeps a size that differs by layer in the config's
    per_layer_config (Gemma 4: the full-attention layers' head_dim, and their KV heads where
    num_global_key_value_heads is set), where reading it off the config raises; a homogeneous
    config gives its one value for every layer."""
    if getattr(config, "is_heterogeneous", False):
        return [getattr(layer, key) for layer in config.per_layer_config]
    return [getattr(config, key, None)] * config.num_hidden_layers


def kv_heads(config, *, target: Target) -> int | list[int]:
    """`attention.head_count_kv`: one value, or one per layer where they differ (as
    Gemma4Model writes num_global_key_value_heads); MLA is one KV head (DeepseekV2Model)."""
    if target.layout.mla:
        return 1
    heads = per_layer(config, "num_key_value_heads")
    if target.layout.recurrent_kv_heads:  # 0 marks a Mamba layer (GraniteHybridModel), or a block without attention
        heads = [0 if kind in RECURRENT or kind in FFN_BLOCKS else count
                 for kind, count in zip(config.layer_types, heads, strict=True)]
    return heads[0] if len(set(heads)) == 1 else heads


RECURRENT = ("linear_attention", "mamba")
"""layer_types of a recurrent mixer (transformers 5.25 spells Granite 4 hybrid's Mamba layers linear_attention)."""

FFN_BLOCKS = {"mlp": "intermediate_size", "moe": "moe_intermediate_size"}
"""layer_types of a block that is a feed-forward layer alone (Nemotron-H: one mixer per block), and
the config key of its width: `feed_forward_length` is that on those blocks and 0 on the others, as
NemotronHModel writes it and models/nemotron-h.cpp tells the blocks apart (n_ff 0 and no KV heads:
Mamba; n_ff 0: attention)."""


def norm_eps(config) -> float:
    """The RMSNorm epsilon (Nemotron-H calls it layer_norm_epsilon, as Mamba2Model reads it)."""
    return getattr(config, "rms_norm_eps", None) or config.layer_norm_epsilon


def ff_lengths(config) -> int | list[int] | None:
    """`feed_forward_length`: the MLP's width (Llama 4's dense MLP is intermediate_size_mlp, its
    experts' intermediate_size, as Llama4Model swaps them), per layer where Gemma 4's
    use_double_wide_mlp doubles it on the layers that reuse another layer's KV cache (as Gemma4Model
    writes it) or where Nemotron-H's blocks are MLP, MoE or neither (FFN_BLOCKS); None in a model of
    experts alone (Qwen 3.5 MoE)."""
    kinds = getattr(config, "layer_types", None) or []
    if any(kind in FFN_BLOCKS for kind in kinds):
        return [getattr(config, FFN_BLOCKS[kind]) if kind in FFN_BLOCKS else 0 for kind in kinds]
    size = getattr(config, "intermediate_size_mlp", None) or getattr(config, "intermediate_size", None)
    if getattr(config, "shared_intermediate_size", None) and not getattr(config, "num_local_experts", None):
        return config.shared_intermediate_size  # Granite 4 hybrid without experts: its shared MLP is the MLP
    if not size or not getattr(config, "use_double_wide_mlp", False):
        return size or None
    first_shared = config.num_hidden_layers - config.num_kv_shared_layers
    return [size * (2 if layer >= first_shared else 1) for layer in range(config.num_hidden_layers)]


def write_hparams(writer, config, *, target: Target, gguf_type: str) -> None:
    import gguf

    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_block_count(config.num_hidden_layers)
    if ff_lengths(config):
        writer.add_feed_forward_length(ff_lengths(config))
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(kv_heads(config, target=target))
    writer.add_layer_norm_rms_eps(norm_eps(config))
    if _first(config, "layer_norm_eps", "layer_norm_epsilon", "norm_epsilon") is not None:
        # TextModel writes it wherever the config names one; llama.cpp's nemotron_h requires it
        writer.add_layer_norm_eps(_first(config, "layer_norm_eps", "layer_norm_epsilon", "norm_epsilon"))
    writer.add_vocab_size(config.vocab_size)
    swa_dim = None
    if getattr(config, "is_heterogeneous", False):
        dim, swa_dim = _write_heads_by_layer_type(writer, config)
    elif target.layout.mla:
        _write_mla(writer, config)
        dim = config.qk_rope_head_dim  # the rotated width
    else:
        dim = head_dim(config)
        if getattr(config, "head_dim", None) or target.arch_name.startswith("gemma"):
            writer.add_key_length(dim)  # TextModel writes them wherever config.json names head_dim
            writer.add_value_length(dim)
    _write_rope(writer, config, dim=dim, swa_dim=swa_dim, target=target)
    _write_attention_extras(writer, config, target=target)
    _write_per_layer_inputs(writer, config)
    _write_experts(writer, config, target=target)
    _write_linear_attention(writer, config)
    _write_mamba2(writer, config)
    _write_multipliers(writer, config)
    if target.layout.rope_switch:
        writer.add_rope_scaling_finetuned(getattr(config, "position_embedding_type", None) == "rope")
    for method, value in (getattr(config, "gguf_keys", None) or {}).items():
        getattr(writer, method)(value)
    writer.add_file_type(getattr(gguf.LlamaFileType, FILE_TYPES[gguf_type]))
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)


def _write_heads_by_layer_type(writer, config) -> tuple[int, int]:
    """Gemma 4's head sizes, one per layer type (Gemma4Model): the full-attention layers' as
    `key_length` / `value_length`, the sliding ones' as the `_swa` lengths (gguf_arch refuses a
    type whose layers differ). Returns (full, sliding)."""
    sizes = dict(zip(config.layer_types, per_layer(config, "head_dim"), strict=True))
    full = sizes.get("full_attention") or sizes["sliding_attention"]
    swa = sizes.get("sliding_attention") or full
    writer.add_key_length(full)
    writer.add_value_length(full)
    writer.add_key_length_swa(swa)
    writer.add_value_length_swa(swa)
    return full, swa


def _write_per_layer_inputs(writer, config) -> None:
    """Gemma 4's per-layer embeddings width (0 without them, a key its loader requires) and the
    layers at the end that reuse an earlier layer's KV cache, as Gemma4Model writes them."""
    if hasattr(config, "hidden_size_per_layer_input"):
        writer.add_embedding_length_per_layer_input(config.hidden_size_per_layer_input or 0)
    if getattr(config, "num_kv_shared_layers", None) is not None:
        writer.add_shared_kv_layers(config.num_kv_shared_layers)


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


def _write_rope(writer, config, *, dim: int, swa_dim: int | None, target: Target) -> None:
    import gguf

    rope = rope_parameters(config)
    if "rope_theta" not in rope:
        return  # no rotary embedding (Nemotron-H's attention; llama.cpp's nemotron_h ropes nothing)
    writer.add_rope_freq_base(float(rope["rope_theta"]))
    partial = rope.get("partial_rotary_factor") or getattr(config, "partial_rotary_factor", None) or 1.0
    if rope.get("rope_type") == "proportional":  # every pair counted; rope_freqs holds the unrotated ones still
        partial = 1.0
    writer.add_rope_dimension_count(int(dim * partial))  # transformers 5 keeps GLM's in rope_parameters
    if swa_dim is not None:
        writer.add_rope_dimension_count_swa(int(swa_dim * ((rope.get("swa") or {}).get("partial_rotary_factor") or 1.0)))
    if rope.get("rope_type") == "linear":
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(rope["factor"])
    elif rope.get("rope_type") == "yarn":
        writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        writer.add_rope_scaling_factor(rope["factor"])
        writer.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
        if rope.get("attention_factor") is not None:  # Olmo2Model writes it
            writer.add_rope_scaling_attn_factors(rope["attention_factor"])
        for key, method in (("beta_fast", "add_rope_scaling_yarn_beta_fast"), ("beta_slow", "add_rope_scaling_yarn_beta_slow")):
            if rope.get(key) is not None:  # TextModel writes them where the config has them (gpt-oss: 32, 1)
                getattr(writer, method)(float(rope[key]))
    if target.layout.rope_sections:
        sections = list(rope.get("mrope_section") or target.layout.rope_sections)
        writer.add_rope_dimension_sections(_sections_within(sections + [0] * (4 - len(sections)), int(dim * partial)))
    swa = rope.get("swa") or {}
    if swa.get("rope_theta") is not None and swa["rope_theta"] != rope["rope_theta"]:
        writer.add_rope_freq_base_swa(float(swa["rope_theta"]))  # Gemma 3's local layers


def _sections_within(sections: list[int], rotated: int) -> list[int]:
    """M-RoPE sections that fit the rotated width: ggml's rope asserts sum(sections) <= rotated dims
    (ggml-cpu ops.cpp ggml_mrope_cache_init, GGML_ASSERT(sect_dims <= ne0)) and aborts the process
    otherwise, which only a shrunken model meets (a tiny Qwen 3.5 rotates 4 of its 16 head dims;
    Qwen3.5-27B 64 of 256, for the 32 pairs of [11, 11, 10, 0]). Such sections are cut to the pairs
    each one turns of those rotated (interleaved, pair i by section i % 3, as Qwen 3.5's imrope and
    transformers' recomposition take them): every pair keeps its section, where one cut from the end
    leaves a pair to llama.cpp's fourth section, which turns text by position 0 (measured: 1.1e-2 of
    the largest logit off)."""
    if sum(sections) <= rotated:
        return sections
    pairs = rotated // 2
    return [min(section, len(range(k, pairs, 3)) if k < 3 else 0) for k, section in enumerate(sections)]


def _write_attention_extras(writer, config, *, target: Target) -> None:
    """Soft-capping (Gemma 2; Gemma 4's 0.0 where it has none, `Layout.softcap_defaults`) and sliding windows: the window wherever the config sets one, with
    the per-layer pattern from `layer_types` where llama.cpp reads it (`Layout.swa_pattern`: Olmo 2,
    Gemma 3; the others run every layer windowed, none, or Gemma 2's fixed alternation)."""
    for key in ("attn_logit_softcapping", "final_logit_softcapping"):
        if getattr(config, key, None) is not None or key in target.layout.softcap_defaults:
            getattr(writer, f"add_{key}")(getattr(config, key, None) or 0.0)
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
    if not num_experts or gguf.MODEL_TENSOR.FFN_GATE_INP not in gguf.MODEL_TENSORS[target.arch]:
        return  # no experts, or an architecture without a router (a dense Nemotron-H's config still counts them)
    writer.add_expert_count(num_experts)
    writer.add_expert_used_count(getattr(config, "num_experts_per_tok", None) or config.top_k_experts)  # Gemma 4: top_k
    if getattr(config, target.layout.expert_ff_key, None):
        writer.add_expert_feed_forward_length(getattr(config, target.layout.expert_ff_key))
    shared = (getattr(config, "shared_expert_intermediate_size", None) or getattr(config, "shared_intermediate_size", None)
              or getattr(config, "moe_shared_expert_intermediate_size", None))
    if shared:  # Granite's is shared_intermediate_size (GraniteMoeModel), Nemotron-H's moe_shared_expert_...
        writer.add_expert_shared_feed_forward_length(shared)
    if getattr(config, "n_shared_experts", None) is not None:
        writer.add_expert_shared_count(config.n_shared_experts)
    if getattr(config, "first_k_dense_replace", None) is not None:
        writer.add_leading_dense_block_count(config.first_k_dense_replace)
    if getattr(config, "interleave_moe_layer_step", None):  # Llama 4: every step-th layer MoE
        writer.add_interleave_moe_layer_step(config.interleave_moe_layer_step)
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


def _write_linear_attention(writer, config) -> None:
    """The gated delta net's sizes as Qwen3NextModel writes them (Qwen 3.5, Qwen3-Next): the conv
    kernel, key head size as the state size, key heads as groups, value heads as the time-step
    rank, and the layer pattern as full_attention_interval (gguf_arch's `fixed` refuses another)."""
    if not getattr(config, "linear_conv_kernel_dim", None):
        return
    writer.add_ssm_conv_kernel(config.linear_conv_kernel_dim)
    writer.add_ssm_state_size(config.linear_key_head_dim)
    writer.add_ssm_group_count(config.linear_num_key_heads)
    writer.add_ssm_time_step_rank(config.linear_num_value_heads)
    writer.add_ssm_inner_size(config.linear_value_head_dim * config.linear_num_value_heads)
    writer.add_full_attention_interval(getattr(config, "full_attention_interval", None) or 4)


def _write_mamba2(writer, config) -> None:
    """A hybrid's Mamba 2 mixers as GraniteHybridModel, FalconH1Model and NemotronHModel write them:
    conv kernel, state size, groups, inner width (Falcon-H1's mamba_d_ssm, else heads x head size)
    and the heads as the time-step rank; Nemotron-H names them as transformers' Mamba 2 does."""
    state = _first(config, "mamba_d_state", "ssm_state_size")
    if not state or getattr(config, "linear_conv_kernel_dim", None):
        return  # no Mamba mixer (the gated delta net's are written by _write_linear_attention)
    heads = _first(config, "mamba_n_heads", "mamba_num_heads")
    writer.add_ssm_conv_kernel(_first(config, "mamba_d_conv", "conv_kernel"))
    writer.add_ssm_state_size(state)
    writer.add_ssm_group_count(_first(config, "mamba_n_groups", "n_groups"))
    writer.add_ssm_inner_size(getattr(config, "mamba_d_ssm", None) or heads * _first(config, "mamba_d_head", "mamba_head_dim"))
    writer.add_ssm_time_step_rank(heads)


def _first(config, *keys: str):
    """The first of `keys` the config sets (one size spelt per family)."""
    return next((getattr(config, key) for key in keys if getattr(config, key, None) is not None), None)


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


PROPORTIONAL_STILL = 1e30
"""The divisor Gemma4Model's rope_freqs gives the pairs proportional rope leaves unrotated: their
angle pos * theta / 1e30 is 0 to float precision at any position llama.cpp runs."""


def rope_freqs(config) -> np.ndarray | None:
    """llama.cpp's `rope_freqs` tensor (per-pair divisors of the angle): Llama 3.1+ frequency
    scaling, the same formula as transformers' `_compute_llama3_parameters`; Gemma 4's proportional
    rope on its full-attention layers, which turns the first int(partial * head_dim // 2) of the
    head's pairs (i, i + head_dim / 2) at base^(-2i / head_dim) and leaves the rest
    (`_compute_proportional_rope_parameters`; ggml's neox rope cannot skip pairs, Gemma4Model's
    generate_extra_tensors divides them by PROPORTIONAL_STILL instead)."""
    rope = rope_parameters(config)
    if rope.get("rope_type") == "proportional":
        full = dict(zip(config.layer_types, per_layer(config, "head_dim"), strict=True))["full_attention"]
        turned = int(rope["partial_rotary_factor"] * full // 2)
        return np.array([1.0] * turned + [PROPORTIONAL_STILL] * (full // 2 - turned), dtype=np.float32)
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
