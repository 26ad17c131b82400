"""Tiny random image-text models saved to disk, for the GGUF + mmproj export's tests.

Each is built from the family's own default config (`CONFIG_MAPPING[model_type]()`) with its text
config shrunk by tests/families.py and its vision config shrunk here (few layers, widths of a few
dozen), saved with `save_pretrained` so the export reads the layout users' checkpoints have. Only
Idefics3 (SmolVLM v1) gets a processor: its image processor and processor need neither torchvision
nor num2words, which are not installed here. The others get their PIL image processor, a tokenizer
holding the family's image tokens and a ChatML template writing an image part as the family's own
template does (`IMAGE_MARKUP`); their processors (Qwen2-VL's lists a video processor, Pixtral's
imports torchvision) cannot be built without torchvision, so tests/llama_mtmd.py expands the image
token itself. Nothing touches the network.
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
    # the released towers' patch sizes: llama.cpp sizes Qwen2.5-VL's attention windows as 112 px
    "qwen2_vl": {"patch_size": 14, "hidden_size": 64},  # hidden_size: the merger's output, the text width
    "qwen2_5_vl": {"patch_size": 14, "window_size": 112, "fullatt_block_indexes": [1]},
    # a 4 x 4 position grid, which both runtimes interpolate to the image's patches
    "qwen3_vl": {"patch_size": 16, "num_position_embeddings": 16, "deepstack_visual_indexes": [0]},
    "mistral3": {"image_size": 2 * IMAGE, "patch_size": 8, "hidden_act": "silu"},
}
"""Vision-config keys of each family's tiny geometry; Gemma 3's released towers have no pooling head,
Mistral Small 3.1's Pixtral tower runs SiLU."""

_MROPE = {"rope_type": "default", "rope_theta": 1000000.0, "mrope_section": [2, 3, 3]}
"""Qwen's M-RoPE sections (time, height, width) sized to the tiny head (16 wide: 8 rotated pairs)."""

TEXT = {"gemma3": {"query_pre_attn_scalar": 16},
        "qwen2_vl": {"rope_parameters": _MROPE}, "qwen2_5_vl": {"rope_parameters": _MROPE},
        "qwen3_vl": {"rope_parameters": {**_MROPE, "mrope_interleaved": True}},
        "mistral3": {"sliding_window": None, "rms_norm_eps": 1e-5}}
"""Text-config keys llama.cpp fixes per architecture (Gemma 3 scales queries by head_dim^-1/2, no GGUF key)
or the released models have (Mistral Small 3.1: no sliding window, the vision tower's norm epsilon)."""

TOP = {"gemma3": {"mm_tokens_per_image": 4}, "internvl": {"image_seq_length": 4}}
"""Top-level keys tying the image-token count to the tiny geometry."""

_QWEN_IDS = {"image_token_id": "<|image_pad|>", "video_token_id": "<|video_pad|>",
             "vision_start_token_id": "<|vision_start|>", "vision_end_token_id": "<|vision_end|>"}
TOKEN_IDS = {"qwen2_vl": _QWEN_IDS, "qwen2_5_vl": _QWEN_IDS, "qwen3_vl": _QWEN_IDS,
             "mistral3": {"image_token_index": "[IMG]"}}
"""Config keys holding an image token's id -> the token, as the family's tokenizer has it."""

FAMILY_TOKENS = {"mistral3": ("[IMG]", "[IMG_BREAK]", "[IMG_END]")}
FAMILY_TOKENS.update({model_type: tuple(ids.values()) for model_type, ids in TOKEN_IDS.items() if model_type != "mistral3"})
"""The family's image special tokens (Pixtral's rows end in [IMG_BREAK], the image in [IMG_END])."""

IMAGE_MARKUP = {"qwen2_vl": "<|vision_start|><|image_pad|><|vision_end|>", "mistral3": "[IMG]"}
IMAGE_MARKUP["qwen2_5_vl"] = IMAGE_MARKUP["qwen3_vl"] = IMAGE_MARKUP["qwen2_vl"]
"""What the family's chat template writes for an image part (the processor then repeats the image token)."""


