"""Tiny random image-text models of several transformers families, with an image processor that
agrees with them, for the planner's tests (plan/shape/vision.py, the image-token counts, the
measured peaks).

The text decoder is families.tiny_config's; the vision config keeps its family's patch size and
merge and has its widths and depth shrunk through keys transformers declares (`hidden_size`,
`embed_dim`, `depth` ...). What cannot be read off a config is the image geometry an image
processor must agree with (the tower's `image_size`, SmolVLM's tile, Gemma 3's pooled tokens per
image): `GEOMETRY` names it per family, with the image processor's own keys.
"""

from __future__ import annotations

from pathlib import Path

from families import tiny_config

_VISION_SIZES = {"hidden_size": 32, "embed_dim": 32, "intermediate_size": 64, "num_hidden_layers": 3, "depth": 3,
                 "num_attention_heads": 2, "num_heads": 2, "head_dim": 16}
"""Vision-config size keys and their tiny values, applied where the config has the key."""

IMAGE_TOKEN = 300
"""The image placeholder token id of every tiny model (inside families' 320-token vocabulary)."""

GEOMETRY = {
    # model_type: (vision config keys, top config keys, image processor kwargs)
    "qwen2_vl": ({}, {}, {}),
    "qwen2_5_vl": ({"fullatt_block_indexes": [2], "window_size": 56}, {}, {}),
    "qwen3_vl": ({"deepstack_visual_indexes": [1], "num_position_embeddings": 64}, {}, {"patch_size": 16}),
    "gemma3": ({"image_size": 56, "patch_size": 14}, {"mm_tokens_per_image": 4},
               {"size": {"height": 56, "width": 56}}),
    "smolvlm": ({"image_size": 64, "patch_size": 16}, {"scale_factor": 2},
                {"size": {"longest_edge": 192}, "max_image_size": {"longest_edge": 64}}),
    "llava": ({"image_size": 28, "patch_size": 14}, {"image_seq_length": 4},
              {"size": {"shortest_edge": 28}, "crop_size": {"height": 28, "width": 28}}),
    "mistral3": ({"image_size": 448, "patch_size": 14}, {},
                 {"size": {"longest_edge": 448}, "patch_size": 14}),
    "internvl": ({"image_size": [56, 56], "patch_size": [14, 14]}, {"image_seq_length": 4},
                 {"size": {"height": 56, "width": 56}, "crop_to_patches": False}),
    "paligemma": ({"image_size": 28, "patch_size": 14}, {}, {"size": {"height": 28, "width": 28}}),
}
VISION_FAMILIES = tuple(GEOMETRY)

_TOKEN_KEYS = ("image_token_id", "image_token_index")
_OTHER_TOKEN_KEYS = ("boi_token_index", "eoi_token_index", "vision_start_token_id", "vision_end_token_id",
                     "video_token_id")


def tiny_vision_config(model_type: str, *, text_sizes: dict | None = None, vision_sizes: dict | None = None):
    """The family's default image-text config with a tiny text decoder and vision tower that agree
    with `image_processor(model_type)`; `text_sizes` / `vision_sizes` override size keys where the
    family's configs have them (a larger model for a memory measurement)."""
    config = tiny_config(model_type)
    text = config.get_text_config(decoder=True)
    for key, value in (text_sizes or {}).items():
        if getattr(text, key, None) is not None:
            setattr(text, key, value)
    vision = config.vision_config
    present = vision.to_dict()
    for key, value in {**_VISION_SIZES, **(vision_sizes or {})}.items():
        if present.get(key) is not None:
            setattr(vision, key, value)
    vision_keys, top_keys, _ = GEOMETRY[model_type]
    for key, value in vision_keys.items():
        setattr(vision, key, value)
    if present.get("out_hidden_size") is not None:  # the merger's output: the text decoder's width
        vision.out_hidden_size = text.hidden_size
    if present.get("embed_dim") is not None:  # Qwen2-VL: `hidden_size` is the merger's output width
        vision.hidden_size = text.hidden_size
    top = config.to_dict()
    if top.get("projection_dim") is not None:  # PaliGemma projects into the text decoder's width
        config.projection_dim = vision.projection_dim = text.hidden_size
        config.hidden_size = text.hidden_size
    for key, value in top_keys.items():
        setattr(config, key, value)
    for key in _TOKEN_KEYS:
        if top.get(key) is not None:
            setattr(config, key, IMAGE_TOKEN)
    for offset, key in enumerate(_OTHER_TOKEN_KEYS, start=1):
        if top.get(key) is not None:
            setattr(config, key, IMAGE_TOKEN + offset)
    _fit_mrope(text)
    return config


