"""What `lora.target_modules: all-linear` wraps on a built model, logged when LoRA is attached.

The decision lives at the root (homelab_ft/rules/lora_targets.py), where plan/ reads it too, so the plan
and the run wrap the same layers.
"""

from __future__ import annotations

import logging
import re

from homelab_ft.rules.lora_targets import (
    ALL_LINEAR,
    for_config,
    linear_forward,
    lora_targets,
    skipped_names,
    wrapped_names,
)

__all__ = ["ALL_LINEAR", "for_config", "linear_forward", "lora_targets", "resolve"]

log = logging.getLogger(__name__)


def resolve(model, target_modules) -> list[str] | str:
    """`lora.target_modules` as PEFT should get it: `all-linear` resolved, a list as given. The log
    names what is wrapped by its full module names, each layer index a `*`: PEFT's suffix list
    itself needs a layer's index where the language model and a vision tower share layer names
    (Idefics3's `text_model.layers.0.self_attn.k_proj` beside its vision encoder's), which says less."""
    if target_modules != ALL_LINEAR:
        return target_modules
    targets = lora_targets(model)
    wrapped = sorted(dict.fromkeys(_pattern(n) for n in wrapped_names(model)))
    skipped = skipped_names(model)
    log.info("lora.target_modules all-linear: %s%s", ", ".join(wrapped) or "nothing",
             f" (not wrapped: {', '.join(_pattern(n) for n in skipped[:4])}{' ...' if len(skipped) > 4 else ''})"
             if skipped else "")
    return targets


def _pattern(name: str) -> str:
    """`name` with its layer indices as `*` (`model.layers.*.self_attn.q_proj`)."""
    return re.sub(r"(?<=\.)\d+(?=\.|$)", "*", name)
