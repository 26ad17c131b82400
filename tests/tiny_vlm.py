"""Tiny random image-text models saved to disk the way a released checkpoint is, so tests load them
through `AutoModelForImageTextToText` + `AutoProcessor` offline: the one image-text helper, as
tests/tiny.py and tests/families.py are the text ones.

Each family is built from its real config class (`CONFIG_MAPPING[model_type]()`, its text side
shrunk by families.tiny_config, its vision side by `VISION_SIZES` and the family's geometry), with
a byte-level BPE tokenizer holding the family's image special tokens (under the attribute names its
processor reads, `extra_special_tokens`), the family's PIL image processor (no torchvision here)
sized to the tiny tower, and, where transformers can build it here, the family's processor with a
ChatML template that writes an image part as the family's own template does.

    save_vlm(out_dir, "qwen2_vl", seed=0) -> out_dir      model, processor, tokenizer, template
    save_vlm(out_dir, "qwen2_vl", weights=False)          config.json and the processor only (data tests)
    save_vlm(out_dir, "qwen2_vl", text={...}, vision={...})  larger sizes (a memory measurement)
    tiny_vlm_config("qwen2_vl")                            the config alone
    save_families(root, ("qwen2_vl", "gemma3"))            several, each once (the planner's tests)
    save_gguf_vlm(out_dir, "idefics3")                     llama.cpp's geometry (the GGUF + mmproj tests)
    make_image / quadrants_image / image_chat              the rows' images and chat rows

Which families can do what here (transformers 5.25, no torchvision):
- `TRAINED`: a processor the data pipeline reads rows with. A processor class that lists a
  `video_processor` (Qwen2-VL, Qwen2.5-VL, Qwen3-VL, Qwen 3.5, InternVL) cannot be constructed without
  torchvision (ProcessorMixin checks each part against `VideoProcessorMixin`, which needs it), so it
  is built and saved as model/processor.py's `without_video` class under the family's own name.
- SmolVLM (its processor needs the `num2words` package; Idefics3 is the same architecture and
  tiling and is trained), Mistral 3 (Pixtral's processor module imports torchvision) and PaliGemma
  (a prefix-LM processor that writes its own labels) are saved with their tokenizer and image
  processor only: the planner measures them, the GGUF tests export them.
- Llama 4's image processor exists only with torchvision: its checkpoint has no processor files, and
  the planner prices its tower by its weights (an image run's shape, issue 35).

`save_gguf_vlm` keeps what llama.cpp's graphs fix (`GGUF_GEOMETRY`: the released patch sizes, a
32 px tile, Gemma 3 without a pooling head ...) and the tokenizers tests/llama_mtmd.py expands image
tokens with (Idefics3 with SmolVLM's own template and processor); its models are compared with
llama.cpp's libmtmd, so they are built exactly as those checks were measured.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from families import tiny_config

VISION_SIZES = {
    "hidden_size": 32,
    "embed_dim": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 3,
    "depth": 3,
    "num_attention_heads": 2,
    "num_heads": 2,
    "head_dim": 16,
    "projection_dim": 32,
    "num_position_embeddings": 64,
    "vision_output_dim": 32,
}
"""Vision tower sizes, applied where the family's vision config has the key (as families._TINY_SIZES
is). Three blocks: the planner measures a second block of a kind and the last (plan/shape/vision.py)."""


@dataclass(frozen=True)
class Family:
    """What a family's checkpoint needs beyond its config class: its image tokens and how its template
    writes an image, the tower's image geometry and the image processor's matching settings."""

    named_tokens: dict[str, str]
    """Special tokens the processor reads as tokenizer attributes (`tokenizer.image_token`, ...)."""
    image_text: str
    """What the family's chat template writes for one image part."""
    config_ids: dict[str, str] = field(default_factory=dict)
    """Config keys holding a token id -> the token whose id they take in the tiny vocabulary."""
    vision: dict = field(default_factory=dict)
    """vision_config keys beyond VISION_SIZES (image size, patch size)."""
    top: dict = field(default_factory=dict)
    """Top-level config keys (tokens per image, ...)."""
    image_processor: dict = field(default_factory=dict)
    """The PIL image processor's settings, sized to the tiny tower (None below: it has none here)."""
    processor: dict | None = field(default_factory=dict)
    """The processor's own settings (tokens per image, patch size); None: it cannot be built here."""
    extra_tokens: tuple[str, ...] = ()
    """Further special tokens the processor writes (Idefics3's tile rows and columns)."""
    has_image_processor: bool = True


