"""The size an image is resized to before an image-text model's processor reads it: the recipe's
`data.image_max_pixels` / `data.image_min_pixels` bound its area, its aspect ratio kept. One rule for
the data side, which resizes each image with it, and the planner, which prices an image's tokens at
the largest area the recipe allows (plan/shape/vision.image_tokens_at).

The area is bounded, not a side: image tokens grow with the area (a Qwen2-VL-style model spends one
token per 28 x 28 pixels), and a long receipt keeps its shape. Sides are rounded so the bound holds
(down when shrinking, up when enlarging); the processor then applies its own limits and rounding.
Pure arithmetic: no PIL, no torch.
"""

from __future__ import annotations

import math


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
