"""Tiny random image-text models saved to disk, for the GGUF + mmproj export's tests.

Each is built from the family's own default config (`CONFIG_MAPPING[model_type]()`) with its text
config shrunk by tests/families.py and its vision config shrunk here (few layers, widths of a few
dozen), saved with `save_pretrained` so the export reads the layout users' checkpoints have. Only
Idefics3 (SmolVLM v1) gets a processor: its image processor and processor need neither torchvision
nor num2words, which are not installed here. Nothing touches the network.
"""

from __future__ import annotations

from pathlib import Path

VISION_SIZES = {
    "hidden_size": 32,
    "embed_dim": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "depth": 2,
    "num_attention_heads": 2,
    "num_heads": 2,
    "head_dim": 16,
    "out_hidden_size": 64,
    "num_position_embeddings": 16,
}
"""Vision-config size keys and their tiny values, applied where the config has the key."""

IMAGE_TOKENS = ("<fake_token_around_image>", "<image>", "<end_of_utterance>", "<global-img>",
                *(f"<row_{row}_col_{col}>" for row in range(1, 7) for col in range(1, 7)))
"""The special tokens Idefics3's processor and chat format use (processing_idefics3.py), as SmolVLM's
tokenizer has them: a tile's `<row_r_col_c>` tag is one token there, in llama.cpp's mtmd and here."""

IMAGE_CORPUS = [f"{word} shapes\n\n" for word in ("red", "blue", "green", "three", "two", "one")] * 4 + [
    "User: what is in the picture?\nAssistant: squares\n"]
"""Lines with the newlines mtmd looks up as single tokens between Idefics3's tiles ("\n", "\n\n")."""

IDEFICS3_TEMPLATE = (
    "<|im_start|>{% for message in messages %}{{ message['role'] | capitalize }}"
    "{% if message['content'][0]['type'] == 'image' %}{{ ':' }}{% else %}{{ ': ' }}{% endif %}"
    "{% for part in message['content'] %}{% if part['type'] == 'text' %}{{ part['text'] }}"
    "{% elif part['type'] == 'image' %}{{ '<image>' }}{% endif %}{% endfor %}<end_of_utterance>\n{% endfor %}"
    "{% if add_generation_prompt %}{{ 'Assistant:' }}{% endif %}"
)
"""SmolVLM-256M-Instruct's chat format: `User:<image>text<end_of_utterance>\\nAssistant:`."""

IMAGE = 32
"""The tiny image side: 4 x 4 patches of 8 pixels, 4 image tokens after each family's 2x2 reduction
(Idefics3's pixel shuffle, Gemma 3's average pool, InternVL's pixel shuffle)."""

GEOMETRY = {
    "idefics3": {"image_size": IMAGE, "patch_size": 8},
    "smolvlm": {"image_size": IMAGE, "patch_size": 8},
    "gemma3": {"image_size": IMAGE, "patch_size": 8, "vision_use_head": False},
    "internvl": {"image_size": [IMAGE, IMAGE], "patch_size": [8, 8]},
}
"""Vision-config keys of each family's tiny geometry; Gemma 3's released towers have no pooling head."""

TEXT = {"gemma3": {"query_pre_attn_scalar": 16}}
"""Text-config keys llama.cpp fixes per architecture (Gemma 3 scales queries by head_dim^-1/2, no GGUF key)."""

TOP = {"gemma3": {"mm_tokens_per_image": 4}, "internvl": {"image_seq_length": 4}}
"""Top-level keys tying the image-token count to the tiny geometry."""


def tiny_vlm_config(model_type: str, *, text_overrides: dict | None = None, **vision_overrides):
    """`model_type`'s default image-text config with tiny text and vision parts."""
    from families import tiny_config

    config = tiny_config(model_type, **TEXT.get(model_type, {}), **(text_overrides or {}))
    vision = config.vision_config
    present = vision.to_dict()
    for key, value in {**VISION_SIZES, **vision_overrides}.items():
        if key in present and present[key] is not None:
            setattr(vision, key, value)
    for key, value in GEOMETRY.get(model_type, {}).items():
        setattr(vision, key, value)
    for key, value in TOP.get(model_type, {}).items():
        setattr(config, key, value)
    return config