_QWEN_TOKENS = {"image_token": "<|image_pad|>", "video_token": "<|video_pad|>",
                "vision_start_token": "<|vision_start|>", "vision_end_token": "<|vision_end|>"}
_QWEN_IDS = {"image_token_id": "<|image_pad|>", "video_token_id": "<|video_pad|>",
             "vision_start_token_id": "<|vision_start|>", "vision_end_token_id": "<|vision_end|>"}
_QWEN_MARKUP = "<|vision_start|><|image_pad|><|vision_end|>"
_QWEN_PIXELS = {"min_pixels": 28 * 28, "max_pixels": 28 * 28 * 16}
"""A Qwen-style image is one token per 28x28 pixels (patch 14, merge 2): 1 to 16 tokens here, unless
a recipe's data.image_max_pixels raises the cap (rules/image_area.py)."""
_QWEN3_PIXELS = {"min_pixels": 32 * 32, "max_pixels": 32 * 32 * 16, "patch_size": 16}
_IDEFICS3_TOKENS = {"image_token": "<image>", "fake_image_token": "<fake_token_around_image>",
                    "global_image_token": "<global-img>", "end_of_utterance_token": "<end_of_utterance>"}
_TILES = tuple(f"<row_{r}_col_{c}>" for r in range(1, 4) for c in range(1, 4))

FAMILIES = {
    "qwen2_vl": Family(
        named_tokens=_QWEN_TOKENS, image_text=_QWEN_MARKUP, config_ids=_QWEN_IDS,
        vision={"patch_size": 14, "spatial_merge_size": 2}, image_processor=_QWEN_PIXELS),
    "qwen2_5_vl": Family(
        named_tokens=_QWEN_TOKENS, image_text=_QWEN_MARKUP, config_ids=_QWEN_IDS,
        vision={"window_size": 56, "fullatt_block_indexes": [2]}, image_processor=_QWEN_PIXELS),
    "qwen3_vl": Family(
        named_tokens=_QWEN_TOKENS, image_text=_QWEN_MARKUP, config_ids=_QWEN_IDS,
        vision={"patch_size": 16, "deepstack_visual_indexes": [1]}, image_processor=_QWEN3_PIXELS),
    "qwen3_5": Family(  # its causal-LM class is text-only (Qwen3_5ForCausalLM): an image run builds the tower
        named_tokens=_QWEN_TOKENS, image_text=_QWEN_MARKUP, config_ids=_QWEN_IDS,
        vision={"patch_size": 16}, image_processor=_QWEN3_PIXELS),
    "llava": Family(
        named_tokens={"image_token": "<image>"}, image_text="<image>\n", config_ids={"image_token_id": "<image>"},
        vision={"image_size": 28, "patch_size": 7}, top={"image_seq_length": 16},
        image_processor={"size": {"shortest_edge": 28}, "crop_size": {"height": 28, "width": 28}},
        processor={"patch_size": 7, "vision_feature_select_strategy": "default", "num_additional_image_tokens": 1}),
    "llava_next": Family(
        named_tokens={"image_token": "<image>"}, image_text="<image>\n", config_ids={"image_token_id": "<image>"},
        vision={"image_size": 28, "patch_size": 7},
        top={"image_grid_pinpoints": [[28, 56], [56, 28], [56, 56]], "image_seq_length": 16},
        image_processor={"size": {"shortest_edge": 28}, "crop_size": {"height": 28, "width": 28},
                         "image_grid_pinpoints": [[28, 56], [56, 28], [56, 56]]},
        processor={"patch_size": 7, "vision_feature_select_strategy": "default", "num_additional_image_tokens": 1}),
    "gemma3": Family(
        named_tokens={"image_token": "<image_soft_token>", "boi_token": "<start_of_image>",
                      "eoi_token": "<end_of_image>"},
        image_text="<start_of_image>",
        config_ids={"image_token_id": "<image_soft_token>", "boi_token_id": "<start_of_image>",
                    "eoi_token_id": "<end_of_image>"},
        vision={"image_size": 56, "patch_size": 14}, top={"mm_tokens_per_image": 4},
        image_processor={"size": {"height": 56, "width": 56}}, processor={"image_seq_length": 4}),
    "idefics3": Family(
        named_tokens=_IDEFICS3_TOKENS, image_text="<image>", config_ids={"image_token_id": "<image>"},
        vision={"image_size": 32, "patch_size": 8}, top={"scale_factor": 2}, extra_tokens=_TILES,
        image_processor={"size": {"longest_edge": 96}, "max_image_size": {"longest_edge": 32}},
        processor={"image_seq_len": 4}),
    "internvl": Family(
        named_tokens={"start_image_token": "<img>", "end_image_token": "</img>",
                      "context_image_token": "<IMG_CONTEXT>", "video_token": "<video>"},
        image_text="<IMG_CONTEXT>\n", config_ids={"image_token_id": "<IMG_CONTEXT>"},
        vision={"image_size": [28, 28], "patch_size": [7, 7]}, top={"image_seq_length": 4},
        image_processor={"size": {"height": 28, "width": 28}, "max_patches": 4}, processor={"image_seq_length": 4}),
    "smolvlm": Family(
        named_tokens=_IDEFICS3_TOKENS, image_text="<image>", config_ids={"image_token_id": "<image>"},
        vision={"image_size": 64, "patch_size": 16}, top={"scale_factor": 2}, extra_tokens=_TILES,
        image_processor={"size": {"longest_edge": 192}, "max_image_size": {"longest_edge": 64}}, processor=None),
    "mistral3": Family(
        named_tokens={"image_token": "[IMG]"}, image_text="[IMG]", config_ids={"image_token_index": "[IMG]"},
        vision={"image_size": 448, "patch_size": 14}, extra_tokens=("[IMG_BREAK]", "[IMG_END]"),
        image_processor={"size": {"longest_edge": 448}, "patch_size": 14}, processor=None),
    "paligemma": Family(
        named_tokens={"image_token": "<image>"}, image_text="<image>", config_ids={"image_token_id": "<image>"},
        vision={"image_size": 28, "patch_size": 14}, image_processor={"size": {"height": 28, "width": 28}},
        processor=None),
    "llama4": Family(
        named_tokens={"image_token": "<|image|>"}, image_text="<|image|>", config_ids={"image_token_index": "<|image|>"},
        vision={"image_size": 28, "patch_size": 14}, processor=None, has_image_processor=False),
}

