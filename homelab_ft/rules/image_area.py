"""The area an image-text model's images are sized into: the recipe's `data.image_max_pixels` /
`data.image_min_pixels` bound each image's area, its aspect ratio kept. One rule for the data side,
which resizes each image with it and hands the same bounds to a processor that takes them
(data/images.py, data/image_rows.py), the planner, which counts an image's tokens at the largest
area the recipe allows through the same processor call (plan/shape/vision.image_tokens_at), and the
export, which tells llama.cpp the image tokens of training (export/gguf/image_text.image_tokens).

The area is bounded, not a side: image tokens grow with the area (a Qwen2-VL-style model spends one
token per 28 x 28 pixels), and a long receipt keeps its shape. Sides are rounded so the bound holds
(down when shrinking, up when enlarging); the processor then applies its own limits and rounding,
which for a processor that takes pixel bounds (Qwen2-VL's `min_pixels` / `max_pixels`) are the
recipe's: given at call time they replace the ones it was saved with, raising its cap as well as
lowering it (Qwen2VLImageProcessor._standardize_kwargs writes them over `size`).
Pure arithmetic: no PIL, no torch.
"""

from __future__ import annotations

import math

BOUND_KWARGS = ("max_pixels", "min_pixels")
"""The call-time keys an image processor takes pixel-area bounds under (Qwen2-VL, Qwen2.5-VL,
Qwen3-VL, GLM-4V ...: declared in the processor's `valid_kwargs`)."""


def bounded_size(height: int, width: int, *, max_pixels: int | None, min_pixels: int | None) -> tuple[int, int]:
    """(height, width) of an image of `height` x `width` pixels scaled, aspect ratio kept, so its area
    is at most `max_pixels` and at least `min_pixels` (None: no bound on that side); unchanged
    inside the bounds. Each side is at least 1 pixel (then the other side keeps the bound alone)."""
    area = height * width
    if max_pixels is not None and area > max_pixels:
        scale = math.sqrt(max_pixels / area)
        new_height = max(1, math.floor(height * scale))
        # a side held at one pixel leaves the other to keep the bound (a 1 x 10000 strip under 100: 1 x 100)
        new_width = max(1, min(math.floor(width * scale), max_pixels // new_height))
        return max(1, min(new_height, max_pixels // new_width)), new_width
    if min_pixels is not None and area < min_pixels:
        scale = math.sqrt(min_pixels / area)
        return math.ceil(height * scale), math.ceil(width * scale)
    return height, width


def processor_kwargs(image_processor, *, max_pixels: int | None, min_pixels: int | None) -> dict:
    """The recipe's bounds as the call-time arguments of `image_processor`, where it declares them in
    its `valid_kwargs` (Qwen2-VL's `min_pixels` / `max_pixels`); {} for the others, whose own size
    rule reads the already resized image."""
    declared = getattr(getattr(image_processor, "valid_kwargs", None), "__annotations__", {})
    wanted = dict(zip(BOUND_KWARGS, (max_pixels, min_pixels), strict=True))
    return {k: v for k, v in wanted.items() if v is not None and k in declared}


def taken_area(own: tuple[int, int], *, max_pixels: int | None, min_pixels: int | None) -> tuple[int, int]:
    """(fewest, most) pixels a processor that takes the recipe's bounds (`processor_kwargs`) sizes an
    image into, its own bounds being `own`: the recipe's where it sets one, its own elsewhere."""
    low, high = own
    return (low if min_pixels is None else min_pixels), (high if max_pixels is None else max_pixels)
