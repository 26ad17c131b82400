"""What llama.cpp's graph expects of each architecture homelab-ft writes, beyond gguf-py's tensor
names: the `Layout` of each (gguf_arch.py's module docstring says how a model finds its
architecture), read from llama.cpp's converter (convert_hf_to_gguf.py, conversion/*.py) and its C++
(src/models/*.cpp, llama-model.cpp, llama-graph.cpp), with the source named beside each setting.

    LAYOUTS        architecture -> Layout: the q/k permutation, the tensors reshaped (gguf_reshape.py),
                   the settings llama.cpp fixes with no GGUF key (`Fixed`: a config that differs is refused)
    GRAPH_DIFFERS  architectures read and refused: llama.cpp's graph computes another model
    VARIANTS       architectures the converter writes as another one for some configs
    ROPE_TYPES     the rope types written
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from homelab_ft.export.gguf.reshape import (
    FALCON_H1,
    GEMMA4,
    GPT_OSS,
    GRANITE_HYBRID,
    LLAMA4,
    MLA_KV_B,
    NEMOTRON_H,
    QWEN3NEXT_DELTA_NET,
    QWEN35_DELTA_NET,
    Reshaped,
    mamba2,
)


@dataclass(frozen=True)
class Fixed:
    """A setting llama.cpp's C++ fixes for an architecture, with no GGUF key to carry another
    value: a config that differs is a model llama.cpp would run differently, so it is refused."""

    key: str
    """The config.json key (not checked when the config lacks it)."""
    llama_cpp: Callable[[dict], object]
    """The value llama.cpp assumes, from the rest of config.json."""
    source: str
    """Where llama.cpp fixes it."""


def _every(step: int, *, other: object, last: object) -> Callable[[dict], list]:
    """A per-layer pattern with `last` on every `step`-th layer, `other` elsewhere."""
    return lambda config: [last if (i + 1) % step == 0 else other for i in range(config["num_hidden_layers"])]


def _gemma_scale(layers_27b: int) -> Callable[[dict], int]:
    """Gemma 2/3's query scale as llama.cpp sets f_attention_scale: 1/sqrt(head_dim), except the
    27B models (told apart by their layer count), 1/sqrt(hidden / heads)."""
    return lambda c: (c["hidden_size"] // c["num_attention_heads"] if c["num_hidden_layers"] == layers_27b
                      else c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"])


@dataclass(frozen=True)
class SwaPattern:
    """llama.cpp reads the per-layer sliding pattern (`<arch>.attention.sliding_window_pattern`, one
    bool per layer, True = windowed) from the file for this architecture."""

    builtin: Callable[[dict], list] | None = None
    """The pattern llama.cpp builds from before reading the key fixed in C++ (None: always read)."""
    since: str = ""
    """The llama.cpp build checked to read the key, where `builtin` is set."""
    source: str = ""


@dataclass(frozen=True)
class Layout:
    """What llama.cpp's graph for one architecture expects beyond gguf-py's tensor names."""

    permute_qk: bool = False
    """llama.cpp's `llama`-style graphs rope interleaved pairs (GPT-J style), HF rotates halves:
    convert_hf_to_gguf.py's LlamaModel.permute reorders q/k rows (LlamaModel and its subclasses)."""
    fixed: tuple[Fixed, ...] = ()
    sliding_window: bool = True
    """Whether llama.cpp's graph applies a config's sliding window (its `llama` graph has none,
    which llama.cpp's converter accepts for Mistral 7B v0.1's 4096-token window: a warning here)."""
    swa_pattern: SwaPattern | None = None
    """Where llama.cpp reads `layer_types` from the file (Olmo 2, Gemma 3), else None."""
    expert_gating: str = ""
    """The router's gating function as the converter writes it by hand (`<arch>.expert_gating_func`,
    a gguf.ExpertGatingFuncType member name: GLM-4.5's SIGMOID), else none written."""
    model_types: tuple[str, ...] = ()
    """The model types whose conversion was read for this architecture (DeepSeek-V3 of the several
    llama.cpp runs as `deepseek2`); empty: any model type spelt as it."""
    rope_types: tuple[str, ...] = ()
    """The rope types written for this architecture where fewer than ROPE_TYPES (empty: those)."""
    rope_refusal: str = ""
    """Why the others are not, said in the refusal."""
    mla: bool = False
    """Multi-head latent attention as convert_hf_to_gguf.py's DeepseekV2Model writes it: one KV
    head and the MLA head sizes (kv_b_proj's split is the `reshaped` rule gguf_reshape.MLA_KV_B)."""
    reshaped: tuple[Reshaped, ...] = ()
    """The checkpoint tensors llama.cpp holds under other names, in another layout, or as several
    (gguf_reshape.py)."""
    nextn_dropped: bool = False
    """The checkpoint may hold NextN/MTP layers past num_hidden_layers (GLM-4.5, DeepSeek-V3) or
    under `mtp.` (Qwen 3.5, Qwen3-Next): they are left out and `nextn_predict_layers` is not
    written, as convert_hf_to_gguf.py --no-mtp does (transformers drops them on load; a merge that
    keeps the base's files keeps them)."""
    rope_sections: tuple[int, ...] = ()
    """The M-RoPE sections llama.cpp requires (`rope.dimension_sections`) where the config names none
    (Qwen 3.5: _Qwen35MRopeMixin's [11, 11, 10, 0]); text positions are the same on every section,
    so for text they only have to cover the rotated pairs."""
    recurrent_kv_heads: bool = False
    """llama.cpp tells the recurrent layers by `attention.head_count_kv` 0 (Granite 4 hybrid:
    GraniteHybridModel writes one count per layer)."""
    rope_switch: bool = False
    """llama.cpp turns q/k only where `rope.scaling.finetuned` is true, its default (Granite 4
    hybrid's graph); written from position_embedding_type."""
    tokenizer_kinds: tuple[str, ...] = ()
    """The tokenizers (gguf_vocab's kinds: gpt2, llama) written for this architecture where not
    every one is, else empty."""
    lora_ignored: tuple[str, ...] = ()
    """The tensors (gguf.MODEL_TENSOR names) llama.cpp's graph multiplies with plain ggml_mul_mat
    rather than build_lora_mm, so a LoRA GGUF's pair for them is loaded and never applied: an
    adapter on them is refused (gguf_adapter). Gemma 4's per-layer model projection
    (models/gemma4.cpp project_per_layer_inputs), DeepSeek-V3's query and compressed-KV projections
    (models/deepseek2.cpp): such adapters ran 0.5 and 1.2-1.3 of the largest logit off the merged
    model in llama.cpp b11739."""
    softcap_defaults: tuple[str, ...] = ()
    """The soft-capping keys llama.cpp reads for this architecture with a default where the file
    has none (llama-hparams.h: attention 50.0, final 30.0): written from the config, as 0.0 where it
    caps nothing, which the graphs test as off (`if (hparams.f_final_logit_softcapping)`). Gemma 4
    without them ran its logits through 30 tanh(x / 30): 7.6% off at a logit of 15 in llama.cpp."""
    expert_ff_key: str = "moe_intermediate_size"
    """The config key `expert_feed_forward_length` is written from (gpt-oss's experts are
    `intermediate_size` wide: GptOssModel.set_gguf_parameters writes that)."""


