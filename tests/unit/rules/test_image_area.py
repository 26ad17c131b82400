"""rules/image_area.bounded_size: the area an image is resized into, its aspect ratio kept."""

from __future__ import annotations

import itertools

import pytest

from homelab_ft.rules.image_area import bounded_size


@pytest.mark.parametrize(("size", "max_pixels", "min_pixels", "expected"), [
    ((768, 768), None, None, (768, 768)),            # no bound: as it is
    ((1536, 1536), 768 * 768, None, (768, 768)),     # a square shrunk to the bound's square
    ((3000, 1000), 768 * 768, None, (1330, 443)),    # a tall receipt keeps its shape
    ((100, 50), 768 * 768, None, (100, 50)),         # inside the bound: untouched
    ((28, 14), None, 56 * 56, (80, 40)),              # a tiny crop enlarged to the least area
    ((28, 14), 768 * 768, 56 * 56, (80, 40)),
    ((1, 10000), 100, None, (1, 100)),                # a side never drops below one pixel
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
