"""The model's shape read from the model transformers builds: no per-family formulas.

transformers builds the causal LM from its config on the meta device (tensors with shapes and no
storage: an 8B or 70B model in well under a second and no memory), and the module tree says what
the planner needs (shapes.ModelShape): the decoder blocks (the `_no_split_modules` classes, as
model.blocks finds them for FSDP), grouped into kinds of equal parameters (full and sliding or
linear attention, dense and MoE layers); each block's `nn.Linear` layers (what bitsandbytes
quantizes) and which of them PEFT's own `all-linear` resolution wraps; its 3-D expert tensors; the
embeddings (with per-layer tables), the head and whether it is tied. The activation bytes a block
keeps for backward are measured, not modelled: saved.measure_saved runs a forward and counts
what autograd saves.

Torch and transformers are imported inside the functions: a shape derived once is cached
(shape_cache.py) and planning it again imports neither.
"""

from __future__ import annotations

import copy
import logging

from homelab_ft.errors import UserError
from homelab_ft.locate import config_refusal
from homelab_ft.plan.shape.types import BlockShape, Linear, ModelShape
from homelab_ft.rules.decoder_blocks import decoder_blocks as shared_decoder_blocks
from homelab_ft.rules.moe_marks import is_fused_experts, projections
from homelab_ft.rules.moe_routers import router_parameters

log = logging.getLogger(__name__)

TOP_K_KEYS = ("num_experts_per_tok", "moe_topk", "top_k", "num_experts_per_token")
"""Config keys transformers' MoE configs name the experts one token is routed to by."""


def derive_shape(config: dict, *, attn_implementation: str = "sdpa", model_path: str | None = None,
                 trust_remote_code: bool = False, images: bool = False) -> ModelShape:
    """The shape of the model `config` loads as for a text run, or an image run (`images`: data.images,
    Rung.images): the class rules/vision.auto_class builds. A causal LM; the text decoder alone of a
    multimodal config whose causal-LM class is text-only, on a text run; an image-text model, whose
    language model's blocks are sized as a causal LM's and whose vision side is measured on images
    (vision.measure_vision)."""
    import torch

    from homelab_ft.plan.shape.saved import measure_saved
    from homelab_ft.plan.shape.vision import measure_vision
    from homelab_ft.rules import vision

    hf_config, notes = loaded_config(config, model_path=model_path, trust_remote_code=trust_remote_code, images=images)
    images = images and vision.image_text_model_class(hf_config) is not None
    text = hf_config.get_text_config(decoder=True)
    # `auto` (the default): sdpa where the class supports it, else eager, as model/family.py loads it.
    auto = attn_implementation == "auto"
    attn_implementation = "sdpa" if auto else attn_implementation
    model, used = _build_supported(hf_config, attn_implementation, trust_remote_code=trust_remote_code, images=images)
    if used != attn_implementation and not auto:
        notes += (f"{text.model_type} does not support attn_implementation={attn_implementation} in transformers; "
                  f"its activations are priced for {used}",)
    attn_implementation = used
    blocks = decoder_blocks(model)
    kinds = _group(blocks, text)

    def build(dtype):
        fresh = build_on_meta(copy.deepcopy(hf_config), attn_implementation=attn_implementation, trust_remote_code=trust_remote_code,
                              dtype=dtype, images=images)
        return fresh, decoder_blocks(fresh)

    measured = measure_saved(build, [index for index, _ in kinds])
    shapes = tuple(_block_shape(model, blocks[first], first, count, text, measured[first])
                   for first, count in ((first, len(members)) for first, members in kinds))
    prefixes = vision.vision_prefixes(model)
    language = {id(p): p for name, p in model.named_parameters() if not vision.is_vision_module(name, prefixes)}
    embed, head = model.get_input_embeddings(), model.get_output_embeddings()
    tied = head is not None and head.weight is embed.weight
    in_blocks = {id(p) for b in blocks for p in b.parameters()}
    outside = {i: p for i, p in language.items() if i not in in_blocks}
    tables = {id(m.weight) for m in model.modules() if isinstance(m, torch.nn.Embedding)} & set(outside)
    embedding = sum(outside[i].numel() for i in tables)
    lm_head = 0 if tied or head is None else head.weight.numel()
    rest = sum(p.numel() for i, p in outside.items() if i not in tables) - lm_head
    sight = measure_vision(lambda dtype: build(dtype)[0], model_path=model_path) if prefixes else None
    if sight is not None:
        notes += (_image_text_note(hf_config, sight),)
    return ModelShape(
        model_type=text.model_type, vocab_size=embed.weight.shape[0], hidden_size=embed.weight.shape[1],
        num_layers=len(blocks), max_position_embeddings=_max_positions(text),
        tie_word_embeddings=tied, blocks=shapes, logit_softcapping=bool(getattr(text, "final_logit_softcapping", None)),
        notes=notes, embedding_params=embedding, lm_head_params=lm_head, other_root_params=rest,
        largest_param=max(p.numel() for p in language.values()),
        attn_implementation=attn_implementation,
        embedding_name=next(name for name, module in model.named_modules() if module is embed),
        kv_elements_per_token=kv_elements_per_token(text, num_layers=len(blocks)),
        vision=sight,
    )


