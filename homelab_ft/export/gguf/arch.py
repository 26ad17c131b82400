"""Which llama.cpp architecture a Hugging Face model is written as, and the weight layouts that
differ from Hugging Face's.

Nothing here lists the model types transformers knows. A model's GGUF architecture is found from
transformers and gguf-py:

- the names: the model_type (or its transformers module, `gemma3_text` -> `gemma3`) spelt as one
  of gguf-py's `MODEL_ARCH_NAMES` (`qwen3_moe` -> `qwen3moe`, `qwen3_5` -> `qwen35`); for the
  few causal-LM classes llama.cpp's converter registers under another name (REGISTERED_AS:
  Mistral and Mixtral as `llama`, Olmo 3 as `olmo2`), that name; for the language model of an
  image-text checkpoint laid out as its twin's causal LM (text_view.py: Qwen2-VL's as Qwen2), the
  `gguf_architecture` its config.json names;
- the tensors: every checkpoint tensor must have a place in gguf-py's TensorNameMap for that
  architecture (gguf_export.py), or the family is refused before anything is written;
- Gemma's norm offset: a norm module that computes x * (1 + w) (llama.cpp computes x * w) is found
  by running each norm module of the model with zero weights (`_offset_norms`), so Gemma 1-4 and
  Qwen3-Next are handled with no table.

What cannot be read from either is llama.cpp's graph itself: LAYOUTS holds, per architecture
homelab-ft writes, what convert_hf_to_gguf.py does to the tensors beyond renaming (the q/k row
permutation of the `llama` graphs; the tensors it splits, transposes, reorders or scales, as
gguf_reshape.py rules: gpt-oss's experts, MLA's kv_b, Qwen 3.5's value heads, Granite's fused
gate/up, Falcon-H1's multipliers) and the settings llama.cpp's C++ fixes per architecture with
no GGUF key (`smollm3`'s no-rope layers, Gemma 2's sliding pattern, Qwen3-MoE's weight
normalisation, DeepSeek-V3's interleaved rope, gpt-oss's swiglu constants). An architecture
outside LAYOUTS is refused in one line: its conversion has not been read, and a GGUF with a
silently wrong layout is worse than none; so is one whose conversion was read but whose llama.cpp
graph computes another model for every checkpoint (GRAPH_DIFFERS: PhiMoE), with the reason. A
setting only newer llama.cpp builds read from the file (Gemma 3's sliding pattern,
`SwaPattern.since`) is written, and `runtime_needs` says in RUNNING.md which build a file that
differs from the old built-in needs, or where every build computes otherwise (gpt-oss's YaRN
rounding, gguf_rope.py).
"""

from __future__ import annotations

import functools
import json
import logging
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from homelab_ft.errors import UserError
from homelab_ft.export.gguf.reshape import (
    FALCON_H1,
    GEMMA4,
    GPT_OSS,
    GRANITE_HYBRID,
    MLA_KV_B,
    QWEN3NEXT_DELTA_NET,
    QWEN35_DELTA_NET,
    SELECTION_BIAS,
    Reshaped,
    mamba2,
)

log = logging.getLogger(__name__)


class GgufUnsupported(UserError):
    """A model homelab-ft cannot write as GGUF (the safetensors export is unaffected)."""


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


@dataclass(frozen=True)
class Target:
    """How one model is written as GGUF."""

    model_type: str
    arch_name: str
    """gguf-py's MODEL_ARCH_NAMES value, `general.architecture` in the file."""
    layout: Layout
    offset_norms: frozenset[str]
    """GGUF names of the norm weights written as 1 + w."""

    @property
    def arch(self):
        """gguf.MODEL_ARCH member."""
        return model_arch(self.arch_name)

    def from_gguf(self, gguf_name: str, array: np.ndarray, config) -> np.ndarray:
        """The inverse of to_gguf (GGUF read back into Hugging Face's layout; a part of a
        `Reshaped` tensor is returned as its part, which the rule's join puts back together)."""
        if gguf_name in self.offset_norms:
            array = array - np.float32(1.0)
        return self._permuted(gguf_name, array, config, forward=False)

    def to_gguf(self, gguf_name: str, array: np.ndarray, config) -> np.ndarray:
        """A tensor (a part of a `Reshaped` one: its part) in Hugging Face's layout -> llama.cpp's."""
        array = self._permuted(gguf_name, array, config, forward=True)
        return array + np.float32(1.0) if gguf_name in self.offset_norms else array

    def reshaped(self, key: str) -> Reshaped | None:
        """The rule that cuts checkpoint tensor `key` (experts stacked) into its GGUF parts, if any."""
        return next((rule for rule in (*self.layout.reshaped, SELECTION_BIAS) if rule.applies(key)), None)

    def _permuted(self, gguf_name: str, array: np.ndarray, config, *, forward: bool) -> np.ndarray:
        if not self.layout.permute_qk or not gguf_name.endswith(("attn_q.weight", "attn_k.weight")):
            return array
        heads = config.num_attention_heads if gguf_name.endswith("attn_q.weight") else config.num_key_value_heads
        return permute_heads(array, heads) if forward else unpermute_heads(array, heads)


