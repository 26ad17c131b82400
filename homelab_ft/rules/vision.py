"""Image-text checkpoints: which class a run builds, and which of its modules are the vision side.

Whether a run trains on images is the recipe's `data.images`, carried by the rung (`Rung.images`):
pricing, building, the data pipeline and export all read it there. `auto_class` is the one rule for
the class a run builds, from transformers' own mappings, never from a family list:

- an image run builds what `AutoModelForImageTextToText` builds (Qwen2-VL, Qwen2.5-VL, Qwen3-VL,
  Idefics3/SmolVLM, Llava, Mistral 3, InternVL, PaliGemma, Gemma 3 ...), vision tower and projector
  included, and reads its rows through the checkpoint's processor (model/processor.py);
- a text run builds what `AutoModelForCausalLM` builds, as before images existed: for Gemma 3,
  Gemma 3n and Gemma 4 that is the image-text class too (its tower loaded, frozen and unused), for
  Qwen 3.5 and Llama 4 the text decoder alone; a checkpoint transformers maps to no causal-LM class
  (Qwen2-VL, Llava ...) is built as its image-text class, its language model trained on text.

The vision side is every child of the base model other than its language model (transformers'
`get_decoder()`): `vision_tower` + `multi_modal_projector` in Gemma 3 and Llava, `visual` in
Qwen2-VL, `vision_model` + `connector` in Idefics3. It is frozen in a full fine-tune unless
`lora.target_modules` names its layers (`freeze`), PEFT freezes it with every base weight,
`all-linear` leaves it out (lora_targets.py), QLoRA keeps it in 16 bits on an image run
(`quant_skip`: bitsandbytes' 4-bit tower is not shown to be safe, the issue asks for it unless shown),
and the planner prices its weights as frozen and measures what an image costs it
(plan/shape/vision.py). The planner's shape is the class the run builds (`auto_class`): an image run's
carries the tower on every image-text checkpoint; a text run's carries it where `image_text_class` is
what a text run loads (Gemma 3, and those with no causal-LM class), and one shape serves both runs.

Torch-free at import, as every rule is.
"""

from __future__ import annotations


def image_text_class(config) -> type | None:
    """transformers' image-text class for `config` where that is the class a text run loads it with
    (`auto_class(images=False)`: the vision tower is built beside the text decoder): the causal-LM
    mapping builds the same class (Gemma 3) or has none for the config (Qwen2-VL, Llava ...). None
    for text models, a config whose causal-LM class is text-only (Qwen 3.5's), remote code."""
    from transformers import AutoModelForCausalLM

    if config is None or getattr(config, "auto_map", None):
        return None
    causal = AutoModelForCausalLM._model_mapping.get(type(config), None)
    image_text = image_text_model_class(config)
    return image_text if causal is None or causal is image_text else None


def image_text_model_class(config) -> type | None:
    """The class `AutoModelForImageTextToText` builds for `config`; None for text models and remote code."""
    from transformers import AutoModelForImageTextToText

    if config is None or getattr(config, "auto_map", None):
        return None
    return AutoModelForImageTextToText._model_mapping.get(type(config), None)


def auto_class(config, *, images: bool):
    """The transformers auto class a run builds `config`'s checkpoint with (module docstring)."""
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    causal = None if getattr(config, "auto_map", None) else AutoModelForCausalLM._model_mapping.get(type(config), None)
    if images or (causal is None and image_text_model_class(config) is not None):
        return AutoModelForImageTextToText
    return AutoModelForCausalLM


def model_class(config, *, images: bool) -> type | None:
    """The class `auto_class` builds for `config` (None for remote code: transformers decides)."""
    from transformers import AutoModelForCausalLM

    if getattr(config, "auto_map", None):
        return None
    causal = AutoModelForCausalLM._model_mapping.get(type(config), None)
    return image_text_model_class(config) if images or causal is None else causal


def images_refusal(config, *, images: bool) -> str | None:
    """`data.images: true` on a checkpoint transformers builds no image-text model for: one line."""
    if not images or image_text_model_class(config) is not None:
        return None
    kind = "remote-code" if getattr(config, "auto_map", None) else "text"
    return (f"data.images: {config.model_type} is a {kind} model (transformers' AutoModelForImageTextToText builds "
            "nothing for it), so it cannot read images; use an image-text checkpoint, or set data.images=false "
            "and give text rows")


def _is_image_text(model) -> bool:
    cls = image_text_model_class(getattr(model, "config", None))
    return cls is not None and isinstance(model, cls)


def vision_prefixes(model) -> tuple[str, ...]:
    """Dotted names of the top modules of the vision side of `model` (loaded, on meta, sharded by FSDP2,
    or wrapped by PEFT, whose prefix the names then carry); () for a text model."""
    inner = getattr(model, "get_base_model", lambda: model)()
    if not _is_image_text(inner):
        return ()
    decoder = inner.get_decoder()
    # the decoder's parent: the base model (Qwen2-VL's model.language_model) or, where the class is its
    # own base model, the class itself (Llama 4: language_model, a causal LM with its head, beside vision_model)
    parent = next((m for m in (inner.base_model, inner) if any(c is decoder for c in m.children())), None)
    if parent is None:
        return ()
    parent_name = next(name for name, module in model.named_modules() if module is parent)
    head = inner.get_output_embeddings()
    return tuple(f"{parent_name}.{name}" if parent_name else name
                 for name, child in parent.named_children() if child is not decoder and child is not head)


def is_vision_module(name: str, prefixes: tuple[str, ...]) -> bool:
    """Whether module (or parameter) `name` lies on the vision side named by `prefixes`."""
    return any(name == p or name.startswith(p + ".") for p in prefixes)


def vision_param_count(model) -> int:
    """Parameters of `model`'s vision side (0 for a text model)."""
    prefixes = vision_prefixes(model)
    return sum(p.numel() for name, p in model.named_parameters() if is_vision_module(name, prefixes)) if prefixes else 0


def listed(name: str, targets) -> bool:
    """PEFT's rule for a listed target: the module's name is it, or ends with `.` + it."""
    return any(name == t or name.endswith("." + t) for t in targets)


def freeze(model, *, targets: tuple[str, ...] = ()) -> int:
    """requires_grad=False on every vision-side parameter of `model` but those of modules `targets`
    (lora.target_modules as a list) names; how many were frozen. A text fine-tune has no image to
    teach the tower anything, and an image fine-tune trains the language model by default: the
    tower's gradients and optimizer state would cost memory the plan gives the language model."""
    prefixes = vision_prefixes(model)
    kept = {name for name, _ in model.named_modules() if is_vision_module(name, prefixes) and listed(name, targets)}
    frozen = 0
    for name, param in model.named_parameters() if prefixes else ():
        module = name.rpartition(".")[0]
        if is_vision_module(name, prefixes) and not any(module == k or module.startswith(k + ".") for k in kept):
            param.requires_grad_(False)
            frozen += param.numel()
    return frozen


def quant_skip(model) -> list[str]:
    """Module names bitsandbytes must leave unquantized on an image run: the vision side (its own
    names, as `BitsAndBytesConfig.llm_int8_skip_modules` and the meta-built 4-bit base match them)."""
    return list(vision_prefixes(model))