def loaded_config(config: dict, *, model_path: str | None, trust_remote_code: bool, images: bool = False):
    """transformers' config object of the model `config` loads as (rules/vision.py: an image-text
    checkpoint whole; a multimodal one whose causal-LM class is text-only, its text decoder's on a text
    run and whole on an image run), with the note the plan repeats for the text decoder alone."""
    import transformers

    from homelab_ft.rules import vision

    model_type = config.get("model_type")
    remote = bool(trust_remote_code and model_path)
    if not remote and model_type not in transformers.CONFIG_MAPPING:
        raise UserError(
            f"config.json: model_type {model_type!r} is unknown to the installed transformers "
            f"{transformers.__version__}: upgrade it (pip install -U transformers), or for a model that ships its "
            f"own modeling code set model.trust_remote_code=true")
    try:
        if remote:
            hf_config = transformers.AutoConfig.from_pretrained(model_path, trust_remote_code=trust_remote_code)
        else:
            config_class = transformers.CONFIG_MAPPING[model_type]
            # config.json stores inf/nan as {"__float__": "Infinity"}; from_pretrained decodes them this way
            hf_config = config_class.from_dict(config_class._decode_special_floats(config))
    except Exception as err:  # noqa: BLE001 - a config transformers refuses; anything else re-raised
        refusal = config_refusal(err, model_path or "config.json")
        if refusal is None:
            raise
        raise refusal from None
    text = hf_config.get_text_config(decoder=True)
    if text is hf_config or vision.image_text_class(hf_config) is not None:
        return hf_config, ()
    if images and vision.image_text_model_class(hf_config) is not None:
        return hf_config, ()
    return text, (f"{model_type}: multimodal checkpoint; a text run builds, counts and trains only its text decoder "
                  f"({text.model_type}), not its vision/audio towers (data.images: true builds its image-text class)",)


def text_run_loads_tower(config: dict, *, model_path: str | None, trust_remote_code: bool) -> bool:
    """A text run of `config` builds its image-text class, the model an image run builds
    (rules/vision.image_text_class: Gemma 3, and the checkpoints with no causal-LM class)."""
    from homelab_ft.rules import vision

    hf_config, _ = loaded_config(config, model_path=model_path, trust_remote_code=trust_remote_code)
    return vision.image_text_class(hf_config) is not None


def image_tokens_at(config: dict, *, sizes: tuple[tuple[int, int], ...], model_path: str | None = None,
                    trust_remote_code: bool = False, max_pixels: int | None = None,
                    min_pixels: int | None = None) -> tuple[int, ...]:
    """Image tokens the vision side of the image-text model `config` loads as returns for one blank
    image of each (height, width) of `sizes`, prepared by its own image processor (vision.py) called
    as the data side calls it: with the recipe's `max_pixels` / `min_pixels` where it takes pixel
    bounds (rules/image_area.processor_kwargs: they replace its own, raising or lowering its cap)."""
    from homelab_ft.plan.shape import vision
    from homelab_ft.rules.image_area import processor_kwargs

    hf_config, _ = loaded_config(config, model_path=model_path, trust_remote_code=trust_remote_code, images=True)
    model = build_on_meta(hf_config, attn_implementation="sdpa", trust_remote_code=trust_remote_code, images=True)
    processor = vision.image_processor(model.config, model_path=model_path)
    bounds = processor_kwargs(processor, max_pixels=max_pixels, min_pixels=min_pixels)
    return tuple(vision.image_tokens(model, vision.vision_inputs(model, processor, height=h, width=w, bounds=bounds))
                 for h, w in sizes)


