"""Image tokens per image (plan/shape/derive.image_tokens_at, cached by plan/shape/cache.py) against
what transformers itself does with an image of that size, table-driven over sizes the measurement
never saw (wide, tall, small, large):
- the real model accepts exactly that many image tokens beside the image (its own "Image features and
  image tokens do not match" check refuses one more), on six families: Qwen2-VL and Pixtral (Mistral 3)
  whose count grows with the image, SmolVLM's tiles, and Gemma 3, Llava, PaliGemma's fixed counts;
- the real processor expands the image placeholder to that many tokens where it can be built here
  (Llava, PaliGemma, Gemma 3); Qwen2-VL's cannot (its video processor needs torchvision, which cannot be
  installed beside this torch), so its count is checked against its image processor's own
  `get_number_of_image_patches`, which Qwen2VLProcessor._get_num_multimodal_tokens divides by the merge;
- more pixels never give fewer tokens."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[4]
sys.path.insert(0, str(ROOT / "tests"))
from vision_families import IMAGE_TOKEN, image_processor, save_tiny_vision  # noqa: E402

from homelab_ft.plan.shape.cache import cached_image_tokens  # noqa: E402

SIZES = ((84, 112), (336, 448), (300, 1000), (1000, 300))
"""(height, width) of the images counted: none of them the measurement's squares."""
FAMILIES = ("qwen2_vl", "mistral3", "smolvlm", "gemma3", "llava", "paligemma")


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("image-tokens")
    return {family: save_tiny_vision(root / family, family, with_tokenizer=False) for family in FAMILIES}


def _counted(folder: Path, sizes=SIZES) -> tuple[int, ...]:
    return cached_image_tokens(json.loads((folder / "config.json").read_text()), sizes=sizes, model_path=str(folder))


def _blank(height: int, width: int):
    from PIL import Image

    return Image.new("RGB", (width, height))


@pytest.mark.parametrize("model_type", FAMILIES)
def test_the_model_accepts_exactly_the_counted_image_tokens(model_type, folders):
    import torch
    from transformers import AutoImageProcessor, AutoModelForImageTextToText

    folder = folders[model_type]
    model = AutoModelForImageTextToText.from_pretrained(folder)
    processor = AutoImageProcessor.from_pretrained(folder, backend="pil")
    start = [model.config.vision_start_token_id] if getattr(model.config, "vision_start_token_id", None) else []
    for (height, width), tokens in zip(SIZES, _counted(folder), strict=True):
        pixels = {k: v for k, v in processor(images=[_blank(height, width)], return_tensors="pt").items()
                  if k not in ("num_crops", "num_patches")}

        def forward(count: int):
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


def _processor(model_type: str):
    """The family's real processor with the tests' tokenizer (its special tokens added), and the
    text and token of one image placeholder."""
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
    return (transformers.Gemma3Processor(image_processor=image_processor("gemma3"), tokenizer=_tokenizer(list(tokens.values()), **tokens),
                                         image_seq_length=4), "<start_of_image>hi", "<image_soft_token>")


@pytest.mark.parametrize("model_type", ["llava", "paligemma", "gemma3"])
def test_the_real_processor_expands_an_image_to_the_counted_tokens(model_type, folders):
    processor, text, token = _processor(model_type)
    token_id = processor.tokenizer.convert_tokens_to_ids(token)
    for (height, width), tokens in zip(SIZES, _counted(folders[model_type]), strict=True):
        ids = processor(text=[text], images=[_blank(height, width)], return_tensors="pt")["input_ids"]
        assert int((ids == token_id).sum()) == tokens


def test_a_dynamic_count_is_the_image_processors_own_patches_over_the_merge(folders):
    pixels = image_processor("qwen2_vl")
    merge = pixels.merge_size ** 2
    expected = tuple(pixels.get_number_of_image_patches(h, w, {}) // merge for h, w in SIZES)
    assert _counted(folders["qwen2_vl"]) == expected
    assert expected[1] == (336 // 28) * (448 // 28)  # smart_resize keeps a size already on the 28 px grid


@pytest.mark.parametrize("model_type", ["qwen2_vl", "mistral3", "smolvlm", "gemma3"])
def test_more_pixels_never_give_fewer_tokens(model_type, folders):
    sides = tuple((side, side * 4 // 3) for side in range(56, 1008, 112))
    counted = _counted(folders[model_type], sides)
    assert list(counted) == sorted(counted) and counted[0] > 0
