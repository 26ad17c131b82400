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
