"""data/images.py's pure parts: what an image part names, and the resize it reads the image with."""

from __future__ import annotations

import pytest

from homelab_ft.data import images


@pytest.mark.parametrize("value, problem", [
    ("http://example.com/a.png", "is a URL"),
    ("data:text/plain;base64,aGk=", "is a data URI but not data:image"),
    ({"url": ""}, "has no image"),
    ("nowhere.png", "names the image .*nowhere.png, which does not exist"),
])
def test_an_image_part_that_names_no_local_image_says_why(value, problem, tmp_path):
    with pytest.raises(images.ImageError, match=problem):
        images.resolve(value, base_dir=tmp_path)


def test_an_image_is_read_resized_by_the_rule_the_planner_counts_at(tmp_path):
    """images.load resizes into the recipe's area by rules/image_area.bounded_size: (height, width)
    there, (width, height) as Pillow sizes it."""
    from PIL import Image

    from homelab_ft.rules.image_area import bounded_size

    Image.new("RGB", (400, 300)).save(tmp_path / "a.png")
    image = images.load(str(tmp_path / "a.png"), max_pixels=28 * 28 * 16, min_pixels=56 * 56)
    assert image.size[::-1] == bounded_size(300, 400, max_pixels=28 * 28 * 16, min_pixels=56 * 56) == (96, 129)
    assert images.load(str(tmp_path / "a.png"), max_pixels=None, min_pixels=None).size == (400, 300)