def save_tiny_vlm(out_dir: Path, model_type: str, *, seed: int = 0, text_overrides: dict | None = None,
                  **vision_overrides) -> Path:
    """Save a tiny random image-text `model_type` (and, for Idefics3, its tokenizer and processor)."""
    import torch
    from tiny import make_tokenizer
    from transformers import AutoModelForImageTextToText, GenerationConfig

    out_dir = Path(out_dir)
    config = tiny_vlm_config(model_type, text_overrides=text_overrides, **vision_overrides)
    if model_type == "idefics3":
        tokenizer = _idefics3_processor(out_dir).tokenizer
        config.image_token_id = tokenizer.convert_tokens_to_ids("<image>")
    else:
        tokenizer = make_tokenizer(out_dir)
        tokenizer.add_special_tokens({"additional_special_tokens": list(IMAGE_TOKENS)})
        tokenizer.save_pretrained(out_dir)
        _image_processor(model_type).save_pretrained(out_dir)
    text = config.get_text_config()
    text.vocab_size = (len(tokenizer) + 31) // 32 * 32
    text.bos_token_id, text.eos_token_id, text.pad_token_id = (
        tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id)
    if model_type == "idefics3":
        text.eos_token_id = tokenizer.convert_tokens_to_ids("<end_of_utterance>")
    torch.manual_seed(seed)
    model = AutoModelForImageTextToText.from_config(config)
    with torch.no_grad():  # zero-initialised weights (Gemma 3's projector) would hide a layout error
        for param in model.parameters():
            if not param.any():
                param.normal_(0.0, 0.02)
    text = config.get_text_config()
    model.generation_config = GenerationConfig(bos_token_id=text.bos_token_id, eos_token_id=text.eos_token_id,
                                               pad_token_id=text.pad_token_id)
    model.save_pretrained(out_dir)
    return out_dir


def _image_processor(model_type: str):
    """The family's PIL image processor at the tiny size (its preprocessor_config.json is what the
    mmproj's image mean and std are read from, as llama.cpp's converter reads them)."""
    from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil
    from transformers.models.got_ocr2.image_processing_pil_got_ocr2 import GotOcr2ImageProcessorPil
    from transformers.models.idefics3.image_processing_pil_idefics3 import Idefics3ImageProcessorPil

    size = {"height": IMAGE, "width": IMAGE}
    return {"gemma3": lambda: Gemma3ImageProcessorPil(size=size),
            "internvl": lambda: GotOcr2ImageProcessorPil(size=size, crop_to_patches=False),
            # SmolVLM2's own processor needs num2words (not installed); its image side is Idefics3's
            "smolvlm": lambda: Idefics3ImageProcessorPil(do_image_splitting=False, size={"longest_edge": IMAGE},
                                                         max_image_size={"longest_edge": IMAGE})}[model_type]()


def _idefics3_processor(out_dir: Path):
    from tiny import CORPUS, make_tokenizer
    from transformers import Idefics3Processor
    from transformers.models.idefics3.image_processing_pil_idefics3 import Idefics3ImageProcessorPil

    tokenizer = make_tokenizer(out_dir, chat_template=IDEFICS3_TEMPLATE, corpus=CORPUS + IMAGE_CORPUS)
    tokenizer.add_special_tokens({"additional_special_tokens": list(IMAGE_TOKENS)})
    # as SmolVLM's: images resized to a longest edge of 2 tiles, split into tiles plus the whole image
    image_processor = Idefics3ImageProcessorPil(
        do_image_splitting=True, size={"longest_edge": 2 * IMAGE},
        max_image_size={"longest_edge": IMAGE}, image_mean=[0.5] * 3, image_std=[0.5] * 3)
    processor = Idefics3Processor(image_processor, tokenizer, image_seq_len=(IMAGE // 8 // 2) ** 2,
                                  chat_template=IDEFICS3_TEMPLATE)
    processor.save_pretrained(out_dir)
    return processor


def quadrants_image(path: Path, *, size: int = 2 * IMAGE, seed: int = 0) -> Path:
    """A PNG of four flat-coloured quadrants, drawn with Pillow. At 2 x IMAGE a side it needs no
    resizing to be Idefics3's 2 x 2 tiles, so transformers and llama.cpp see the same tile pixels;
    only the whole-image view is resampled (their resamplers differ, LANCZOS and bilinear), and on
    flat quadrants only at the seams."""
    import random

    from PIL import Image, ImageDraw

    rng = random.Random(seed)
    image = Image.new("RGB", (size, size))
    draw = ImageDraw.Draw(image)
    half = size // 2
    for x in (0, half):
        for y in (0, half):
            draw.rectangle([x, y, x + half - 1, y + half - 1], fill=tuple(rng.randrange(256) for _ in range(3)))
    image.save(path)
    return path
