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

What cannot be read from either is llama.cpp's graph itself: LAYOUTS (gguf_layouts.py) holds, per
architecture homelab-ft writes, what convert_hf_to_gguf.py does to the tensors beyond renaming (the q/k row
permutation of the `llama` graphs; the tensors it splits, transposes, reorders or scales, as
gguf_reshape.py rules: gpt-oss's experts, MLA's kv_b, Qwen 3.5's value heads, Granite's fused
gate/up, Falcon-H1's multipliers) and the settings llama.cpp's C++ fixes per architecture with
no GGUF key (`smollm3`'s no-rope layers, Gemma 2's sliding pattern, Qwen3-MoE's weight
normalisation, DeepSeek-V3's interleaved rope, gpt-oss's swiglu constants). An architecture
outside LAYOUTS is refused in one line: its conversion has not been read, and a GGUF with a
silently wrong layout is worse than none; so is one whose conversion was read but whose llama.cpp
graph computes another model for every checkpoint (GRAPH_DIFFERS: PhiMoE), with the reason; an
architecture the converter writes as another for some configs is that one for them (VARIANTS:
Nemotron-H with MoE blocks as `nemotron_h_moe`). A
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
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from homelab_ft.errors import UserError
from homelab_ft.export.gguf.layouts import GRAPH_DIFFERS, LAYOUTS, ROPE_TYPES, VARIANTS, Layout
from homelab_ft.export.gguf.reshape import SELECTION_BIAS, Reshaped

log = logging.getLogger(__name__)


class GgufUnsupported(UserError):
    """A model homelab-ft cannot write as GGUF (the safetensors export is unaffected)."""


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
    if arch_name in VARIANTS and VARIANTS[arch_name][1](config):
        arch_name = VARIANTS[arch_name][0]
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