TRAINED = tuple(name for name, f in FAMILIES.items() if f.processor is not None)
"""Families whose processor the data pipeline reads image rows with (the module docstring says why not the others)."""
MEASURED = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl", "gemma3", "smolvlm", "llava", "mistral3", "internvl", "paligemma")
"""Families the planner's tests measure (plan/shape/vision.py) against their real forward."""
UNIT_FAMILIES = ("qwen2_vl",)
"""The unit suite's one (image tokens grown with the image: the planner's every branch but a fixed
count, which tests/unit/plan/price/test_image_price.py prices on its shape with one count); a first
plan of a family costs 2-3 CPU s, so tests/e2e/test_vision_families.py measures the rest of MEASURED:
Gemma 3's fixed count, SmolVLM's tiles, Pixtral's images sharing one attention (Mistral 3) ..."""
E2E_FAMILIES = tuple(f for f in MEASURED if f not in UNIT_FAMILIES)


def chat_template(image_text: str) -> str:
    """ChatML whose content may be a string or parts; an image part is written as `image_text`."""
    return (
        "{% for message in messages %}"
        "{{ '<|im_start|>' + message['role'] + '\n' }}"
        "{% if message['content'] is string %}{{ message['content'] }}"
        "{% else %}{% for part in message['content'] %}"
        "{% if part['type'] == 'image' %}{{ '" + image_text.replace("\n", "\\n") + "' }}"
        "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
        "{% endfor %}{% endif %}"
        "{{ '<|im_end|>\n' }}"
        "{% endfor %}"
        "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
    )


def make_vlm_tokenizer(family: Family, *, vocab_size: int = 320):
    """The tests' byte-level BPE (tiny.make_tokenizer's) with the family's image tokens added as
    special tokens, the named ones as the attributes its processor reads, and its template."""
    from tiny import CORPUS
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size - len(family.named_tokens) - len(family.extra_tokens),
                                  special_tokens=specials, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(CORPUS * 4, trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<|im_start|>", eos_token="<|im_end|>", pad_token="<|endoftext|>",
        unk_token="<|endoftext|>", extra_special_tokens=dict(family.named_tokens))
    fast.add_special_tokens({"extra_special_tokens": list(family.extra_tokens)}, replace_extra_special_tokens=False)
    fast.chat_template = chat_template(family.image_text)
    return fast


def shrink_vision(vision, sizes: dict, overrides: dict) -> None:
    """Set the tiny `sizes` a vision config has (a key it holds, not None), then `overrides` as given."""
    present = vision.to_dict()
    for key, value in {**{k: v for k, v in sizes.items() if present.get(k) is not None}, **overrides}.items():
        setattr(vision, key, value)