def _image_text_note(hf_config, sight) -> str:
    text = hf_config.get_text_config(decoder=True)
    priced = ("only as weights: what an image costs it could not be measured, " + sight.unmeasured if sight.unmeasured
              else "as weights, and on an image run per image in the `images` line")
    return (f"{hf_config.model_type}: image-text checkpoint, loaded with its vision tower and projector "
            f"({sight.params / 1e9:.2f}B parameters, frozen, priced {priced}); its language model ({text.model_type}) "
            f"is trained")


def _build_supported(hf_config, attn_implementation: str, *, trust_remote_code: bool, images: bool):
    """The meta model with the requested attention, or with eager attention where transformers
    refuses it for the architecture (Gemma 2 has no SDPA path: it soft-caps the scores)."""
    try:
        return build_on_meta(hf_config, attn_implementation=attn_implementation,
                             trust_remote_code=trust_remote_code, images=images), attn_implementation
    except ValueError as err:
        if attn_implementation == "eager" or "attention implementation" not in str(err):
            raise
        return build_on_meta(hf_config, attn_implementation="eager", trust_remote_code=trust_remote_code,
                             images=images), "eager"


def build_on_meta(hf_config, *, attn_implementation: str, trust_remote_code: bool = False, dtype=None,
                  images: bool = False):
    """The model a run of `images` (data.images) loads the config as, on the meta device: shapes only,
    no memory. That is the class of rules/vision.auto_class, the one the trainer builds:
    AutoModelForCausalLM's, or AutoModelForImageTextToText's for an image run or an image-text
    checkpoint with no causal-LM class.

    flash_attention_2 needs the flash-attn package to build; it keeps for backward what SDPA's
    flash kernel keeps (q, k, v, out, log-sum-exp), so the model is built with `sdpa` for it."""
    import torch

    from homelab_ft.rules import vision

    impl = "sdpa" if attn_implementation == "flash_attention_2" else attn_implementation
    auto = vision.auto_class(hf_config, images=images and vision.image_text_model_class(hf_config) is not None)
    with torch.device("meta"):
        try:
            return auto.from_config(hf_config, attn_implementation=impl, dtype=dtype, trust_remote_code=trust_remote_code)
        except ValueError as err:
            if "does not recognize this architecture" in str(err) or "Unrecognized configuration" in str(err):
                raise UserError(f"config.json: transformers cannot build a causal LM for model_type "
                                f"{hf_config.model_type!r}: {err}") from err
            raise


def decoder_blocks(model) -> list:
    """The blocks the planner sizes: homelab_ft/rules/decoder_blocks.py's rule, which the trainer shares,
    over the language model (an image-text model's vision blocks are its vision side's: vision.py)."""
    from homelab_ft.rules import vision

    found = shared_decoder_blocks(model.get_decoder() if vision.vision_prefixes(model) else model)
    if not found:
        raise UserError(f"{type(model).__name__} declares no `_no_split_modules`: its decoder blocks are unknown, so "
                        f"the planner cannot size it")
    return found


def _group(blocks: list, hf_config) -> list[tuple[int, list[int]]]:
    """Blocks of equal parameters (names and shapes) and equal layer type, as (first index, members)."""
    layer_types = list(getattr(hf_config, "layer_types", None) or [])
    groups: dict[tuple, list[int]] = {}
    for index, block in enumerate(blocks):
        params = tuple((n, tuple(p.shape)) for n, p in block.named_parameters())
        layer_type = layer_types[index] if index < len(layer_types) else None
        groups.setdefault((type(block).__name__, layer_type, params), []).append(index)
    return [(members[0], members) for members in groups.values()]


