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
permutation of the `llama` graphs) and the settings llama.cpp's C++ fixes per architecture with
no GGUF key (`smollm3`'s no-rope layers, Gemma 2's sliding pattern, Qwen3-MoE's weight
normalisation, DeepSeek-V3's interleaved rope). An architecture outside LAYOUTS is refused in one
line: its conversion has not been read, and a GGUF with a silently wrong layout is worse than none;
so is one whose conversion was read but whose llama.cpp graph computes another model for every
checkpoint (GRAPH_DIFFERS: PhiMoE), with the reason. A setting only newer
llama.cpp builds read from the file (Gemma 3's sliding pattern, `SwaPattern.since`) is written, and
`runtime_needs` says in RUNNING.md which build a file that differs from the old built-in needs.
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
    mla: bool = False
    """Multi-head latent attention as convert_hf_to_gguf.py's DeepseekV2Model writes it: kv_b_proj
    split into attn_k_b (transposed per head) and attn_v_b, one KV head, the MLA head sizes."""
    nextn_dropped: bool = False
    """The checkpoint may hold NextN/MTP layers past num_hidden_layers (GLM-4.5): they are left out
    and `nextn_predict_layers` is not written, as convert_hf_to_gguf.py --no-mtp does
    (transformers drops them on load, so a merged model has none)."""


def _deepseek2_lite(config: dict) -> bool:
    layers = config["num_hidden_layers"]
    return layers in (26, 27) or (layers == 48 and config.get("vocab_size") == 128256)


_SLIDING = {"other": "sliding_attention", "last": "full_attention"}

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
    "gemma2": Layout(fixed=(
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
    "deepseek2": Layout(model_types=("deepseek_v3",), rope_types=("default",), mla=True, expert_gating="SIGMOID",
                        nextn_dropped=True, fixed=(
        Fixed("rope_interleave", lambda config: True, "llama-model.cpp: LLM_ARCH_DEEPSEEK2 ropes pairs (ROPE_TYPE_NORM)"),
        Fixed("q_lora_rank", lambda c: None if _deepseek2_lite(c) else c["q_lora_rank"],
              "models/deepseek2.cpp: a 26- or 27-layer model (48 with a 128256 vocabulary) is a lite one, "
              "whose q_lora_rank is not read"),
        Fixed("attention_bias", lambda config: False, "models/deepseek2.cpp: no attention biases"))),
}
"""gguf architecture name -> its layout, read from convert_hf_to_gguf.py (LlamaModel, SmolLM3Model,
Qwen2Model, Qwen3Model, Qwen2MoeModel, Qwen3MoeModel, Phi3MiniModel, GemmaModel, Gemma2Model, Gemma3Model,
Olmo2Model, GraniteModel, Glm4MoeModel, DeepseekV2Model; Qwen2VLModel and Qwen3VLTextModel for the
language models of Qwen2/2.5-VL and Qwen3-VL, written through their Qwen2 / Qwen3 twins with the
M-RoPE sections, text_view.py) and llama.cpp's load_hparams
(src/models/glm4-moe.cpp for GLM-4.5, src/models/deepseek2.cpp for DeepSeek-V3). Names,
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
        """The inverse of to_gguf (GGUF read back into Hugging Face's layout); a part of MLA's
        kv_b is returned as it is (merge_kv_b joins the two)."""
        if gguf_name in self.offset_norms:
            array = array - np.float32(1.0)
        return self._permuted(gguf_name, array, config, forward=False)

    def to_gguf(self, gguf_name: str, array: np.ndarray, config) -> np.ndarray:
        """A tensor in Hugging Face's layout -> llama.cpp's."""
        if self.layout.mla and gguf_name.endswith(KV_B_PARTS):
            return split_kv_b(array, config)[gguf_name.endswith(KV_B_PARTS[1])]
        array = self._permuted(gguf_name, array, config, forward=True)
        return array + np.float32(1.0) if gguf_name in self.offset_norms else array

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
    rope = rope_parameters(config)
    if rope.get("rope_type", "default") not in (layout.rope_types or ROPE_TYPES):
        raise GgufUnsupported(f"{where}: rope type {rope.get('rope_type')!r} cannot be written as GGUF by homelab-ft"
                              + (f" for {arch_name!r}" if layout.rope_types else ""))
    _check_fixed(config, layout, where=where)
    return Target(model_type=model_type, arch_name=arch_name, layout=layout,
                  offset_norms=_offset_norms(model_dir, arch_name))


def runtime_needs(model_dir: Path) -> list[str]:
    """What running the GGUF of `model_dir` asks of llama.cpp beyond any build that has its
    architecture, one sentence each for RUNNING.md: a sliding pattern other than the one older
    builds fix in C++ is run as trained only by builds that read it from the file."""
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


KV_B_PARTS = ("attn_k_b.weight", "attn_v_b.weight")


def split_kv_b(kv_b: np.ndarray, config) -> tuple[np.ndarray, np.ndarray]:
    """MLA's kv_b_proj (heads x (nope + v) rows, kv_lora_rank columns) as DeepseekV2Model splits it
    for llama.cpp's absorbed attention: k_b (heads, kv_lora_rank, nope), each head's nope rows
    transposed, and v_b (heads, v, kv_lora_rank)."""
    nope = config.qk_nope_head_dim
    kv = kv_b.reshape(config.num_attention_heads, nope + config.v_head_dim, kv_b.shape[-1])
    return np.ascontiguousarray(kv[:, :nope].swapaxes(1, 2)), np.ascontiguousarray(kv[:, nope:])


def merge_kv_b(k_b: np.ndarray, v_b: np.ndarray) -> np.ndarray:
    """The inverse of split_kv_b."""
    kv = np.concatenate([k_b.swapaxes(1, 2), v_b], axis=1)
    return kv.reshape(-1, kv.shape[-1])


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