def model_arch(arch_name: str):
    """The gguf.MODEL_ARCH member whose name (`general.architecture`) is `arch_name`."""
    import gguf

    return next(arch for arch, name in gguf.MODEL_ARCH_NAMES.items() if name == arch_name)


def check_architecture(model_dir: Path) -> Target:
    """How `model_dir` is written as GGUF, refused in one line (GgufUnsupported) when it cannot be."""
    model_dir = Path(model_dir)
    config = json.loads((model_dir / "config.json").read_text())
    model_type = config.get("model_type")
    where = f"{model_dir}/config.json"
    names = [config["gguf_architecture"]] if config.get("gguf_architecture") else \
        arch_candidates(model_type) if model_type else []
    arch_name = names[0] if names else None
    if arch_name in GRAPH_DIFFERS:
        raise GgufUnsupported(f"{where}: model_type {model_type!r} cannot be written as GGUF by homelab-ft: "
                              f"{GRAPH_DIFFERS[arch_name]}, so the file would run another model")
    if arch_name not in LAYOUTS:
        known = f"llama.cpp runs it as {arch_name!r} but homelab-ft has not read that conversion" if names else \
            "llama.cpp's gguf-py declares no architecture for it"
        raise GgufUnsupported(f"{where}: model_type {model_type!r} cannot be written as GGUF by homelab-ft ({known})")
    if config.get("text_config") is not None:
        raise GgufUnsupported(f"{where}: a multimodal checkpoint ({model_type!r} with a text_config) cannot be written "
                              "as GGUF by homelab-ft, which writes text-only models (llama.cpp keeps the vision tower "
                              "in a separate mmproj file)")
    layout = LAYOUTS[arch_name]
    if layout.model_types and model_type not in layout.model_types:
        raise GgufUnsupported(f"{where}: model_type {model_type!r} cannot be written as GGUF by homelab-ft (llama.cpp "
                              f"runs it as {arch_name!r}, whose conversion homelab-ft has read for "
                              f"{', '.join(layout.model_types)} only)")
    _check_rope(rope_parameters(config), layout, where=where, arch_name=arch_name)
    _check_sizes_by_layer_type(config, where=where)
    _check_fixed(config, layout, where=where)
    return Target(model_type=model_type, arch_name=arch_name, layout=layout,
                  offset_norms=_offset_norms(model_dir, arch_name))


def runtime_needs(model_dir: Path) -> list[str]:
    """What running the GGUF of `model_dir` asks of llama.cpp beyond any build that has its
    architecture, or where every build runs it otherwise, one sentence each for RUNNING.md (and
    the export's warnings): a sliding pattern other than the one older builds fix in C++ is run as
    trained only by builds that read it from the file; llama.cpp rounds a YaRN range the config
    does not (gguf_rope.yarn_rounding: gpt-oss)."""
    from homelab_ft.export.gguf.rope import yarn_rounding

    rounding = yarn_rounding(model_dir)
    return _swa_needs(model_dir) + ([rounding] if rounding else [])


