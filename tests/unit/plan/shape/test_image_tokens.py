"""Image tokens per image (plan/shape/derive.image_tokens_at, cached by plan/shape/cache.py) against
what transformers itself does with an image of that size, table-driven over sizes the measurement
never saw (tests/vision_checks.TOKEN_SIZES: wide, tall, small, large):
- the real model accepts exactly that many image tokens beside the image (its own "Image features and
  image tokens do not match" check refuses one more): Qwen2-VL, whose count grows with the image
  (tests/e2e/test_vision_families.py: the other eight families, Gemma 3's fixed count, Pixtral's and
  SmolVLM's tiles among them, and the real Gemma 3, Llava and PaliGemma processors' expansion);
- Qwen2-VL's count against its image processor's own `get_number_of_image_patches`, which
  Qwen2VLProcessor._get_num_multimodal_tokens divides by the merge, at its cap and a recipe's bound;
- more pixels never give fewer tokens."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[4]
sys.path.insert(0, str(ROOT / "tests"))
from tiny_vlm import UNIT_FAMILIES, image_processor  # noqa: E402
from vision_checks import TOKEN_SIZES, check_accepted_tokens, check_more_pixels, counted_tokens  # noqa: E402


@pytest.mark.parametrize("model_type", UNIT_FAMILIES)
def test_the_model_accepts_exactly_the_counted_image_tokens(model_type, vlm_folders):
    check_accepted_tokens(vlm_folders[model_type])


def test_a_dynamic_count_is_the_image_processors_own_patches_over_the_merge(vlm_folders):
    """At the tiny processor's own cap (16 tokens) and at a recipe's bound that raises it (as the data
    side passes it: rules/image_area.processor_kwargs)."""
    from homelab_ft.plan.shape.cache import cached_image_tokens

    pixels = image_processor("qwen2_vl")
    merge = pixels.merge_size ** 2
    for bound in (None, 1000 * 1000):
        kwargs = {"max_pixels": bound} if bound else {}
        expected = tuple(pixels.get_number_of_image_patches(h, w, kwargs) // merge for h, w in TOKEN_SIZES)
        config = json.loads((vlm_folders["qwen2_vl"] / "config.json").read_text())
        assert cached_image_tokens(config, sizes=TOKEN_SIZES, model_path=str(vlm_folders["qwen2_vl"]),
                                   max_pixels=bound) == expected
    assert expected[1] == (336 // 28) * (448 // 28)  # smart_resize keeps a size already on the 28 px grid
    assert max(counted_tokens(vlm_folders["qwen2_vl"])) <= 16  # the processor's own cap


@pytest.mark.parametrize("model_type", UNIT_FAMILIES)
def test_more_pixels_never_give_fewer_tokens(model_type, vlm_folders):
    check_more_pixels(vlm_folders[model_type])