def tiny_vlm_config(model_type: str, tokenizer=None, *, text: dict | None = None, vision: dict | None = None):
    """The family's default config, text and vision sides shrunk (`text` / `vision`: other sizes,
    e.g. a larger model for a memory measurement), the tower's output the text decoder's width, its
    token ids those of `tokenizer` (the family's own, made here when None)."""
    family = FAMILIES[model_type]
    tokenizer = tokenizer if tokenizer is not None else make_vlm_tokenizer(family)
    config = tiny_config(model_type, **(text or {}))
    width = config.get_text_config(decoder=True).hidden_size
    shrink_vision(config.vision_config, VISION_SIZES, {**family.vision, **(vision or {})})
    widths = config.vision_config.to_dict()
    for key in ("out_hidden_size", "projector_input_dim", "projector_output_dim"):  # the merger's or projector's output
        if widths.get(key) is not None:
            setattr(config.vision_config, key, width)
    if widths.get("embed_dim") is not None:  # Qwen2-VL: `hidden_size` is the merger's output width
        config.vision_config.hidden_size = width
    if config.to_dict().get("projection_dim") is not None:  # PaliGemma projects into the text decoder's width
        config.projection_dim = config.vision_config.projection_dim = config.hidden_size = width
    vocab = (len(tokenizer) + 31) // 32 * 32
    config.get_text_config(decoder=True).vocab_size = vocab
    if "vocab_size" in config.to_dict() and not isinstance(type(config).__dict__.get("vocab_size"), property):
        config.vocab_size = vocab
    for key, value in family.top.items():
        setattr(config, key, value)
    for key, token in family.config_ids.items():
        setattr(config, key, tokenizer.convert_tokens_to_ids(token))
    for key, value in {"pad_token_id": tokenizer.pad_token_id, "bos_token_id": tokenizer.bos_token_id,
                       "eos_token_id": tokenizer.eos_token_id}.items():
        setattr(config.get_text_config(decoder=True), key, value)
    fit_mrope(config.get_text_config(decoder=True))
    return config


