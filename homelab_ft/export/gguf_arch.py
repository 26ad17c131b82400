"""Which llama.cpp architecture a Hugging Face model is written as, and the weight layouts that
differ from Hugging Face's.

Nothing here lists model types. A model's GGUF architecture is found from transformers and gguf-py:

- the names: the model_type (or its transformers module, `gemma3_text` -> `gemma3`) spelt as one
  of gguf-py's `MODEL_ARCH_NAMES` (`qwen3_moe` -> `qwen3moe`, `qwen3_5` -> `qwen35`); failing
  that, the model its causal-LM class derives from in transformers' own modular source
  (`class Olmo3ForCausalLM(Olmo2ForCausalLM)`, `MistralForCausalLM(LlamaForCausalLM)`), which is
  how llama.cpp's convert_hf_to_gguf.py registers them too (Olmo 3 as `olmo2`, Mistral as `llama`);
- the tensors: every checkpoint tensor must have a place in gguf-py's TensorNameMap for that
  architecture (gguf_export.py), or the family is refused before anything is written;
- Gemma's norm offset: a norm module that computes x * (1 + w) (llama.cpp computes x * w) is found
  by running each norm module of the model with zero weights (`_offset_norms`), so Gemma 1-4 and
  Qwen3-Next are handled with no table.

What cannot be read from either is llama.cpp's graph itself: LAYOUTS holds, per architecture
homelab-ft writes, what convert_hf_to_gguf.py does to the tensors beyond renaming (the q/k row
permutation of the `llama` graphs) and the fixed conventions of llama.cpp's C++ (`smollm3`'s
no-rope layers). An architecture outside LAYOUTS is refused in one line: its conversion has not
been read, and a GGUF with a silently wrong layout is worse than none.
"""

from __future__ import annotations

import ast
import functools
import json
import logging
import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from homelab_ft.errors import UserError

log = logging.getLogger(__name__)


class GgufUnsupported(UserError):
    """A model homelab-ft cannot write as GGUF (the safetensors export is unaffected)."""


@dataclass(frozen=True)
class Layout:
    """What llama.cpp's graph for one architecture expects beyond gguf-py's tensor names."""

    permute_qk: bool = False
    """llama.cpp's `llama`-style graphs rope interleaved pairs (GPT-J style), HF rotates halves:
    convert_hf_to_gguf.py's LlamaModel.permute reorders q/k rows (LlamaModel and its subclasses)."""
    no_rope_step: int | None = None
    """SmolLM3: llama.cpp hardcodes `n_no_rope_layer_step = 4` (no GGUF key), so a layer i has
    no rope when (i + 1) % 4 == 0; a config whose `no_rope_layers` differs is refused."""


LAYOUTS = {
    "llama": Layout(permute_qk=True),
    "smollm3": Layout(permute_qk=True, no_rope_step=4),
    "qwen2": Layout(),
    "qwen3": Layout(),
    "qwen3moe": Layout(),
    "phi3": Layout(),
    "gemma": Layout(),
    "gemma2": Layout(),
    "gemma3": Layout(),
    "olmo2": Layout(),
}
"""gguf architecture name -> its layout, read from convert_hf_to_gguf.py (LlamaModel, SmolLM3Model,
Qwen2Model, Qwen3Model, Qwen3MoeModel, Phi3MiniModel, GemmaModel, Gemma2Model,
Gemma3Model, Olmo2Model). Names, hyperparameters and norm offsets are derived, not listed."""

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
        import gguf

        return next(a for a, n in gguf.MODEL_ARCH_NAMES.items() if n == self.arch_name)

    def to_gguf(self, gguf_name: str, array: np.ndarray, config) -> np.ndarray:
        """A tensor in Hugging Face's layout -> llama.cpp's."""
        array = self._permuted(gguf_name, array, config, forward=True)
        return array + np.float32(1.0) if gguf_name in self.offset_norms else array

    def from_gguf(self, gguf_name: str, array: np.ndarray, config) -> np.ndarray:
        """The inverse of to_gguf (GGUF read back into Hugging Face's layout)."""
        if gguf_name in self.offset_norms:
            array = array - np.float32(1.0)
        return self._permuted(gguf_name, array, config, forward=False)

    def _permuted(self, gguf_name: str, array: np.ndarray, config, *, forward: bool) -> np.ndarray:
        if not self.layout.permute_qk or not gguf_name.endswith(("attn_q.weight", "attn_k.weight")):
            return array
        heads = config.num_attention_heads if gguf_name.endswith("attn_q.weight") else config.num_key_value_heads
        return permute_heads(array, heads) if forward else unpermute_heads(array, heads)