def _swa_needs(model_dir: Path) -> list[str]:
    config = json.loads((Path(model_dir) / "config.json").read_text())
    names = arch_candidates(config.get("model_type", ""))
    layout = LAYOUTS.get(names[0]) if names else None
    pattern = layout.swa_pattern if layout else None
    layer_types = config.get("layer_types")
    if not (pattern and pattern.builtin and layer_types and config.get("sliding_window")):
        return []
    builtin = pattern.builtin(config)
    if list(layer_types) == builtin:
        return []

    def full(kinds: list) -> str:
        layers = [i for i, kind in enumerate(kinds) if kind == "full_attention"]
        return f"layers {layers}" if layers else "no layer"

    return [f"This model attends to the full context on {full(layer_types)}, where the llama.cpp builds "
            f"that fix {names[0]}'s pattern in C++ ({pattern.source.split(',')[0]}) use {full(builtin)}: "
            f"run it on llama.cpp {pattern.since} or newer (checked to read "
            f"`{names[0]}.attention.sliding_window_pattern`, which this file carries) or on an Ollama / LM Studio "
            "built on one; an older build loads the file and runs another model."]


def _check_rope(rope: dict, layout: Layout, *, where: str, arch_name: str) -> None:
    """The rope types gguf_hparams writes (the sliding layers' too, which llama.cpp turns by the
    plain rope with their own base); a proportional rope only unscaled (Gemma 4's)."""
    kind = rope.get("rope_type", "default")
    if kind not in (layout.rope_types or ROPE_TYPES):
        raise GgufUnsupported(f"{where}: rope type {kind!r} cannot be written as GGUF by homelab-ft"
                              + (f" for {arch_name!r}" if layout.rope_types else "")
                              + (f": {layout.rope_refusal}" if layout.rope_refusal else ""))
    swa = (rope.get("swa") or {}).get("rope_type", "default")
    if swa != "default" or (kind == "proportional" and rope.get("factor", 1.0) != 1.0):
        raise GgufUnsupported(f"{where}: rope type {swa!r} on the sliding layers, or a scaled proportional rope, cannot "
                              "be written as GGUF by homelab-ft")


def _check_sizes_by_layer_type(config: dict, *, where: str) -> None:
    """Sizes transformers keeps per layer (per_layer_config: Gemma 4's full-attention head_dim) must
    be one per layer type: llama.cpp reads one head size for the full layers and one for the
    sliding ones (`key_length`, `key_length_swa`)."""
    overrides = config.get("per_layer_config") or {}
    for key in ("head_dim",):
        sizes = {}
        for layer, kind in enumerate(config.get("layer_types") or []):
            sizes.setdefault(kind, set()).add((overrides.get(str(layer)) or {}).get(key, config.get(key)))
        mixed = {kind: sorted(values) for kind, values in sizes.items() if len(values) > 1}
        if mixed:
            raise GgufUnsupported(f"{where}: {key} differs between layers of one type ({mixed}); llama.cpp reads one "
                                  "per layer type, so it cannot be written as GGUF")


def _check_fixed(config: dict, layout: Layout, *, where: str) -> None:
    for fixed in layout.fixed:
        value = config.get(fixed.key)
        if value is None:
            continue
        want = fixed.llama_cpp(config)
        if (list(value) if isinstance(value, list | tuple) else value) != want:
            raise GgufUnsupported(f"{where}: {fixed.key} = {value} but llama.cpp runs this architecture with {want} "
                                  f"({fixed.source}, no GGUF key), so it would run another model")


# ------------------------------------------------------------------------------- derivation


REGISTERED_AS = {
    "MistralForCausalLM": "llama",
    "MixtralForCausalLM": "llama",
    "Olmo3ForCausalLM": "olmo2",
    "DeepseekV3ForCausalLM": "deepseek2",
    "GraniteMoeHybridForCausalLM": "granitehybrid",
}
"""Hugging Face architectures llama.cpp's convert_hf_to_gguf.py registers under an architecture of
another name (`@ModelBase.register(...)` on LlamaModel, Olmo2Model, DeepseekV2Model and
GraniteHybridModel): llama.cpp's own choice, which neither transformers nor gguf-py records. Every
other model type is found by its name. (The last is not in LAYOUTS: listed so that its refusal
names what llama.cpp runs it as.)"""


