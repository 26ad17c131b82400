"""rules/image_area.py: the area an image is resized into (its aspect ratio kept), the bounds a
processor that takes them is given, and the area it then sizes images into."""

from __future__ import annotations

import itertools

import pytest

from homelab_ft.rules.image_area import bounded_size, processor_kwargs, taken_area


@pytest.mark.parametrize(("size", "max_pixels", "min_pixels", "expected"), [
    ((768, 768), None, None, (768, 768)),            # no bound: as it is
    ((1536, 1536), 768 * 768, None, (768, 768)),     # a square shrunk to the bound's square
    ((3000, 1000), 768 * 768, None, (1330, 443)),    # a tall receipt keeps its shape
    ((100, 50), 768 * 768, None, (100, 50)),         # inside the bound: untouched
    ((28, 14), None, 56 * 56, (80, 40)),              # a tiny crop enlarged to the least area
    ((28, 14), 768 * 768, 56 * 56, (80, 40)),
    ((1, 10000), 100, None, (1, 100)),                # a side never drops below one pixel
    ((50, 100), 2000, None, (31, 63)),                # sqrt(2000 / 5000) = 0.632: both sides, the ratio kept
    ((5, 10), None, 200, (10, 20)),
    ((1, 3), None, 10, (2, 6)),                       # rounded up: 1 x 5 would be 5 < 10 pixels
    ((3000, 4000), 28 * 28 * 16, 56 * 56, (96, 129)),  # 12,384 of the 12,544 allowed
])
def test_bounded_size(size, max_pixels, min_pixels, expected):
    assert bounded_size(*size, max_pixels=max_pixels, min_pixels=min_pixels) == expected


@pytest.mark.parametrize(("height", "width"), list(itertools.product((7, 224, 999, 4032), (9, 336, 1280, 3024))))
def test_the_bounds_hold_and_the_aspect_ratio_is_kept(height, width):
    lo, hi = 200 * 200, 800 * 800
    h, w = bounded_size(height, width, max_pixels=hi, min_pixels=lo)
    inside = lo <= height * width <= hi
    assert (h, w) == (height, width) if inside else (h * w <= hi if height * width > hi else h * w >= lo)
    assert abs(h / w - height / width) <= (height / width) * (1 / min(h, w)) + 1e-9


def test_only_a_processor_that_declares_pixel_bounds_gets_them():
    from transformers import LlavaImageProcessorPil, Qwen2VLImageProcessorPil

    assert processor_kwargs(Qwen2VLImageProcessorPil(), max_pixels=1000, min_pixels=None) == {"max_pixels": 1000}
    assert processor_kwargs(Qwen2VLImageProcessorPil(), max_pixels=1000, min_pixels=10) == {"max_pixels": 1000,
                                                                                           "min_pixels": 10}
    assert processor_kwargs(LlavaImageProcessorPil(), max_pixels=1000, min_pixels=10) == {}


def test_given_bounds_replace_the_processors_own_raising_its_cap_as_well_as_lowering_it():
    """What Qwen2VLImageProcessor does with min_pixels / max_pixels at call time (written over its
    saved `size`): a 448 px square under its own 16-token cap is 8 x 8 patches, and 32 x 32 with
    the recipe's 448 x 448 bound; taken_area says the same of the bounds."""
    from PIL import Image
    from transformers import Qwen2VLImageProcessorPil

    own = (28 * 28, 28 * 28 * 16)
    processor = Qwen2VLImageProcessorPil(min_pixels=own[0], max_pixels=own[1])
    image = Image.new("RGB", (448, 448))

    def grid(**bounds):
        return processor(images=[image], return_tensors="pt", **bounds)["image_grid_thw"].tolist()[0][1:]

    assert grid() == [8, 8] and grid(**processor_kwargs(processor, max_pixels=448 * 448, min_pixels=None)) == [32, 32]
    assert grid(**processor_kwargs(processor, max_pixels=56 * 56, min_pixels=None)) == [4, 4]
    assert taken_area(own, max_pixels=448 * 448, min_pixels=None) == (28 * 28, 448 * 448)
    assert taken_area(own, max_pixels=None, min_pixels=56 * 56) == (56 * 56, 28 * 28 * 16)
