"""What `lora.target_modules: all-linear` wraps: PEFT's own all-linear set, less what PEFT cannot wrap.

One decision for the loader (model/targets.resolve hands it to PEFT) and the planner (plan/shape/derive.py
marks the linears it prices, so `plan` says what training wraps); torch and PEFT are imported
inside the functions, so the root stays torch-free at import.

PEFT resolves `all-linear` to every `nn.Linear` (and transformers `Conv1D`) but the output head
(peft tuners_utils `_maybe_include_all_linear_layers`). Two kinds of module in that set break it,
both found from the model's own classes, never from a list of families:

- a subclass of `nn.Linear` with a forward of its own: Llama 4's and Phi-MoE's routers return
  (scores, indices), and PEFT's LoRA wrapper adds its update to that tuple (issue 20: "'tuple'
  object has no attribute 'dtype'" inside PEFT);
- a linear layer whose owner reads its weight instead of calling it: the Mamba mixers of Falcon-H1,
  Nemotron-H and Granite 4 hand `out_proj.weight` to the fused `mamba_split_conv1d_scan_combined`
  kernel, which never runs the adapter (PEFT refuses `out_proj` for the Mamba types it knows; on
  Granite 4 it wraps it, and the adapter is skipped on the GPU path without a word).

A model loaded with a vision tower (Gemma 3's causal-LM class is its image-text one, vision.py) has
its vision tower and projector left out too: a text fine-tune trains the language model, unless
`lora.target_modules` names vision layers.

The rest is handed to PEFT as the shortest module-name suffixes that match exactly that set.
"""

from __future__ import annotations

import functools
import inspect
import re

ALL_LINEAR = "all-linear"


def wrapped_names(model) -> list[str]:
    """The full module names `all-linear` wraps on `model` (a meta skeleton or a loaded model, 4-bit
    layers included), none on a vision side (vision.py)."""
    from homelab_ft.rules import vision

    prefixes = vision.vision_prefixes(model)
    return [name for name, module in _candidates(model)
            if _wrappable(model, name, module) and not vision.is_vision_module(name, prefixes)]


def skipped_names(model) -> list[str]:
    """PEFT's all-linear layers left out: routers and Mamba projections a fused kernel reads."""
    return sorted(name for name, module in _candidates(model) if not _wrappable(model, name, module))


def lora_targets(model) -> list[str]:
    """The `target_modules` list `all-linear` means for `model`: module-name suffixes, as PEFT
    matches them, sorted."""
    return _suffixes(model, wrapped_names(model))


def for_config(config) -> list[str]:
    """`lora_targets` of `config`'s architecture, built on the meta device (no weights, ~1 s for an
    8B config)."""
    import torch
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        return lora_targets(AutoModelForCausalLM.from_config(config))


def _candidates(model) -> list:
    """PEFT's own `all-linear` set (its resolution function, so this follows PEFT's releases)."""
    from peft import LoraConfig
    from peft.tuners.tuners_utils import _maybe_include_all_linear_layers

    config = _maybe_include_all_linear_layers(LoraConfig(target_modules=ALL_LINEAR, task_type="CAUSAL_LM"), model)
    names = set(config.target_modules)
    return [(name, module) for name, module in model.named_modules() if name in names]


def _wrappable(model, name: str, module) -> bool:
    return linear_forward(type(module)) and not _weight_read_by_owner(model, name)


def linear_forward(cls: type) -> bool:
    """Whether calling the layer is a linear map returning one tensor: its forward is not one a model
    defines (transformers.models.*: Llama 4's router is an nn.Linear whose forward returns a tuple),
    but nn.Linear's, Conv1D's, or a quantized linear layer's (bitsandbytes', or sharded_qlora's
    subclass of it), which PEFT dispatches."""
    owner = next(c for c in cls.__mro__ if "forward" in vars(c))
    return not owner.__module__.startswith("transformers.models.")


def _weight_read_by_owner(model, name: str) -> bool:
    """Whether the module owning `name` uses `self.<leaf>.weight` as a value in its code (a fused
    kernel's argument), so an adapter on the layer would not run on that path; reading only the
    weight's dtype, device or shape does not count."""
    owner_name, _, leaf = name.rpartition(".")
    owner = model.get_submodule(owner_name) if owner_name else model
    return bool(re.search(rf"self\.{re.escape(leaf)}\.weight\b(?!\.(dtype|device|shape))", _source(type(owner))))


@functools.cache
def _source(cls: type) -> str:
    try:
        return inspect.getsource(cls)
    except (OSError, TypeError):  # built in, or defined where no source is kept
        return ""


def _suffixes(model, chosen: list[str]) -> list[str]:
    """The shortest dotted suffix of each chosen name that matches (PEFT: equal, or ends with `.suffix`)
    only chosen modules, so `q_proj` stays `q_proj` and Granite 4's `mamba.in_proj` beside an
    excluded `mamba.out_proj` needs no layer index."""
    keep = set(chosen)
    names = [name for name, _ in model.named_modules() if name]
    out: set[str] = set()
    for name in chosen:
        parts = name.split(".")
        for k in range(1, len(parts) + 1):
            suffix = ".".join(parts[-k:])
            if all(n in keep for n in names if n == suffix or n.endswith("." + suffix)):
                out.add(suffix)
                break
    return sorted(out)