def _block_shape(model, block, first: int, count: int, hf_config, saved: dict) -> BlockShape:
    import torch

    wrapped = _all_linear_names(model)
    prefix = next(n for n, m in model.named_modules() if m is block)
    linears, in_linear = [], set()
    for name, module in block.named_modules():
        if isinstance(module, torch.nn.Linear):
            linears.append(Linear(name, module.in_features, module.out_features, module.bias is not None,
                                  all_linear=f"{prefix}.{name}" in wrapped))
            in_linear.update(id(p) for p in module.parameters())
    expert_params = active = 0
    in_experts: set[int] = set()
    stacks, stack_names = [], []
    for module_name, module in block.named_modules():
        if isinstance(module, torch.nn.modules.conv._ConvNd):
            continue  # a Mamba / linear-attention conv1d weight is 3-D too, and no expert
        stacked = [p for p in module.parameters(recurse=False) if p.dim() == 3]
        if not stacked:
            continue
        own = [p for p in module.parameters(recurse=False) if id(p) not in in_linear]
        experts = stacked[0].shape[0]
        numel = sum(p.numel() for p in own)
        expert_params += numel
        active += numel * min(experts, _top_k(module, hf_config, experts)) // experts
        in_experts.update(id(p) for p in own)
        found = _stacks(module)
        stacks += found
        stack_names += [f"{module_name}.{p}" for p in projections(module)] if found else []
    other = sum(p.numel() for p in block.parameters() if id(p) not in in_linear and id(p) not in in_experts)
    routers = sum(p.numel() for p in router_parameters(block).values())
    return BlockShape(num_blocks=count, linears=tuple(linears), other_params=other, expert_params=expert_params,
                      active_expert_params=active, expert_stacks=tuple(stacks), expert_names=tuple(stack_names),
                      router_params=routers, kind=type(block).__name__, first_layer=first, **saved)


def _stacks(module) -> list[tuple[int, int, int]]:
    """(experts, in, out) of each projection of a fused-experts module, as model/moe_experts.py reads
    them (transformers' marks `has_gate`, `is_transposed`); [] for any other 3-D parameter."""
    if not is_fused_experts(module):
        return []
    out = []
    for name in projections(module):
        experts, rows, cols = getattr(module, name).shape
        out.append((experts, rows, cols) if module.is_transposed else (experts, cols, rows))
    return out


def _top_k(module, hf_config, experts: int) -> int:
    for key in TOP_K_KEYS:
        value = getattr(module, key, None) or getattr(hf_config, key, None)
        if isinstance(value, int) and value > 0:
            return value
    log.warning("%s: no top-k key (%s) in the config; counting every expert as active", type(module).__name__,
                ", ".join(TOP_K_KEYS))
    return experts


def _all_linear_names(model) -> set[str]:
    """The module names `all-linear` LoRA wraps on this model: PEFT's own resolution less routers and
    kernel-read Mamba projections, decided by lora_targets.wrapped_names, the rule the loader hands
    to PEFT, so the planner prices (and `plan` names) exactly what training wraps."""
    from homelab_ft.rules.lora_targets import wrapped_names

    return set(wrapped_names(model))


def kv_elements_per_token(text, *, num_layers: int) -> int:
    """Elements per token of the KV cache `generate` fills (transformers' DynamicCache: a key and a
    value of num_key_value_heads x head_dim per attention layer, read from each layer's own config on
    a heterogeneous one, Gemma 4's), summed over the layers that cache them: each attention entry of
    `layer_types` (linear-attention and Mamba layers keep a state of fixed size instead, left out),
    every block without `layer_types`, less the last `num_kv_shared_layers` (Gemma 3n, Gemma 4: they
    reuse an earlier layer's cache). Sliding-window layers are counted at full length, an upper bound
    (their cache stops growing at the window)."""
    layer_types = getattr(text, "layer_types", None) or ()
    shared = getattr(text, "num_kv_shared_layers", None) or 0
    total = 0
    for index in range(num_layers - shared):
        kind = layer_types[index] if index < len(layer_types) else "full_attention"
        if "attention" not in kind or "linear" in kind:
            continue
        layer = text.per_layer_config[index] if getattr(text, "is_heterogeneous", False) else text
        heads = getattr(layer, "num_attention_heads", None)
        if not heads:
            return 0
        kv_heads = getattr(layer, "num_key_value_heads", None) or heads
        total += 2 * kv_heads * (getattr(layer, "head_dim", None) or layer.hidden_size // heads)
    return total


def _max_positions(text) -> int:
    return int(getattr(text, "max_position_embeddings", None) or 0) or 1 << 30