def _linear_every(config: dict) -> list[str]:
    """Qwen 3.5 / Qwen3-Next's layer pattern as llama.cpp builds it from full_attention_interval
    (the converter writes the config's, else 4): linear attention except every interval-th layer."""
    interval = config.get("full_attention_interval") or 4
    return _every(interval, other="linear_attention", last="full_attention")(config)


def _gemma4_shared_kv(config: dict) -> object:
    """The KV-sharing tail llama.cpp runs as transformers does: each shared layer reads the last
    layer of its type that keeps its own cache (Gemma4TextConfig.kv_sharing_modes), which llama.cpp
    takes to be the last two such layers, sliding then full."""
    shared = config["num_kv_shared_layers"]
    kept = config["layer_types"][: config["num_hidden_layers"] - shared]
    if not shared or kept[-2:] == ["sliding_attention", "full_attention"]:
        return shared
    return "0, or a count that leaves a sliding then a full layer last among those with their own KV cache"


def _nemotron_blocks(config: dict) -> object:
    """Nemotron-H's block pattern where llama.cpp runs it: MLP blocks or MoE blocks, not both
    (models/nemotron-h.cpp takes a block of n_ff 0 and no KV heads for Mamba, and NemotronHModel
    writes n_ff for the MoE blocks only in an MoE model)."""
    kinds = config["layers_block_type"]
    return kinds if not {"mlp", "moe"} <= set(kinds) else "MLP blocks or MoE blocks, not both"


