"""Tiny checkpoints in the layouts released models ship, for the checkpoint-key tests.

`families.save_tiny` saves through `save_pretrained`, which writes transformers' *original* layout
back (it reverses the load conversions: per-expert MoE tensors, Nemotron-H's `backbone.*`), so a
MoE or Nemotron-H tiny model is already in the released layout. A multimodal family (Qwen 3.5,
whose released checkpoints are `...ForConditionalGeneration` with `model.language_model.*`) is
built as its multimodal model with a shrunk vision tower and saved the same way.
"""

from __future__ import annotations

from pathlib import Path

from families import save_tiny, tiny_config

_TINY_VISION = {"depth": 1, "num_hidden_layers": 1, "hidden_size": 32, "intermediate_size": 64, "num_heads": 2,
                "num_attention_heads": 2}
"""Vision-tower size keys, applied where the vision config has them (its `out_hidden_size` follows the text's)."""


def save_multimodal(out_dir: Path, model_type: str, *, seed: int = 0) -> Path:
    """A tiny `model_type` image-text model (its text decoder from families.tiny_config), saved."""
    import torch
    from tiny import make_tokenizer
    from transformers import AutoModelForImageTextToText

    out_dir = Path(out_dir)
    make_tokenizer(out_dir, vocab_size=tiny_config(model_type).text_config.vocab_size)
    config = tiny_config(model_type)
    vision = config.vision_config
    for key, value in _TINY_VISION.items():
        if hasattr(vision, key):
            setattr(vision, key, value)
    if hasattr(vision, "out_hidden_size"):
        vision.out_hidden_size = config.text_config.hidden_size
    torch.manual_seed(seed)
    AutoModelForImageTextToText.from_config(config).save_pretrained(out_dir)
    return out_dir


MULTIMODAL = ("qwen3_5", "qwen3_5_moe")
"""Released as image-text checkpoints (`model.language_model.*`) whose text decoder is fine-tuned alone."""
LEGACY_IMAGE_TEXT = ("gemma3",)
"""Image-text families AutoModelForCausalLM builds whole (Gemma 3), whose save_pretrained writes the
legacy `language_model.model.*` layout that transformers' llava mapping renames on load."""
ORIGINAL_LAYOUT = ("qwen3_next", "glm4_moe", "deepseek_v3", "phimoe", "mixtral", "nemotron_h")
"""Saved with per-expert tensors (and `backbone.*`) by save_pretrained's reversed conversion."""


def save_original(out_dir: Path, model_type: str, *, seed: int = 0, **overrides) -> Path:
    """`model_type` saved in its released layout; `overrides` change its (text) config."""
    if model_type in MULTIMODAL + LEGACY_IMAGE_TEXT:
        return save_multimodal(out_dir, model_type, seed=seed)
    return save_tiny(out_dir, model_type, seed=seed, **overrides)


def saved_keys(model_dir: Path) -> set[str]:
    """Every tensor name the safetensors files of `model_dir` hold."""
    from safetensors import safe_open

    keys = set()
    for path in Path(model_dir).glob("*.safetensors"):
        with safe_open(str(path), framework="pt") as fh:
            keys |= set(fh.keys())
    return keys