def check_architecture(model_dir: Path) -> Target:
    """How `model_dir` is written as GGUF, refused in one line (GgufUnsupported) when it cannot be."""
    model_dir = Path(model_dir)
    config = json.loads((model_dir / "config.json").read_text())
    model_type = config.get("model_type")
    where = f"{model_dir}/config.json"
    names = arch_candidates(model_type) if model_type else []
    arch_name = names[0] if names else None
    if arch_name not in LAYOUTS:
        known = f"llama.cpp runs it as {arch_name!r} but homelab-ft has not read that conversion" if names else \
            "llama.cpp's gguf-py declares no architecture for it"
        raise GgufUnsupported(f"{where}: model_type {model_type!r} cannot be written as GGUF by homelab-ft ({known})")
    rope = rope_parameters(config)
    if rope.get("rope_type", "default") not in ROPE_TYPES:
        raise GgufUnsupported(f"{where}: rope type {rope.get('rope_type')!r} cannot be written as GGUF by homelab-ft")
    layout = LAYOUTS[arch_name]
    _check_no_rope(config, layout, where=where)
    return Target(model_type=model_type, arch_name=arch_name, layout=layout,
                  offset_norms=_offset_norms(model_dir, arch_name))


def _check_no_rope(config: dict, layout: Layout, *, where: str) -> None:
    pattern = config.get("no_rope_layers")
    if layout.no_rope_step is None or pattern is None:
        return
    llama_cpp = [int((i + 1) % layout.no_rope_step != 0) for i in range(config["num_hidden_layers"])]
    if list(pattern) != llama_cpp:
        raise GgufUnsupported(f"{where}: no_rope_layers {pattern} differs from llama.cpp's fixed pattern (no rope on "
                              f"every {layout.no_rope_step}th layer), so llama.cpp would run another model")


# ------------------------------------------------------------------------------- derivation


def arch_candidates(model_type: str) -> list[str]:
    """gguf architecture names for `model_type`, most specific first: its own name, then those of the
    models its causal-LM class derives from in transformers' modular source. The first is the one
    llama.cpp runs it as: a family gguf-py names is never written as its parent's architecture."""
    import gguf

    known = set(gguf.MODEL_ARCH_NAMES.values())
    out = []
    for name in _lineage(model_type):
        for spelt in (name, name.replace("_", ""), name.replace("_", "-"), re.sub(r"_v(\d)", r"\1", name)):
            if spelt in known and spelt not in out:
                out.append(spelt)
    return out


@functools.cache
def _lineage(model_type: str) -> tuple[str, ...]:
    """`model_type`, its transformers module, and the modules its causal-LM class derives from
    (`olmo3` -> olmo3, olmo2; `mixtral` -> mixtral, mistral, llama), read from modular_*.py."""
    from transformers import CONFIG_MAPPING
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    if model_type not in CONFIG_MAPPING:
        return (model_type,)
    module = CONFIG_MAPPING[model_type].__module__.split(".")[-2]
    names = [model_type, module]
    cls = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(model_type)
    while cls:
        parent = _modular_parent(module, cls)
        if parent is None:
            break
        module, cls = parent
        names.append(module)
    return tuple(dict.fromkeys(names))


def _modular_parent(module: str, cls: str) -> tuple[str, str] | None:
    """(module, class) that `cls` subclasses in transformers/models/<module>/modular_<module>.py."""
    import importlib.util

    spec = importlib.util.find_spec(f"transformers.models.{module}")
    if spec is None or not spec.submodule_search_locations:
        return None
    source = Path(next(iter(spec.submodule_search_locations))) / f"modular_{module}.py"
    if not source.is_file():
        return None
    tree = ast.parse(source.read_text())
    imported = {alias.asname or alias.name: node.module.split(".")[0] for node in tree.body
                if isinstance(node, ast.ImportFrom) and node.level == 2 and node.module for alias in node.names}
    for node in tree.body:
        if isinstance(node, ast.ClassDef) and node.name == cls:
            for base in node.bases:
                if isinstance(base, ast.Name) and base.id in imported and base.id.endswith("ForCausalLM"):
                    return imported[base.id], base.id
    return None


def _offset_norms(model_dir: Path, arch_name: str) -> frozenset[str]:
    """GGUF names of the norm weights whose module computes x * (1 + w): each norm-like module (a
    1-D weight and no other matrix) of the model, built on the meta device, is copied to the CPU
    with zero parameters and run on random input; a non-zero output means the offset."""
    import copy

    import gguf
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(model_dir)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    arch = next(a for a, n in gguf.MODEL_ARCH_NAMES.items() if n == arch_name)
    name_map = gguf.get_tensor_name_map(arch, config.num_hidden_layers)
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