def arch_candidates(model_type: str) -> list[str]:
    """gguf architecture names for `model_type`: its own name or its transformers module's
    (`gemma3_text` -> gemma3) as gguf-py spells architectures (`qwen3_moe` -> qwen3moe, `qwen3_5`
    -> qwen35, `gpt_oss` -> gpt-oss), else the one llama.cpp registers its causal-LM class under.
    The first is the one llama.cpp runs it as.

    Not the class transformers' modular source derives it from: that is code reuse, not the same
    model (Cohere, Phi and GLM derive from Llama there, and llama.cpp runs each as its own)."""
    import gguf
    from transformers import CONFIG_MAPPING
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    known = set(gguf.MODEL_ARCH_NAMES.values())
    names = [model_type]
    if model_type in CONFIG_MAPPING:
        names.append(CONFIG_MAPPING[model_type].__module__.split(".")[-2])
    out = []
    for name in names:
        for spelt in (name, name.replace("_", ""), name.replace("_", "-"), re.sub(r"_v(\d)", r"\1", name)):
            if spelt in known and spelt not in out:
                out.append(spelt)
    registered = REGISTERED_AS.get(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(model_type, ""))
    return out + [registered] if registered and registered not in out else out


def _offset_norms(model_dir: Path, arch_name: str) -> frozenset[str]:
    """GGUF names of the norm weights whose module computes x * (1 + w): each norm-like module (a
    1-D weight and no other matrix) of the model, built on the meta device, is copied to the CPU
    with zero parameters and run on random input; a non-zero output means the offset. Memoized
    per config (an export asks for the base's and the merged model's several times)."""
    return _probe_norms(str(Path(model_dir).resolve()), (Path(model_dir) / "config.json").read_text(), arch_name)


@functools.lru_cache(maxsize=8)
def _probe_norms(model_dir: str, config_json: str, arch_name: str) -> frozenset[str]:
    import copy

    import gguf
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    del config_json  # the cache key: the folder's config as it is now
    config = AutoConfig.from_pretrained(model_dir)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    name_map = gguf.get_tensor_name_map(model_arch(arch_name), config.num_hidden_layers)
    probed: dict[type, bool] = {}
    out = set()
    for name, module in model.named_modules():
        params = dict(module.named_parameters(recurse=False))
        if set(params) != {"weight"} or params["weight"].dim() != 1 or isinstance(module, torch.nn.Embedding):
            continue
        key = (type(module), params["weight"].shape[0])
        if key not in probed:
            probed[key] = _adds_one(copy.deepcopy(module), width=params["weight"].shape[0])
        mapped = name_map.get_name(f"{name}.weight", try_suffixes=(".weight",))
        if probed[key] and mapped:
            out.add(mapped)
    return frozenset(out)


def _adds_one(module, *, width: int) -> bool:
    import torch

    module = module.to_empty(device="cpu")
    with torch.no_grad():
        for tensor in (*module.parameters(), *module.buffers()):
            if tensor.is_floating_point():
                tensor.zero_()
    try:
        with torch.no_grad():
            out = module(torch.randn(2, width, generator=torch.Generator().manual_seed(0)))
    except (TypeError, RuntimeError) as err:  # a gated norm wants a second input: llama.cpp's is x * w too
        log.debug("norm probe of %s: %s", type(module).__name__, err)
        return False
    return bool(torch.as_tensor(out).abs().max() > 0)


# ------------------------------------------------------------------------------------- layouts


def permute_heads(weights: np.ndarray, num_heads: int) -> np.ndarray:
    """Rows of each head from [first halves | second halves] to interleaved pairs, as
    convert_hf_to_gguf.py's LlamaModel.permute; transformers' GGUF loader undoes it on read."""
    rows = weights.shape[0]
    return (weights.reshape(num_heads, 2, rows // num_heads // 2, *weights.shape[1:])
            .swapaxes(1, 2).reshape(weights.shape))


def unpermute_heads(weights: np.ndarray, num_heads: int) -> np.ndarray:
    """The inverse of permute_heads."""
    rows = weights.shape[0]
    return (weights.reshape(num_heads, rows // num_heads // 2, 2, *weights.shape[1:])
            .swapaxes(1, 2).reshape(weights.shape))


def rope_parameters(config) -> dict:
    """The rope settings of a config (its dict or object) in one shape, `rope_type` and
    `rope_theta` included, whichever names the transformers version that wrote it used."""
    if isinstance(config, dict):
        rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
        theta = config.get("rope_theta")
    else:
        rope = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
        theta = getattr(config, "rope_theta", None)
    rope = dict(rope)
    if "type" in rope and "rope_type" not in rope:
        rope["rope_type"] = rope["type"]
    if theta is not None:
        rope.setdefault("rope_theta", theta)
    if "full_attention" in rope:  # Gemma 3, Olmo 3: one set per layer type
        return dict(rope["full_attention"], swa=rope.get("sliding_attention", {}))
    return rope