def _fit_mrope(text) -> None:
    """Qwen2-VL-style multimodal RoPE splits head_dim / 2 rotary frequencies into (time, height,
    width) sections (a config that declares `mrope_section` among its rope keys); the modeling
    code's default [16, 24, 24] assumes head_dim 128, so the tiny head_dim gets the same split
    scaled down."""
    rope = getattr(text, "rope_parameters", None)
    declared = "mrope_section" in (getattr(type(text), "ignore_keys_at_rope_validation", None) or ())
    if rope is None or not (declared or rope.get("mrope_section")):
        return
    sections = rope.get("mrope_section") or [16, 24, 24]
    half = (getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads) // 2
    scaled = [max(1, s * half // sum(sections)) for s in sections]
    scaled[0] += half - sum(scaled)
    rope["mrope_section"] = scaled


def image_processor(model_type: str):
    """The family's PIL image processor (torchvision is not installed) with the tiny geometry."""
    from transformers.models.auto.image_processing_auto import (
        IMAGE_PROCESSOR_MAPPING_NAMES,
        get_image_processor_class_from_name,
    )

    names = IMAGE_PROCESSOR_MAPPING_NAMES[model_type]
    return get_image_processor_class_from_name(names["pil"])(**GEOMETRY[model_type][2])


def save_tiny_vision(out_dir: Path, model_type: str, *, seed: int = 0, with_tokenizer: bool = True,
                     **sizes) -> Path:
    """Save a tiny random image-text `model_type` (`sizes`: tiny_vision_config's) with its image
    processor's config, as a checkpoint folder (config.json, safetensors, preprocessor_config.json,
    and the tests' tokenizer)."""
    import torch
    from tiny import make_tokenizer
    from transformers import AutoModelForImageTextToText, GenerationConfig

    out_dir = Path(out_dir)
    if with_tokenizer:
        make_tokenizer(out_dir, vocab_size=320)
    torch.manual_seed(seed)
    model = AutoModelForImageTextToText.from_config(tiny_vision_config(model_type, **sizes))
    model.generation_config = GenerationConfig(bos_token_id=1, eos_token_id=2, pad_token_id=0)
    model.save_pretrained(out_dir)
    image_processor(model_type).save_pretrained(out_dir)
    return out_dir


def save_families(root: Path, families: tuple[str, ...]) -> dict[str, Path]:
    """Each of `families` saved once under `root` (without a tokenizer: the planner reads none)."""
    return {family: save_tiny_vision(root / family, family, with_tokenizer=False) for family in families}


# --------------------------------------------------------------------------------------------
# checks the unit tests run on a few families and tests/e2e/test_vision_families.py on the rest

UNIT_FAMILIES = ("qwen2_vl", "mistral3", "smolvlm", "gemma3")
"""One of each way image tokens are counted: grown with the image (Qwen2-VL; Pixtral, whose images
share one attention), tiles of a fixed count (SmolVLM), a fixed count per image (Gemma 3)."""
E2E_FAMILIES = tuple(f for f in VISION_FAMILIES if f not in UNIT_FAMILIES)

TOKEN_SIZES = ((84, 112), (336, 448), (300, 1000), (1000, 300))
"""(height, width) of the images counted: none of them the vision measurement's squares."""


def derived_shape(folder: Path):
    import json

    from homelab_ft.plan.shape.shapes import model_shape

    return model_shape(json.loads((folder / "config.json").read_text()), model_path=str(folder))


def counted_tokens(folder: Path, sizes=TOKEN_SIZES) -> tuple[int, ...]:
    import json

    from homelab_ft.plan.shape.cache import cached_image_tokens

    return cached_image_tokens(json.loads((folder / "config.json").read_text()), sizes=sizes, model_path=str(folder))


def check_planned_whole(model_type: str, folder: Path) -> None:
    """The family is planned with every loaded weight priced once: the language model's blocks as a
    causal LM's, the vision side (tower and projector, each of its linear layers) beside them."""
    import torch
    from transformers import AutoModelForImageTextToText

    shape = derived_shape(folder)
    model = AutoModelForImageTextToText.from_pretrained(folder)
    language = model.get_decoder()
    assert shape.total_params + shape.vision_params == sum(p.numel() for p in model.parameters())
    assert shape.num_layers == len(language.layers) and shape.model_type == model.config.get_text_config().model_type
    assert not shape.vision.unmeasured and shape.vision.image_processor == type(image_processor(model_type)).__name__
    inside = {id(m) for m in language.modules()} | {id(model.get_output_embeddings())}
    vision_linears = {n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and id(m) not in inside}
    assert {lin.name for lin in shape.vision.linears} == vision_linears


def _real_saved_and_peak(model, inputs) -> tuple[int, int, int]:
    """(image tokens, bytes saved for backward, the most bytes held at once without grad) of the real
    model's vision side: its own kernels, no stand-in."""
    import torch

    from homelab_ft.plan.shape import vision

    skip = {vision._storage_id(t) for t in (*model.parameters(), *model.buffers(), *inputs.values())}
    sizes: dict[int, int] = {}
    keep: list = []

    def pack(t):
        keep.append(t)
        if vision._storage_id(t) not in skip:
            sizes[vision._storage_id(t)] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        tokens = vision._rows(model.get_image_features(**inputs))
    tracker = vision._RealUntilWeights(track=True)
    with tracker, torch.no_grad():
        model.get_image_features(**inputs)
    return tokens, sum(sizes.values()), tracker.peak


def check_against_real_forward(model_type: str, folder: Path) -> None:
    """At 448 x 336 px (never measured: the three measured images are square), the tokens the shape
    predicts are what the real vision side returns, and its saved and held bytes per image are the
    real fp32 CPU forward's within 3%. Costs follow patches, priced through image tokens at a fixed
    number of patches per token: where a grid side is odd (Pixtral merges 2x2 patches and drops the
    odd column), the image costs more than priced: 6% more saved bytes at 560 x 392 on the tiny
    Pixtral (23 patch columns), under 3% at a real 1024 x 768 photo (73)."""
    import pytest
    import torch
    from transformers import AutoModelForImageTextToText

    from homelab_ft.plan.shape import vision

    sight = derived_shape(folder).vision
    torch.manual_seed(0)
    model = AutoModelForImageTextToText.from_config(tiny_vision_config(model_type), attn_implementation="sdpa")
    inputs = vision.vision_inputs(model, image_processor(model_type), height=336, width=448)
    tokens, saved, peak = _real_saved_and_peak(model, inputs)
    assert tokens == vision.image_tokens(model, inputs) > 0
    assert saved == pytest.approx(sight.saved_bytes(4, tokens), rel=0.03)
    assert peak == pytest.approx(sight.transient_bytes(4, tokens), rel=0.03)
    assert sight.forward_flops(tokens) > sight.forward_flops(tokens / 2) > 0


def check_accepted_tokens(folder: Path) -> None:
    """The real model accepts exactly the counted image tokens beside each image of TOKEN_SIZES: its
    own "Image features and image tokens do not match" check refuses one more."""
    import pytest
    import torch
    from PIL import Image
    from transformers import AutoImageProcessor, AutoModelForImageTextToText

    model = AutoModelForImageTextToText.from_pretrained(folder)
    processor = AutoImageProcessor.from_pretrained(folder, backend="pil")
    start = [model.config.vision_start_token_id] if getattr(model.config, "vision_start_token_id", None) else []
    for (height, width), tokens in zip(TOKEN_SIZES, counted_tokens(folder), strict=True):
        pixels = {k: v for k, v in processor(images=[Image.new("RGB", (width, height))], return_tensors="pt").items()
                  if k not in ("num_crops", "num_patches")}

        def forward(count: int, pixels=pixels):
            ids = torch.tensor([[5, 6, *start, *[IMAGE_TOKEN] * count, 7]])
            with torch.no_grad():
                return model(input_ids=ids, mm_token_type_ids=(ids == IMAGE_TOKEN).int(), **pixels)

        assert forward(tokens).logits.shape[1] == tokens + len(start) + 3
        with pytest.raises(ValueError, match="Image features and image tokens do not match"):
            forward(tokens + 1)


def _tokenizer(specials: list[str], **named: str):
    import tempfile

    from tiny import make_tokenizer
    from transformers import PreTrainedTokenizerFast

    base = make_tokenizer(Path(tempfile.mkdtemp()))
    base.add_special_tokens({"additional_special_tokens": specials})
    return PreTrainedTokenizerFast(tokenizer_object=base._tokenizer, bos_token=base.bos_token, extra_special_tokens=named)


def real_processor(model_type: str):
    """The family's real processor (Llava, PaliGemma, Gemma 3: the others need torchvision or
    num2words here) with the tests' tokenizer and its special tokens, and the text and token of one
    image placeholder."""
    import transformers

    if model_type == "llava":
        return (transformers.LlavaProcessor(image_processor=image_processor("llava"), tokenizer=_tokenizer(["<image>"]),
                                            patch_size=14, vision_feature_select_strategy="default",
                                            num_additional_image_tokens=1), "<image>hi", "<image>")
    if model_type == "paligemma":
        pixels = image_processor("paligemma")
        pixels.image_seq_length = 4  # what a PaliGemma checkpoint's preprocessor_config.json carries
        return transformers.PaliGemmaProcessor(image_processor=pixels, tokenizer=_tokenizer(["<image>"])), "<image>hi", "<image>"
    tokens = {"boi_token": "<start_of_image>", "eoi_token": "<end_of_image>", "image_token": "<image_soft_token>"}
    return (transformers.Gemma3Processor(image_processor=image_processor("gemma3"),
                                         tokenizer=_tokenizer(list(tokens.values()), **tokens), image_seq_length=4),
            "<start_of_image>hi", "<image_soft_token>")


def check_processor_expansion(model_type: str, folder: Path) -> None:
    """The real processor expands the placeholder of each image of TOKEN_SIZES to the counted tokens."""
    from PIL import Image

    processor, text, token = real_processor(model_type)
    token_id = processor.tokenizer.convert_tokens_to_ids(token)
    for (height, width), tokens in zip(TOKEN_SIZES, counted_tokens(folder), strict=True):
        ids = processor(text=[text], images=[Image.new("RGB", (width, height))], return_tensors="pt")["input_ids"]
        assert int((ids == token_id).sum()) == tokens
