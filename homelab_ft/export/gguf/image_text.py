"""The GGUF export of an image-text model: its language model as a text GGUF (through text_view.py,
by the same writer and check as any text model) and its vision tower and projector as llama.cpp's
mmproj beside it (mmproj.py, checked by mmproj_check.py).

`check_writable` decides from the base checkpoint, before anything is written, whether the pair can
be written; `text_model` lays out the language model of the merged export for the text GGUF;
`write_mmproj` writes and checks the mmproj. export/run.py calls the three.
"""

from __future__ import annotations

import logging
import tempfile
from dataclasses import dataclass
from pathlib import Path

from homelab_ft.errors import UserError
from homelab_ft.export.gguf import arch as gguf_arch
from homelab_ft.export.gguf import mmproj as gguf_mmproj
from homelab_ft.export.gguf import text_view

log = logging.getLogger(__name__)


def is_image_text(model_dir: Path) -> bool:
    return text_view.image_text_config(model_dir) is not None


def check_writable(model_dir: Path) -> None:
    """GgufUnsupported in one line when the image-text checkpoint `model_dir` cannot be written as
    GGUF + mmproj: no llama.cpp projector read for its class, a vision tensor gguf-py has no place
    for, no image processor settings, or a language model the text writer refuses."""
    from homelab_ft.export.gguf import check as gguf_check

    config = text_view.image_text_config(model_dir)
    gguf_mmproj.projector_for(config)
    try:
        text_view.text_names(config)
        gguf_mmproj.plan_mmproj(model_dir, gguf_type="f32")
    except gguf_arch.GgufUnsupported:
        raise
    except UserError as err:
        raise gguf_arch.GgufUnsupported(str(err)) from err
    with tempfile.TemporaryDirectory(prefix="gguf-text-config-") as folder:
        text_view.write_text_config(config, Path(model_dir), Path(folder))
        target = gguf_arch.check_architecture(Path(folder))
        gguf_check.check_window(Path(folder), target=target)


def text_model(hf_dir: Path, scratch: Path) -> Path:
    """`hf_dir` itself for a text model; for an image-text one, its language model laid out as a
    causal-LM folder in `scratch` (text_view.py), which the text GGUF is written and checked from."""
    return text_view.write_text_view(hf_dir, scratch) if is_image_text(hf_dir) else hf_dir


@dataclass(frozen=True)
class WrittenMmproj:
    file: str
    gguf_type: str
    projector_type: str
    max_abs_diff: float
    bound: float
    image_tokens: tuple[int, int] | None = None
    """(fewest, most) tokens an image was sized into in training, which RUNNING.md passes to llama.cpp
    as --image-min-tokens / --image-max-tokens where it sizes images by the same rule; else None."""

    def as_dict(self) -> dict:
        return {"file": self.file, "type": self.gguf_type, "projector": self.projector_type,
                "max_abs_diff": self.max_abs_diff, "bound": self.bound,
                "image_tokens": list(self.image_tokens) if self.image_tokens else None}


def write_mmproj(hf_dir: Path, out: Path, *, gguf_type: str, name: str, base_dir: Path,
                 pixels: tuple[int | None, int | None] = (None, None)) -> WrittenMmproj:
    """The mmproj of `hf_dir` in `out`, in the type mmproj_type picks for a text GGUF of `gguf_type`,
    read back and compared with the model before it is reported. The image processor's settings are
    the export's own where it holds the processor's files, else the base's (`base_dir`): training
    changes the weights, not how images are prepared. `pixels`: the run's data.image_min_pixels /
    image_max_pixels, the area its images were resized into before the processor read them."""
    from homelab_ft.export.gguf import mmproj_check

    kind = gguf_mmproj.mmproj_type(gguf_type)
    file = gguf_mmproj.MMPROJ_FILE.format(gguf_type=kind)
    processor_dir = hf_dir if gguf_mmproj.has_processor(hf_dir) else base_dir
    plan = gguf_mmproj.write_mmproj(hf_dir, out / file, gguf_type=kind, name=name, processor_dir=processor_dir)
    check = mmproj_check.verify_mmproj(out / file, hf_dir, gguf_type=kind, processor_dir=processor_dir)
    log.info("mmproj check (%s): %s", kind, check.describe())
    return WrittenMmproj(file=file, gguf_type=kind, projector_type=plan.projector.projector_type,
                         max_abs_diff=check.max_abs_diff, bound=check.bound,
                         image_tokens=image_tokens(plan, processor_dir, pixels=pixels))


def image_tokens(plan, processor_dir: Path, *, pixels: tuple[int | None, int | None]) -> tuple[int, int] | None:
    """(fewest, most) image tokens of training: the processor's pixel bounds (Projector.image_area: a
    Qwen-style processor, which takes the run's bounds at call time) with the run's own where it set
    them, as the data side gave them to it (rules/image_area.taken_area: they replace its own), in
    tokens (most rounded down, fewest up: inside both)."""
    from homelab_ft.rules.image_area import taken_area

    if plan.projector.image_area is None:
        return None
    low, high, per_token = plan.projector.image_area(plan.config, gguf_mmproj.processor_settings(processor_dir))
    low, high = taken_area((low, high), max_pixels=pixels[1], min_pixels=pixels[0])
    return -(-low // per_token), max(1, high // per_token)
