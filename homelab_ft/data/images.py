"""Images in chat rows (`data.images`): the content parts a row may hold, where each image is read
from, and the resize `data.image_max_pixels` / `data.image_min_pixels` ask for.

A message's `content` is a string or a list of parts (OpenAI's layout, as transformers' chat
templates read it):

    {"type": "text", "text": "What is on the receipt?"}
    {"type": "image", "path": "receipts/0001.png"}              relative to the data file's folder
    {"type": "image", "image": "data:image/png;base64,iVBOR..."} the image itself, base64

A URL is refused in one line (nothing is downloaded at run time), as is an image in an assistant
turn (the model writes text). A missing or unreadable file is a bad row naming its path, which
`data.bad_rows` stops on or skips. The canonical part of an image is `{"type": "image", "image":
ref}`, `ref` the absolute path or the data URI; the chat template sees `{"type": "image"}`.

The resize happens here, before the processor's own, by rules/image_area.py (the rule the planner
counts an image's tokens at): an image above `image_max_pixels` (width x height) is shrunk into that
area and one below `image_min_pixels` enlarged to it, the aspect ratio kept (Pillow's bicubic); a
processor that takes pixel bounds itself (Qwen2-VL's `min_pixels` / `max_pixels`, which it snaps to
its 28-pixel grid) is given the same bounds (image_area.processor_kwargs, which replace its own), so
its rounding stays inside them. Torch-free.
"""

from __future__ import annotations

import base64
import binascii
import io
import os
from pathlib import Path

from homelab_ft.rules.image_area import bounded_size

DATA_URI = "data:image/"
URL_SCHEMES = ("http://", "https://", "ftp://", "s3://", "gs://", "hf://", "file://")


class ImageError(ValueError):
    """An image part that names no readable image (the caller adds file, row and field)."""


def resolve(value, *, base_dir: Path | None) -> str:
    """An image part's `path` / `image` (or OpenAI's `image_url.url`) as its ref: the data URI, or the
    file's absolute path; ImageError with the problem for a URL, a missing or unreadable file."""
    if isinstance(value, dict):  # OpenAI's {"type": "image_url", "image_url": {"url": ...}}
        value = value.get("url")
    if not isinstance(value, str) or not value:
        raise ImageError("has no image: give its file as path, or the image itself as a data:image/...;base64 URI")
    if value.startswith(URL_SCHEMES):
        raise ImageError(f"is a URL ({value[:60]}); images are read from local files or data: URIs, nothing is "
                         "downloaded: save the image beside the data and give its path")
    if value.startswith("data:"):
        if not value.startswith(DATA_URI) or ";base64," not in value[:80]:
            raise ImageError("is a data URI but not data:image/<type>;base64,<data>")
        return value
    path = Path(value) if Path(value).is_absolute() or base_dir is None else base_dir / value
    if not path.is_file():
        raise ImageError(f"names the image {path}, which does not exist")
    if not os.access(path, os.R_OK):
        raise ImageError(f"names the image {path}, which cannot be read (permissions)")
    return str(path.resolve())


def image_refs(messages: list[dict]) -> list[str]:
    """Every image's ref, in the order the conversation shows them."""
    return [p["image"] for m in messages if isinstance(m["content"], list) for p in m["content"] if p["type"] == "image"]


def for_template(messages: list[dict]) -> list[dict]:
    """The conversation as a chat template reads it: image parts without their refs."""
    return [{**m, "content": [{"type": "image"} if p["type"] == "image" else p for p in m["content"]]}
            if isinstance(m["content"], list) else m for m in messages]


def text_view(content) -> str:
    """A message's text (image parts left out), for the canonical sample's string `content`."""
    return content if isinstance(content, str) else "".join(p["text"] for p in content if p["type"] == "text")


def describe(ref: str) -> str:
    """A ref as an error message names it: the path, or the start of the data URI."""
    return ref if not ref.startswith("data:") else ref[:40] + "..."


def load(ref: str, *, max_pixels: int | None, min_pixels: int | None):
    """The image `ref` names as RGB, resized into [min_pixels, max_pixels] (aspect kept); ImageError
    when it cannot be read."""
    from PIL import Image, UnidentifiedImageError

    try:
        if ref.startswith("data:"):
            raw = base64.b64decode(ref.split(",", 1)[1], validate=True)
            image = Image.open(io.BytesIO(raw))
        else:
            image = Image.open(ref)
        image.load()
    except (OSError, UnidentifiedImageError, binascii.Error, ValueError) as err:
        raise ImageError(f"image {describe(ref)} cannot be read ({type(err).__name__}: "
                         f"{str(err).splitlines()[0][:120] if str(err) else ''})") from None
    return resized(image.convert("RGB"), max_pixels=max_pixels, min_pixels=min_pixels)


def resized(image, *, max_pixels: int | None, min_pixels: int | None):
    """`image` resized into the recipe's area (rules/image_area.bounded_size, the rule the planner
    counts tokens at), bicubic; the image itself when it is inside."""
    from PIL import Image

    height, width = bounded_size(image.height, image.width, max_pixels=max_pixels, min_pixels=min_pixels)
    return image if (width, height) == image.size else image.resize((width, height), Image.Resampling.BICUBIC)
