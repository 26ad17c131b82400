"""A written mmproj read back with gguf-py and compared with the image-text model it came from.

Two checks, as readback.py and check.py make for a text GGUF:

- `read_back`: the file's architecture (`clip`), type (`mmproj`) and every `clip.*` key as written
  from the config, every vision-side tensor present and no other, each bit for bit the model's
  values in llama.cpp's layout rounded as its type rounds them.
- `compare_vision`: the tensors read back, taken to transformers' layout with the inverse of the
  converter's transforms, loaded into the image-text model in place of its own vision tower and
  projector; the image features of a probe image (made by the model's own image processor) then
  compared with the original model's, within the bound of the coarsest type the file stores
  (check.GGUF_BOUNDS per unit of the largest feature). What llama.cpp's own graph computes from the
  file is compared by tools/llama_mtmd.py (tests/unit/export/gguf/test_gguf_mmproj_llama_cpp.py).
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from homelab_ft.export.gguf import mmproj as gguf_mmproj
from homelab_ft.export.gguf.check import GGUF_BOUNDS
from homelab_ft.export.gguf.readback import check_fields, round_trip, stored, written_keys
from homelab_ft.locate import gguf_reader


@dataclass(frozen=True)
class MmprojCheck:
    max_abs_diff: float
    bound: float
    stored_as: str
    """The coarsest type among the file's matrices, which sets the bound."""

    def describe(self) -> str:
        return (f"max |image feature difference| mmproj vs merged model = {self.max_abs_diff:.2e} "
                f"(bound {self.bound:.2e}, matrices stored down to {self.stored_as})")


def read_back(path: Path, model_dir: Path, *, gguf_type: str, processor_dir: Path | None = None
              ) -> gguf_mmproj.MmprojPlan:
    """Raise RuntimeError on any difference between the file and what `model_dir` should give."""
    import torch
    from transformers import AutoModelForImageTextToText

    from homelab_ft.model.checkpoint_keys import CheckpointKeys

    plan = gguf_mmproj.plan_mmproj(model_dir, gguf_type=gguf_type)
    reader = gguf_reader(path)
    fields = reader.fields
    for key, want in (("general.architecture", "clip"), ("general.type", "mmproj")):
        if key not in fields or fields[key].contents() != want:
            raise RuntimeError(f"mmproj check failed: {key} is {fields[key].contents() if key in fields else None}, "
                               f"meant {want!r}")
    check_fields(fields, written_keys(gguf_mmproj.mmproj_keys(plan, processor_dir or model_dir), "clip"))
    tensors = {t.name: t for t in reader.tensors}
    meant = {item.gguf_name for item in plan.tensors}
    if set(tensors) != meant:
        raise RuntimeError(f"mmproj check failed: tensors missing {sorted(meant - set(tensors))[:3]}, "
                           f"not from the model {sorted(set(tensors) - meant)[:3]}")
    with torch.device("meta"):
        keys = CheckpointKeys(AutoModelForImageTextToText.from_config(plan.config), model_dir)
    by_name: dict[str, list] = {}
    for item in plan.tensors:
        by_name.setdefault(item.checkpoint_name, []).append(item)
    for name, tensor in keys.tensors(list(by_name)):
        for item in by_name[name]:
            got = stored(tensors[item.gguf_name])
            want = round_trip(plan.to_gguf(item, gguf_mmproj.taken(item, tensor).to(torch.float32).numpy()), item.qtype)
            if tensors[item.gguf_name].tensor_type != item.qtype or got.shape != want.shape or not np.array_equal(got, want):
                raise RuntimeError(f"mmproj check failed: {item.gguf_name} reads back different from what was meant")
    return plan


def compare_vision(path: Path, model_dir: Path, plan: gguf_mmproj.MmprojPlan, *, image,
                   processor_dir: Path | None = None) -> MmprojCheck:
    """The model's image features with its vision side read back from `path`, against its own."""
    import torch
    from transformers import AutoImageProcessor, AutoModelForImageTextToText

    tensors = {t.name: t for t in gguf_reader(path).tensors}
    model = AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32).eval()
    processor = AutoImageProcessor.from_pretrained(processor_dir or model_dir)
    wanted = set(inspect.signature(model.get_image_features).parameters)
    inputs = {k: v for k, v in processor(images=[image], return_tensors="pt").items() if k in wanted}
    expected = _features(model, inputs)
    arrays = {item.gguf_name: stored(tensors[item.gguf_name]) for item in plan.tensors}
    state = {name: torch.from_numpy(np.array(value)) for name, value in plan.checkpoint_tensors(arrays).items()}
    missing = set(state) - {name for name, _ in model.named_parameters(remove_duplicate=False)}
    if missing:
        raise RuntimeError(f"mmproj check failed: {sorted(missing)[:3]} are not parameters of the model")
    model.load_state_dict(state, strict=False)
    got = _features(model, inputs)
    diff = float((got - expected).abs().max())
    coarsest = _coarsest(plan)
    bound = GGUF_BOUNDS.get(coarsest, GGUF_BOUNDS["q8_0"]) * max(1.0, float(expected.abs().max()))
    if not diff <= bound:
        raise RuntimeError(f"mmproj check failed: image features differ by {diff:.3g} > {bound:.3g}")
    return MmprojCheck(max_abs_diff=diff, bound=bound, stored_as=coarsest)


def _features(model, inputs: dict):
    import torch

    with torch.no_grad():
        out = model.get_image_features(**inputs)
    return image_features(out)


def image_features(out):
    """What the language model receives for the images, one row per image token, from
    get_image_features' output: its features, each followed by its deepstack features where the
    model has them (Qwen3-VL's, which llama.cpp's mmproj puts side by side in the same row)."""
    import torch

    def rows(parts):
        parts = list(parts) if isinstance(parts, list | tuple) else [parts]
        return torch.cat([p.reshape(-1, p.shape[-1]).float() for p in parts])

    main = rows(getattr(out, "pooler_output", out))
    deepstack = getattr(out, "deepstack_features", None) or []
    return torch.cat([main, *(rows(level) for level in deepstack)], dim=-1)


_ORDER = ("f32", "f16", "bf16", "q8_0", "q5_1", "q4_0")


def _coarsest(plan: gguf_mmproj.MmprojPlan) -> str:
    names = {item.qtype.name.lower() for item in plan.tensors if len(item.shape) > 1}
    return max(names, key=lambda name: _ORDER.index(name) if name in _ORDER else len(_ORDER))


def probe_image(side: int = 64):
    """A PIL image the check runs the vision tower on: seeded noise over four flat quadrants, so every
    patch differs and a transposed or permuted weight shows (no file, no network)."""
    from PIL import Image

    rng = np.random.default_rng(0)
    pixels = rng.integers(0, 64, size=(side, side, 3))
    half = side // 2
    for index, (y, x) in enumerate(((0, 0), (0, half), (half, 0), (half, half))):
        pixels[y:y + half, x:x + half] += rng.integers(0, 192, size=3) * (index + 1) // 4
    return Image.fromarray(pixels.clip(0, 255).astype(np.uint8), "RGB")


def verify_mmproj(path: Path, model_dir: Path, *, gguf_type: str, processor_dir: Path | None = None) -> MmprojCheck:
    """read_back, then compare_vision on probe_image: the one call export makes."""
    plan = read_back(path, model_dir, gguf_type=gguf_type, processor_dir=processor_dir)
    return compare_vision(path, model_dir, plan, image=probe_image(), processor_dir=processor_dir)
