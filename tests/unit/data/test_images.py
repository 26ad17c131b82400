"""data/images.py's pure parts: the resize bounds (aspect kept) and which pixel bounds a processor takes."""

from __future__ import annotations

import pytest

from homelab_ft.data import images


@pytest.mark.parametrize("size, bounds, expected", [
    ((100, 50), (None, None), (100, 50)),
    ((100, 50), (2000, None), (63, 31)),  # sqrt(2000 / 5000) = 0.632: both sides, the ratio kept
    ((10, 5), (None, 200), (20, 10)),
    ((3, 1), (None, 10), (6, 2)),  # floor would give 5 x 1 = 5 < 10 pixels: rounded up instead
    ((4000, 3000), (28 * 28 * 16, 56 * 56), (129, 96)),  # 12,384 of the 12,544 allowed
])
def test_target_size_keeps_the_aspect_inside_the_bounds(size, bounds, expected):
    max_pixels, min_pixels = bounds
    width, height = images.target_size(*size, max_pixels=max_pixels, min_pixels=min_pixels)
    assert (width, height) == expected
    if max_pixels:
        assert width * height <= max_pixels
    if min_pixels:
        assert width * height >= min_pixels
    assert abs(width / height - size[0] / size[1]) < 0.1


def test_only_a_processor_that_declares_pixel_bounds_gets_them():
    from transformers import LlavaImageProcessorPil, Qwen2VLImageProcessorPil

    assert images.processor_kwargs(Qwen2VLImageProcessorPil(), max_pixels=1000, min_pixels=None) == {"max_pixels": 1000}
    assert images.processor_kwargs(LlavaImageProcessorPil(), max_pixels=1000, min_pixels=10) == {}


@pytest.mark.parametrize("value, problem", [
    ("http://example.com/a.png", "is a URL"),
    ("data:text/plain;base64,aGk=", "is a data URI but not data:image"),
    ({"url": ""}, "has no image"),
    ("nowhere.png", "names the image .*nowhere.png, which does not exist"),
])
def test_an_image_part_that_names_no_local_image_says_why(value, problem, tmp_path):
    with pytest.raises(images.ImageError, match=problem):
        images.resolve(value, base_dir=tmp_path)
