"""Tiny random image-text models with their processors, saved to disk the way a released checkpoint
is, so tests load them through `AutoModelForImageTextToText` + `AutoProcessor`, offline.

Each family is built from its real config class (`CONFIG_MAPPING[model_type]()`, the text side
shrunk by families.tiny_config's table, the vision side by `VISION_SIZES`), a byte-level BPE
tokenizer holding the family's image special tokens (under the attribute names its processor reads,
`extra_special_tokens`), the family's PIL image processor (no torchvision here) sized to the tiny
tower, and a ChatML template that writes an image part the way the family's own template does
(Qwen2-VL's `<|vision_start|><|image_pad|><|vision_end|>`, Gemma 3's `<start_of_image>`, ...).

    save_vlm(out_dir, "qwen2_vl", seed=0) -> out_dir      the model, processor, tokenizer, template
    save_vlm(out_dir, "qwen2_vl", weights=False)          config.json and the processor only (data tests)
    make_image(path, size=(w, h), colour=(r, g, b))       a solid PNG (the rows' images)
    image_chat("img/red.png", "what colour?", "red")      a chat row asking about one image
    VLM_FAMILIES                                         the families a test may name

What was found building them here (transformers 5.25, no torchvision): every family below has a PIL
image processor (`*ImageProcessorPil`). A processor class that lists a `video_processor` (Qwen2-VL,
Qwen2.5-VL, Qwen3-VL, InternVL) cannot be constructed at all without torchvision (ProcessorMixin
checks each part against `VideoProcessorMixin`, which needs it), so it is built and loaded as
model/processor.py's `without_video` class, saved under the family's own processor name. Not built:
Mistral 3 (Pixtral's processor module imports torchvision), SmolVLM (its processor needs the
`num2words` package, not installed; Idefics3 is the same architecture and tiling and is built),
PaliGemma (a prefix-LM processor that writes its own labels).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from families import tiny_config

VISION_SIZES = {
    "hidden_size": 32,
    "embed_dim": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "depth": 2,
    "num_attention_heads": 2,
    "num_heads": 2,
    "head_dim": 16,
    "projection_dim": 32,
    "num_position_embeddings": 64,
}
"""Vision tower sizes, applied where the family's vision config has the key (as families._TINY_SIZES is)."""


@dataclass(frozen=True)
class Family:
    """What a family's checkpoint needs beyond its config class: the image tokens and how the template
    writes an image, the tower's image geometry and the processor's matching settings."""

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
    text: dict = field(default_factory=dict)
    """text_config keys beyond families' tiny sizes (Qwen's M-RoPE sections sized to the tiny head)."""
    image_processor: dict = field(default_factory=dict)
    """The PIL image processor's settings, sized to the tiny tower."""
    processor: dict = field(default_factory=dict)
    """The processor's own settings (tokens per image, patch size)."""
    extra_tokens: tuple[str, ...] = ()
    """Further special tokens the processor writes (SmolVLM's tile rows and columns)."""


_QWEN_TOKENS = {"image_token": "<|image_pad|>", "video_token": "<|video_pad|>",
                "vision_start_token": "<|vision_start|>", "vision_end_token": "<|vision_end|>"}
_QWEN_IDS = {"image_token_id": "<|image_pad|>", "video_token_id": "<|video_pad|>",
             "vision_start_token_id": "<|vision_start|>", "vision_end_token_id": "<|vision_end|>"}
_QWEN_PIXELS = {"min_pixels": 28 * 28, "max_pixels": 28 * 28 * 16}
"""A Qwen-style image is one token per 28x28 pixels (patch 14, merge 2): 1 to 16 tokens here."""