def _llama4_moe_layers(config: dict) -> list[int]:
    step = config["interleave_moe_layer_step"]
    return [layer for layer in range(config["num_hidden_layers"]) if (layer + 1) % step == 0]


def _deepseek2_lite(config: dict) -> bool:
    layers = config["num_hidden_layers"]
    return layers in (26, 27) or (layers == 48 and config.get("vocab_size") == 128256)


_SLIDING = {"other": "sliding_attention", "last": "full_attention"}

_DELTA_NET = (
    Fixed("layer_types", _linear_every, "models/qwen35.cpp, qwen3next.cpp: recurrent unless (i + 1) % "
          "full_attention_interval == 0 (attention.recurrent_layers: no gguf-py 0.19 key)"),
    Fixed("linear_value_head_dim", lambda config: config["linear_key_head_dim"],
          "models/qwen35.cpp, qwen3next.cpp: head_v_dim = ssm_d_state, the key head size"),
    Fixed("attention_bias", lambda config: False, "models/qwen35.cpp, qwen3next.cpp: q/k/v without biases"),
)

_NEMOTRON_H = {"reshaped": (*NEMOTRON_H, *mamba2("mixer")), "recurrent_kv_heads": True, "nextn_dropped": True,
               "fixed": (
    Fixed("layers_block_type", _nemotron_blocks, "models/nemotron-h.cpp: a block's kind from n_ff and head_count_kv"),
    Fixed("mamba_hidden_act", lambda config: "silu", "llm_build_mamba_base: the gate and conv through silu"),
    Fixed("mlp_hidden_act", lambda config: "relu2", "models/nemotron-h.cpp: LLM_FFN_RELU_SQR"),
    Fixed("use_conv_bias", lambda config: True, "llm_build_mamba_base: the conv's bias added"),
    Fixed("use_bias", lambda config: False, "models/nemotron-h.cpp: Mamba in/out projections without biases"),
    Fixed("moe_latent_size", lambda config: None, "models/nemotron-h.cpp b11739: experts on the hidden state, "
          "no latent projection read"))}
"""Nemotron-H as convert_hf_to_gguf.py's NemotronHModel (conversion/nemotron.py, a GraniteHybridModel)
writes it and models/nemotron-h.cpp reads it: Mamba 2 mixers as Granite 4 hybrid's, attention
without rope, relu2 MLP or MoE blocks (sigmoid routing with the selection bias, shared experts),
one mixer per block; `nemotron_h_moe` where it has MoE blocks (VARIANTS)."""