EXACT_SIDES = {"qwen2_vl": 112, "qwen2_5_vl": 224, "qwen3_vl": 128, "mistral3": 64}
"""Image sides (px) each family's tiny processor and llama.cpp keep as they are, neither resampling:
16 merged Qwen2-VL tokens (llama.cpp's floor is 8), 64 for Qwen2.5-VL (four 112 px windows), 16
Qwen3-VL tokens from a position grid interpolated from 4 x 4 to 8 x 8, 4 x 4 Pixtral tokens."""


def parts_template(image_markup: str) -> str:
    """ChatML whose content may be a string or parts; an image part is written as `image_markup`."""
    return ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' }}"
            "{% if message['content'] is string %}{{ message['content'] }}{% else %}"
            "{% for part in message['content'] %}{% if part['type'] == 'image' %}{{ '" + image_markup + "' }}"
            "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}{% endfor %}{% endif %}"
            "{{ '<|im_end|>\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")


def tiny_vlm_config(model_type: str, *, text_overrides: dict | None = None, **vision_overrides):
    """`model_type`'s default image-text config with tiny text and vision parts (`vision_overrides`
    over the family's tiny sizes and geometry)."""
    from families import tiny_config

    config = tiny_config(model_type, **TEXT.get(model_type, {}), **(text_overrides or {}))
    vision = config.vision_config
    present = vision.to_dict()
    sizes = {key: value for key, value in VISION_SIZES.items() if present.get(key) is not None}
    for key, value in {**sizes, **GEOMETRY.get(model_type, {}), **vision_overrides}.items():
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
        template = {"chat_template": parts_template(IMAGE_MARKUP[model_type])} if model_type in IMAGE_MARKUP else {}
        tokenizer = make_tokenizer(out_dir, **template)
        tokenizer.add_special_tokens({"additional_special_tokens": list(IMAGE_TOKENS)
                                      + list(FAMILY_TOKENS.get(model_type, ()))})
        tokenizer.save_pretrained(out_dir)
        _image_processor(model_type).save_pretrained(out_dir)
        for key, token in TOKEN_IDS.get(model_type, {}).items():
            setattr(config, key, tokenizer.convert_tokens_to_ids(token))
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
    # Qwen-VL's generation_config.json ends a reply at <|im_end|> or <|endoftext|>, as llama.cpp does
    eos = [text.eos_token_id, text.pad_token_id] if model_type in TOKEN_IDS and model_type != "mistral3" else text.eos_token_id
    model.generation_config = GenerationConfig(bos_token_id=text.bos_token_id, eos_token_id=eos,
                                               pad_token_id=text.pad_token_id)
    model.save_pretrained(out_dir)
    return out_dir


def _image_processor(model_type: str):
    """The family's PIL image processor at the tiny size (its preprocessor_config.json is what the
    mmproj's image mean and std are read from, as llama.cpp's converter reads them)."""
    from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil
    from transformers.models.got_ocr2.image_processing_pil_got_ocr2 import GotOcr2ImageProcessorPil
    from transformers.models.idefics3.image_processing_pil_idefics3 import Idefics3ImageProcessorPil
    from transformers.models.pixtral.image_processing_pil_pixtral import PixtralImageProcessorPil
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    size = {"height": IMAGE, "width": IMAGE}

    def qwen(patch: int):  # 8 to 256 merged tokens of (2 patch)^2 pixels: llama.cpp's floor is 8
        unit = (2 * patch) ** 2
        return Qwen2VLImageProcessorPil(patch_size=patch, merge_size=2, size={"shortest_edge": 8 * unit,
                                                                              "longest_edge": 256 * unit})

    return {"gemma3": lambda: Gemma3ImageProcessorPil(size=size),
            "internvl": lambda: GotOcr2ImageProcessorPil(size=size, crop_to_patches=False),
            # SmolVLM2's own processor needs num2words (not installed); its image side is Idefics3's
            "smolvlm": lambda: Idefics3ImageProcessorPil(do_image_splitting=False, size={"longest_edge": IMAGE},
                                                         max_image_size={"longest_edge": IMAGE}),
            "qwen2_vl": lambda: qwen(14), "qwen2_5_vl": lambda: qwen(14), "qwen3_vl": lambda: qwen(16),
            "mistral3": lambda: PixtralImageProcessorPil(patch_size=8, size={"longest_edge": 2 * IMAGE})}[model_type]()


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