def fit_mrope(text) -> None:
    """Qwen2-VL-style multimodal RoPE splits head_dim / 2 rotary frequencies into (time, height,
    width) sections (a config that declares `mrope_section` among its rope keys); the modeling
    code's default [16, 24, 24] assumes head_dim 128, so the tiny head gets the same split scaled
    down ([2, 3, 3] at head_dim 16)."""
    rope = getattr(text, "rope_parameters", None)
    declared = "mrope_section" in (getattr(type(text), "ignore_keys_at_rope_validation", None) or ())
    if rope is None or not (declared or rope.get("mrope_section")):
        return
    sections = rope.get("mrope_section") or [16, 24, 24]
    rotated = int((getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads)
                  * rope.get("partial_rotary_factor", 1.0)) // 2
    scaled = [max(1, s * rotated // sum(sections)) for s in sections]
    scaled[0] += rotated - sum(scaled)
    rope["mrope_section"] = scaled


def image_processor(model_type: str):
    """The family's PIL image processor (torchvision is not installed) at the tiny geometry."""
    from transformers.models.auto.image_processing_auto import (
        IMAGE_PROCESSOR_MAPPING_NAMES,
        get_image_processor_class_from_name,
    )

    return get_image_processor_class_from_name(IMAGE_PROCESSOR_MAPPING_NAMES[model_type]["pil"])(
        **FAMILIES[model_type].image_processor)


def make_processor(model_type: str, tokenizer):
    """The family's processor (its video side left out: model/processor.without_video), its PIL image
    processor sized to the tiny tower, the tokenizer and its template."""
    import transformers
    from transformers.models.auto.processing_auto import PROCESSOR_MAPPING_NAMES

    from homelab_ft.model.processor import without_video

    processor_class = without_video(getattr(transformers, PROCESSOR_MAPPING_NAMES[model_type]))
    return processor_class(image_processor=image_processor(model_type), tokenizer=tokenizer,
                           chat_template=tokenizer.chat_template, **FAMILIES[model_type].processor)


def save_vlm(out_dir: Path, model_type: str, *, seed: int = 0, weights: bool = True, text: dict | None = None,
             vision: dict | None = None) -> Path:
    """Save a tiny random `model_type` image-text model with its processor (or, where none can be
    built here, its image processor) and tokenizer to `out_dir`, as `save_pretrained` writes a
    released checkpoint; `weights=False`: config.json and the processor only (the data pipeline)."""
    import torch
    from transformers import AutoModelForImageTextToText, GenerationConfig

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    family = FAMILIES[model_type]
    tokenizer = make_vlm_tokenizer(family)
    config = tiny_vlm_config(model_type, tokenizer, text=text, vision=vision)
    if family.processor is not None:
        make_processor(model_type, tokenizer).save_pretrained(out_dir)
    else:
        tokenizer.save_pretrained(out_dir)
        if family.has_image_processor:
            image_processor(model_type).save_pretrained(out_dir)
    if not weights:
        config.save_pretrained(out_dir)
        return out_dir
    torch.manual_seed(seed)
    model = AutoModelForImageTextToText.from_config(config)
    _no_zero_weights(model)
    model.generation_config = GenerationConfig(bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                                               pad_token_id=tokenizer.pad_token_id)
    model.save_pretrained(out_dir)
    return out_dir


def _no_zero_weights(model, *, matrices_only: bool = True) -> None:
    """Zero-initialised weights drawn again (Gemma 3's projector starts at zeros, which would hide the
    image from the model and a layout error from a check)."""
    import torch

    with torch.no_grad():
        for param in model.parameters():
            if (param.ndim >= 2 or not matrices_only) and not param.any():
                param.normal_(0.0, 0.02)


def save_families(root: Path, families: tuple[str, ...]) -> dict[str, Path]:
    """Each of `families` saved once under `root` (the planner's tests: its shape and its image tokens)."""
    return {family: save_vlm(root / family, family) for family in families}


def image_chat(image: str | dict, question: str = "what colour?", answer: str = "red") -> dict:
    """A chat row asking about one image (`image`: its path, or a whole content part)."""
    part = image if isinstance(image, dict) else {"type": "image", "path": image}
    return {"messages": [{"role": "user", "content": [part, {"type": "text", "text": question}]},
                         {"role": "assistant", "content": answer}]}


def make_image(path: Path, *, size: tuple[int, int] = (56, 56), colour: tuple[int, int, int] = (200, 30, 30)) -> Path:
    """A solid RGB PNG of `size` (width, height) at `path`."""
    from PIL import Image

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.new("RGB", size, colour).save(path)
    return path


# --------------------------------------------------------------------------------------------
# llama.cpp's geometry: the GGUF + mmproj export's tests (tests/unit/export/gguf, tests/llama_mtmd.py)

GGUF_VISION_SIZES = {
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
"""The GGUF checks' vision sizes: the tower's out_hidden_size is the text width (64)."""

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
"""The GGUF checks' image side: 4 x 4 patches of 8 pixels, 4 image tokens after each family's 2x2
reduction (Idefics3's pixel shuffle, Gemma 3's average pool, InternVL's pixel shuffle)."""

GGUF_GEOMETRY = {
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
"""Vision-config keys of each family's GGUF geometry; Gemma 3's released towers have no pooling head,
Mistral Small 3.1's Pixtral tower runs SiLU."""

_MROPE = {"rope_type": "default", "rope_theta": 1000000.0, "mrope_section": [2, 3, 3]}
"""Qwen's M-RoPE sections (time, height, width) sized to the tiny head (16 wide: 8 rotated pairs)."""

GGUF_TEXT = {"gemma3": {"query_pre_attn_scalar": 16},
             "qwen2_vl": {"rope_parameters": _MROPE}, "qwen2_5_vl": {"rope_parameters": _MROPE},
             "qwen3_vl": {"rope_parameters": {**_MROPE, "mrope_interleaved": True}},
             "mistral3": {"sliding_window": None, "rms_norm_eps": 1e-5}}
"""Text-config keys llama.cpp fixes per architecture (Gemma 3 scales queries by head_dim^-1/2, no GGUF key)
or the released models have (Mistral Small 3.1: no sliding window, the vision tower's norm epsilon)."""

GGUF_TOP = {"gemma3": {"mm_tokens_per_image": 4}, "internvl": {"image_seq_length": 4}}
"""Top-level keys tying the image-token count to the GGUF geometry."""

GGUF_TOKEN_IDS = {model_type: FAMILIES[model_type].config_ids for model_type in ("qwen2_vl", "qwen2_5_vl", "qwen3_vl")}
GGUF_TOKEN_IDS["mistral3"] = {"image_token_index": "[IMG]"}
"""Config keys holding an image token's id -> the token, as the family's tokenizer has it."""

FAMILY_TOKENS = {"mistral3": ("[IMG]", "[IMG_BREAK]", "[IMG_END]")}
FAMILY_TOKENS.update({model_type: tuple(ids.values()) for model_type, ids in GGUF_TOKEN_IDS.items() if model_type != "mistral3"})
"""The family's image special tokens (Pixtral's rows end in [IMG_BREAK], the image in [IMG_END])."""

IMAGE_MARKUP = {"qwen2_vl": _QWEN_MARKUP, "qwen2_5_vl": _QWEN_MARKUP, "qwen3_vl": _QWEN_MARKUP, "mistral3": "[IMG]"}
"""What the family's chat template writes for an image part (the processor then repeats the image token)."""

EXACT_SIDES = {"qwen2_vl": 112, "qwen2_5_vl": 224, "qwen3_vl": 128, "mistral3": 64}
"""Image sides (px) each family's tiny processor and llama.cpp keep as they are, neither resampling:
16 merged Qwen2-VL tokens (llama.cpp's floor is 8), 64 for Qwen2.5-VL (four 112 px windows), 16
Qwen3-VL tokens from a position grid interpolated from 4 x 4 to 8 x 8, 4 x 4 Pixtral tokens."""


def gguf_config(model_type: str, *, text_overrides: dict | None = None, **vision_overrides):
    """`model_type`'s default image-text config with llama.cpp's tiny geometry (`vision_overrides`
    over the family's GGUF sizes and geometry)."""
    config = tiny_config(model_type, **GGUF_TEXT.get(model_type, {}), **(text_overrides or {}))
    shrink_vision(config.vision_config, GGUF_VISION_SIZES, {**GGUF_GEOMETRY.get(model_type, {}), **vision_overrides})
    for key, value in GGUF_TOP.get(model_type, {}).items():
        setattr(config, key, value)
    return config


def save_gguf_vlm(out_dir: Path, model_type: str, *, seed: int = 0, text_overrides: dict | None = None,
                  **vision_overrides) -> Path:
    """Save a tiny random image-text `model_type` at llama.cpp's geometry (and, for Idefics3, its
    tokenizer and processor as SmolVLM's; for the others the tests' tokenizer holding the family's
    image tokens and its image processor, from which the mmproj's image mean and std are read)."""
    import torch
    from tiny import make_tokenizer
    from transformers import AutoModelForImageTextToText, GenerationConfig

    out_dir = Path(out_dir)
    config = gguf_config(model_type, text_overrides=text_overrides, **vision_overrides)
    if model_type == "idefics3":
        tokenizer = _idefics3_processor(out_dir).tokenizer
        config.image_token_id = tokenizer.convert_tokens_to_ids("<image>")
    else:
        template = {"chat_template": chat_template(IMAGE_MARKUP[model_type])} if model_type in IMAGE_MARKUP else {}
        tokenizer = make_tokenizer(out_dir, **template)
        tokenizer.add_special_tokens({"additional_special_tokens": list(IMAGE_TOKENS)
                                      + list(FAMILY_TOKENS.get(model_type, ()))})
        tokenizer.save_pretrained(out_dir)
        _gguf_image_processor(model_type).save_pretrained(out_dir)
        for key, token in GGUF_TOKEN_IDS.get(model_type, {}).items():
            setattr(config, key, tokenizer.convert_tokens_to_ids(token))
    text = config.get_text_config()
    text.vocab_size = (len(tokenizer) + 31) // 32 * 32
    text.bos_token_id, text.eos_token_id, text.pad_token_id = (
        tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id)
    if model_type == "idefics3":
        text.eos_token_id = tokenizer.convert_tokens_to_ids("<end_of_utterance>")
    torch.manual_seed(seed)
    model = AutoModelForImageTextToText.from_config(config)
    _no_zero_weights(model, matrices_only=False)
    text = config.get_text_config()
    # Qwen-VL's generation_config.json ends a reply at <|im_end|> or <|endoftext|>, as llama.cpp does
    eos = [text.eos_token_id, text.pad_token_id] if model_type in FAMILY_TOKENS and model_type != "mistral3" else text.eos_token_id
    model.generation_config = GenerationConfig(bos_token_id=text.bos_token_id, eos_token_id=eos,
                                               pad_token_id=text.pad_token_id)
    model.save_pretrained(out_dir)
    return out_dir


def _gguf_image_processor(model_type: str):
    """The family's PIL image processor at the GGUF geometry (its preprocessor_config.json is what the
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