LAYOUTS = {
    "llama": Layout(permute_qk=True, sliding_window=False),
    "smollm3": Layout(permute_qk=True, fixed=(
        Fixed("no_rope_layers", _every(4, other=1, last=0), "llama-model.cpp: n_no_rope_layer_step = 4"),)),
    "qwen2": Layout(),
    "qwen3": Layout(),
    "qwen2moe": Layout(),
    "qwen3moe": Layout(fixed=(
        Fixed("norm_topk_prob", lambda config: True, "models/qwen3moe.cpp: build_moe_ffn(..., norm_w = true)"),)),
    "phi3": Layout(),
    "gemma": Layout(),
    "gemma2": Layout(softcap_defaults=("attn_logit_softcapping", "final_logit_softcapping"), fixed=(
        Fixed("layer_types", _every(2, **_SLIDING), "llama-model.cpp: set_swa_pattern(2)"),
        Fixed("query_pre_attn_scalar", _gemma_scale(46), "llama-model.cpp: f_attention_scale"))),
    "gemma3": Layout(fixed=(
        Fixed("query_pre_attn_scalar", _gemma_scale(62), "llama-model.cpp: f_attention_scale"),),
        swa_pattern=SwaPattern(builtin=_every(6, **_SLIDING), since="b11739",
                               source="llama-model.cpp: set_swa_pattern(6), then gemma3.attention.sliding_window_pattern "
                                      "(an array or a period) where the file has it")),
    "olmo2": Layout(swa_pattern=SwaPattern(source="convert_hf_to_gguf.py: Olmo2Model writes it from layer_types")),
    "granite": Layout(permute_qk=True),
    "qwen2vl": Layout(model_types=("qwen2",)),
    "qwen3vl": Layout(model_types=("qwen3",)),
    "glm4moe": Layout(expert_gating="SIGMOID", nextn_dropped=True),
    "qwen35": Layout(reshaped=QWEN35_DELTA_NET, rope_sections=(11, 11, 10, 0), nextn_dropped=True, fixed=_DELTA_NET),
    "qwen35moe": Layout(reshaped=QWEN35_DELTA_NET, rope_sections=(11, 11, 10, 0), nextn_dropped=True,
                        fixed=_DELTA_NET),
    "qwen3next": Layout(reshaped=QWEN3NEXT_DELTA_NET, nextn_dropped=True, fixed=(*_DELTA_NET,
        Fixed("norm_topk_prob", lambda config: True, "models/qwen3next.cpp: build_moe_ffn(..., norm_w = true)"),
        Fixed("decoder_sparse_step", lambda config: 1, "models/qwen3next.cpp: ffn_gate_inp required on every layer"),
        Fixed("mlp_only_layers", lambda config: [], "models/qwen3next.cpp: ffn_gate_inp required on every layer"))),
    "gemma4": Layout(reshaped=GEMMA4, rope_types=("proportional",), tokenizer_kinds=("gpt2",),
                     softcap_defaults=("final_logit_softcapping",), lora_ignored=("PER_LAYER_MODEL_PROJ",),
                     swa_pattern=SwaPattern(
        source="models/gemma4.cpp: sliding_window_pattern, one bool per layer, always read"), fixed=(
        Fixed("hidden_activation", lambda config: "gelu_pytorch_tanh", "models/gemma4.cpp: LLM_FFN_GELU (tanh)"),
        Fixed("attention_bias", lambda config: False, "models/gemma4.cpp: q/k/v/o without biases"),
        Fixed("use_bidirectional_attention", lambda config: config["use_bidirectional_attention"]
              if config["use_bidirectional_attention"] != "all" else "causal text attention (None or 'vision')",
              "models/gemma4.cpp: a causal graph"),
        Fixed("num_kv_shared_layers", _gemma4_shared_kv, "llama-model.cpp: a shared sliding layer reuses layer "
              "n_layer_kv_from_start - 2, a shared full one n_layer_kv_from_start - 1"))),
    "granitehybrid": Layout(permute_qk=True, reshaped=(*GRANITE_HYBRID, *mamba2("mamba")), recurrent_kv_heads=True,
                            rope_switch=True, fixed=(
        Fixed("mamba_expand", lambda config: 2, "models/granite-hybrid.cpp: GGML_ASSERT(2 * n_embd == d_inner)"),
        Fixed("mamba_conv_bias", lambda config: True, "llm_build_mamba_base: the conv's bias added"),
        Fixed("mamba_proj_bias", lambda config: False, "models/granite-hybrid.cpp: in/out projections without biases"),
        Fixed("hidden_act", lambda config: "silu", "models/granite-hybrid.cpp: LLM_FFN_SILU"))),
    "falcon-h1": Layout(reshaped=(*FALCON_H1, *mamba2("mamba")), fixed=(
        Fixed("mamba_norm_before_gate", lambda config: config["mamba_norm_before_gate"]
              if not config.get("mamba_rms_norm") else False, "llm_build_mamba_base: the gate, then the group norm"),
        Fixed("tie_word_embeddings", lambda config: config["tie_word_embeddings"]
              if config.get("embedding_multiplier") == config.get("lm_head_multiplier") else False,
              "one token_embd cannot carry both the embedding's and the head's multiplier"),
        Fixed("hidden_act", lambda config: "silu", "models/falcon-h1.cpp: LLM_FFN_SILU"))),
    "llama4": Layout(reshaped=LLAMA4, expert_ff_key="intermediate_size", fixed=(
        Fixed("attention_chunk_size", lambda config: 8192, "llama-model.cpp: n_attn_chunk = 8192"),
        Fixed("layer_types", _every(4, other="chunked_attention", last="full_attention"),
              "llama-model.cpp: set_swa_pattern(4), 3 chunked then 1 full"),
        Fixed("no_rope_layers", _every(4, other=1, last=0), "llama-model.cpp: n_no_rope_layer_step = 4"),
        Fixed("moe_layers", _llama4_moe_layers, "models/llama4.cpp: a layer is MoE where (il + 1) % "
              "interleave_moe_layer_step == 0"),
        Fixed("use_qk_norm", lambda config: config["num_local_experts"] != 128,
              "llama-model.cpp: use_kq_norm unless 128 experts (Maverick)"),
        Fixed("attn_temperature_tuning", lambda config: True, "models/llama4.cpp: the NoPE layers' query scaled"),
        Fixed("floor_scale", lambda config: 8192, "llama-model.cpp: n_attn_temp_floor_scale = 8192"),
        Fixed("attn_scale", lambda config: 0.1, "llama-model.cpp: f_attn_temp_scale = 0.1"),
        Fixed("hidden_act", lambda config: "silu", "models/llama4.cpp: LLM_FFN_SILU"),
        Fixed("attention_bias", lambda config: False, "models/llama4.cpp: q/k/v/o without biases"))),
    "nemotron_h": Layout(**_NEMOTRON_H),
    "nemotron_h_moe": Layout(**_NEMOTRON_H),
    "gpt-oss": Layout(reshaped=GPT_OSS, expert_ff_key="intermediate_size", fixed=(
        Fixed("layer_types", _every(2, **_SLIDING), "models/openai-moe.cpp: set_swa_pattern(2)"),
        Fixed("swiglu_limit", lambda config: 7.0, "llama-graph.cpp build_moe_ffn: LLM_FFN_SWIGLU_OAI_MOE's limit"),
        Fixed("swiglu_alpha", lambda config: 1.702, "llama-graph.cpp build_moe_ffn: LLM_FFN_SWIGLU_OAI_MOE's alpha"),
        Fixed("attention_bias", lambda config: True, "models/openai-moe.cpp: q/k/v/o biases required"))),
    "deepseek2": Layout(model_types=("deepseek_v3",), rope_types=("default",), rope_refusal=(
        "llama.cpp scales DeepSeek's YaRN attention by rope.scaling.yarn_log_multiplier m, read as (1 + m ln s)^2 "
        "before its PR 17945 and (1 + 0.1 m ln s)^2 after (models/deepseek2.cpp kq_scale), so one file runs with "
        "another attention scale on older and newer builds"), mla=True, expert_gating="SIGMOID",
                        nextn_dropped=True, reshaped=(MLA_KV_B,),
                        lora_ignored=("ATTN_Q", "ATTN_Q_A", "ATTN_Q_B", "ATTN_KV_A_MQA"), fixed=(
        Fixed("rope_interleave", lambda config: True, "llama-model.cpp: LLM_ARCH_DEEPSEEK2 ropes pairs (ROPE_TYPE_NORM)"),
        Fixed("q_lora_rank", lambda c: None if _deepseek2_lite(c) else c["q_lora_rank"],
              "models/deepseek2.cpp: a 26- or 27-layer model (48 with a 128256 vocabulary) is a lite one, "
              "whose q_lora_rank is not read"),
        Fixed("attention_bias", lambda config: False, "models/deepseek2.cpp: no attention biases"))),
}
"""gguf architecture name -> its layout, read from convert_hf_to_gguf.py (LlamaModel, SmolLM3Model,
Qwen2Model, Qwen3Model, Qwen2MoeModel, Qwen3MoeModel, Phi3MiniModel, GemmaModel, Gemma2Model, Gemma3Model,
Olmo2Model, GraniteModel, Glm4MoeModel, DeepseekV2Model, GptOssModel, Qwen3NextModel, Qwen3_5TextModel,
Qwen3_5MoeTextModel; Qwen2VLModel and Qwen3VLTextModel for the language models of Qwen2/2.5-VL and
Qwen3-VL, written through their Qwen2 / Qwen3 twins with the M-RoPE sections, text_view.py) and
llama.cpp's load_hparams (src/models/glm4-moe.cpp for GLM-4.5, src/models/deepseek2.cpp for
DeepSeek-V3, src/models/openai-moe.cpp and llama-graph.cpp's build_moe_ffn for gpt-oss,
src/models/qwen35.cpp, qwen35moe.cpp and qwen3next.cpp for the gated delta net). Names,
hyperparameters and norm offsets are derived, not listed. Every released checkpoint of these
families has the fixed values (SmolLM3-3B, Qwen3-30B-A3B, Gemma 2 2B-27B, Gemma 3 270M-27B,
DeepSeek-V3 and Moonlight-16B-A3B); a config changed by hand may not. DeepSeek-V3 is written
without rope scaling only: its YaRN (DeepSeek-V3/R1 themselves, Kimi K2) is refused, llama.cpp's
mscale handling for it (deepseek2.cpp's kq_scale, rope.scaling.yarn_log_mul) not being written."""

GRAPH_DIFFERS = {
    "phimoe": "convert_hf_to_gguf.py's PhiMoeModel writes it as Phi-3 with experts and llama.cpp runs it on "
              "Phi-3's graph (src/models/phimoe.cpp: llama_model_phi3::graph), which normalises with RMSNorm plus "
              "a bias where PhiMoE uses LayerNorm, and routes by softmax top-k renormalised where PhiMoE uses "
              "sparsemixer",
}
"""Architectures whose llama.cpp conversion was read and whose graph computes another model than
transformers' for every checkpoint (no config key tells them apart): refused with the reason."""

ROPE_TYPES = ("default", "linear", "llama3", "yarn")
"""rope_type values llama.cpp reads from the keys gguf_hparams.py writes."""



VARIANTS = {
    "nemotron_h": ("nemotron_h_moe", lambda config: "moe" in (config.get("layers_block_type") or [])
                   or "E" in (config.get("hybrid_override_pattern") or "")),
}
"""Architectures llama.cpp's converter writes as another one for some configs: (that one, when).
NemotronHModel writes an MoE Nemotron-H as `nemotron_h_moe` (it asks for num_experts_per_tok,
which transformers 5 saves in every Nemotron-H config, dense too; the MoE blocks are asked here)."""
