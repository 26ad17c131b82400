"""Which loaded models carry a vision tower, and which of their modules are the vision side.

transformers' causal-LM mapping builds some multimodal checkpoints as their image-text class:
`AutoModelForCausalLM` on a Gemma 3, Gemma 3n or Gemma 4 checkpoint is `*ForConditionalGeneration`,
vision tower and projector included (Qwen 3.5's entry is its text-only `Qwen3_5ForCausalLM`, which
loads the text decoder alone). Others have no causal-LM class at all (Qwen2-VL, Qwen2.5-VL,
Qwen3-VL, SmolVLM, Llava, Mistral 3, InternVL, PaliGemma): `AutoModelForImageTextToText` is the one
class that builds the checkpoint whole. Both are recognised from transformers' own mappings, never
from a family list: the class that loads the checkpoint is the one `AutoModelForImageTextToText`
builds, where the causal-LM mapping has that class or none.

The vision side is every child of the base model other than its language model (transformers'
`get_decoder()`): `vision_tower` + `multi_modal_projector` in Gemma 3, whatever a family names them.
A text fine-tune trains the language model: the vision side is frozen (`freeze`, for a full
fine-tune; PEFT freezes it with every base weight), `all-linear` leaves it out (lora_targets.py), and
the planner prices its weights as frozen and measures what an image costs it (plan/shape/vision.py).

Torch-free at import, as every rule is.
"""

from __future__ import annotations


def image_text_class(config) -> type | None:
    """transformers' image-text class for `config` where that is the class that loads it (a vision
    tower is loaded with the text decoder): the causal-LM mapping builds the same class (Gemma 3) or
    has none for the config (Qwen2-VL, Llava ...). None for text models, a config whose causal-LM
    class is text-only (Qwen 3.5's), remote code."""
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    if config is None or getattr(config, "auto_map", None):
        return None
    image_text = AutoModelForImageTextToText._model_mapping.get(type(config), None)
    causal = AutoModelForCausalLM._model_mapping.get(type(config), None)
    return image_text if causal is None or causal is image_text else None


def vision_prefixes(model) -> tuple[str, ...]:
    """Dotted names of the top modules of the vision side of `model` (loaded, on meta, or wrapped by
    PEFT, whose prefix the names then carry); () for a text model."""
    inner = getattr(model, "get_base_model", lambda: model)()
    if image_text_class(getattr(inner, "config", None)) is None:
        return ()
    decoder, base = inner.get_decoder(), inner.base_model
    if base is inner or decoder is base:
        return ()
    base_name = next(name for name, module in model.named_modules() if module is base)
    return tuple(f"{base_name}.{name}" if base_name else name
                 for name, child in base.named_children() if child is not decoder)


def is_vision_module(name: str, prefixes: tuple[str, ...]) -> bool:
    """Whether module (or parameter) `name` lies on the vision side named by `prefixes`."""
    return any(name == p or name.startswith(p + ".") for p in prefixes)


def vision_param_count(model) -> int:
    """Parameters of `model`'s vision side (0 for a text model)."""
    prefixes = vision_prefixes(model)
    return sum(p.numel() for name, p in model.named_parameters() if is_vision_module(name, prefixes)) if prefixes else 0


def freeze(model) -> int:
    """requires_grad=False on every vision-side parameter of `model`; how many were frozen. A text
    fine-tune has no image to teach the tower anything, and its gradients and optimizer state would
    cost memory the plan gives the language model."""
    prefixes = vision_prefixes(model)
    frozen = 0
    for name, param in model.named_parameters() if prefixes else ():
        if is_vision_module(name, prefixes):
            param.requires_grad_(False)
            frozen += param.numel()
    return frozen