VLM_FAMILIES = {
    "qwen2_vl": Family(
        named_tokens=_QWEN_TOKENS, image_text="<|vision_start|><|image_pad|><|vision_end|>",
        config_ids=_QWEN_IDS, vision={"hidden_size": 64, "patch_size": 14, "spatial_merge_size": 2},
        text={"rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]}},
        image_processor=_QWEN_PIXELS),
    "qwen2_5_vl": Family(
        named_tokens=_QWEN_TOKENS, image_text="<|vision_start|><|image_pad|><|vision_end|>",
        config_ids=_QWEN_IDS, vision={"out_hidden_size": 64, "window_size": 56, "fullatt_block_indexes": [1]},
        text={"rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]}},
        image_processor=_QWEN_PIXELS),
    "qwen3_vl": Family(
        named_tokens=_QWEN_TOKENS, image_text="<|vision_start|><|image_pad|><|vision_end|>",
        config_ids=_QWEN_IDS, vision={"out_hidden_size": 64, "patch_size": 16, "deepstack_visual_indexes": [0]},
        text={"rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3],
                                  "mrope_interleaved": True}},
        image_processor={"min_pixels": 32 * 32, "max_pixels": 32 * 32 * 16, "patch_size": 16}),
    "llava": Family(
        named_tokens={"image_token": "<image>"}, image_text="<image>\n",
        config_ids={"image_token_id": "<image>"}, vision={"image_size": 28, "patch_size": 7},
        top={"image_seq_length": 16},
        image_processor={"size": {"shortest_edge": 28}, "crop_size": {"height": 28, "width": 28}},
        processor={"patch_size": 7, "vision_feature_select_strategy": "default", "num_additional_image_tokens": 1}),
    "llava_next": Family(
        named_tokens={"image_token": "<image>"}, image_text="<image>\n",
        config_ids={"image_token_id": "<image>"}, vision={"image_size": 28, "patch_size": 7},
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
        named_tokens={"image_token": "<image>", "fake_image_token": "<fake_token_around_image>",
                      "global_image_token": "<global-img>", "end_of_utterance_token": "<end_of_utterance>"},
        image_text="<image>", config_ids={"image_token_id": "<image>"},
        vision={"image_size": 32, "patch_size": 8}, top={"scale_factor": 2},
        extra_tokens=tuple(f"<row_{r}_col_{c}>" for r in range(1, 4) for c in range(1, 4)),
        image_processor={"size": {"longest_edge": 96}, "max_image_size": {"longest_edge": 32}},
        processor={"image_seq_len": 4}),
    "internvl": Family(
        named_tokens={"start_image_token": "<img>", "end_image_token": "</img>",
                      "context_image_token": "<IMG_CONTEXT>", "video_token": "<video>"},
        image_text="<IMG_CONTEXT>\n", config_ids={"image_token_id": "<IMG_CONTEXT>"},
        vision={"image_size": [28, 28], "patch_size": [7, 7]}, top={"image_seq_length": 4},
        image_processor={"size": {"height": 28, "width": 28}, "max_patches": 4}, processor={"image_seq_length": 4}),
}


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


def make_vlm_tokenizer(out_dir: Path, family: Family, *, vocab_size: int = 320):
    """The tests' byte-level BPE (tiny.make_tokenizer) with the family's image tokens added as
    special tokens, the named ones as the attributes its processor reads."""
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


def tiny_vlm_config(model_type: str, tokenizer):
    """The family's default config, text and vision sides shrunk, its token ids those of `tokenizer`."""
    family = VLM_FAMILIES[model_type]
    config = tiny_config(model_type, **family.text)
    vision = config.vision_config
    present = vision.to_dict()
    for key, value in {**{k: v for k, v in VISION_SIZES.items() if k in present}, **family.vision}.items():
        setattr(vision, key, value)
    vocab = (len(tokenizer) + 31) // 32 * 32
    config.text_config.vocab_size = vocab
    if "vocab_size" in config.to_dict() and not isinstance(type(config).__dict__.get("vocab_size"), property):
        config.vocab_size = vocab
    for key, value in family.top.items():
        setattr(config, key, value)
    for key, token in family.config_ids.items():
        setattr(config, key, tokenizer.convert_tokens_to_ids(token))
    for key, value in {"pad_token_id": tokenizer.pad_token_id, "bos_token_id": tokenizer.bos_token_id,
                       "eos_token_id": tokenizer.eos_token_id}.items():
        setattr(config.text_config, key, value)
    return config


def make_processor(model_type: str, tokenizer):
    """The family's processor: its PIL image processor sized to the tiny tower, the tokenizer, the template."""
    import transformers
    from transformers.models.auto.image_processing_auto import IMAGE_PROCESSOR_MAPPING_NAMES
    from transformers.models.auto.processing_auto import PROCESSOR_MAPPING_NAMES

    family = VLM_FAMILIES[model_type]
    image_processor = getattr(transformers, IMAGE_PROCESSOR_MAPPING_NAMES[model_type]["pil"])(**family.image_processor)
    processor_class = getattr(transformers, PROCESSOR_MAPPING_NAMES[model_type])
    from homelab_ft.model.processor import without_video

    processor_class = without_video(processor_class)
    return processor_class(image_processor=image_processor, tokenizer=tokenizer,
                           chat_template=tokenizer.chat_template, **family.processor)


def save_vlm(out_dir: Path, model_type: str, *, seed: int = 0, weights: bool = True) -> Path:
    """Save a tiny random `model_type` image-text model with its processor (image processor config,
    tokenizer, chat template) to `out_dir`, as `save_pretrained` writes a released checkpoint;
    `weights=False`: config.json and the processor only (enough for the data pipeline)."""
    import torch
    from transformers import AutoModelForImageTextToText, GenerationConfig

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tokenizer = make_vlm_tokenizer(out_dir, VLM_FAMILIES[model_type])
    config = tiny_vlm_config(model_type, tokenizer)
    make_processor(model_type, tokenizer).save_pretrained(out_dir)
    if not weights:
        config.save_pretrained(out_dir)
        return out_dir
    torch.manual_seed(seed)
    model = AutoModelForImageTextToText.from_config(config)
    with torch.no_grad():  # Gemma 3's projector starts at zeros, which would hide the image from the model
        for param in model.parameters():
            if param.ndim >= 2 and not param.any():
                param.normal_(std=0.02)
    model.generation_config = GenerationConfig(bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                                               pad_token_id=tokenizer.pad_token_id)
    model.save_pretrained(out_dir)
    return out_dir


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
