"""Derived shapes kept as JSON, so planning a model seen before imports no torch.

Deriving a shape (derive.py) imports torch and transformers and builds the model on the meta
device: a few seconds the first time a config is planned. The result depends only on the config,
the attention implementation and the installed transformers (which writes the modeling code the
shape is read from), so it is stored under a hash of the three, in `$HOMELAB_FT_CACHE/shapes`
(else ~/.cache/homelab-ft/shapes: locate.cache_root, where converted models are kept too).
A hit reads one small JSON file; the transformers version is read from the installed package's
metadata, not by importing it.

One model, one entry: the key is taken over the config less what `save_pretrained` adds or leaves
out without changing the model built (`architectures`, `dtype`, labels, output switches; see
`NOT_THE_MODEL`), so a config held in memory and the same config read back from a checkpoint share
it; and a shape derived for `auto` attention is also stored under the implementation `auto` chose
(and one derived for `sdpa` under `auto` when sdpa was used), since each would derive the same.
"""

from __future__ import annotations

import hashlib
import json
import logging
from importlib import metadata
from pathlib import Path

from homelab_ft import fsio
from homelab_ft.locate import cache_root
from homelab_ft.plan.shape.types import ModelShape
from homelab_ft.plan.shape.vision import processor_files

log = logging.getLogger(__name__)

SCHEMA = 16
"""Bumped when derive.py, saved.py or vision.py change what a cached shape holds or how it is
measured (15: an image-text model's vision side, measured per image; 16: vision blocks found as the
layers of its encoder, rules/decoder_blocks.py, and an image run's shape keyed apart)."""


NOT_THE_MODEL = {
    "architectures": None, "_name_or_path": None, "transformers_version": None, "dtype": None, "torch_dtype": None,
    "id2label": None, "label2id": None, "problem_type": None,
    "output_hidden_states": False, "output_attentions": False, "return_dict": True,
    "chunk_size_feed_forward": 0, "is_encoder_decoder": False,
}
"""Config keys that do not change the causal LM `from_config` builds, each with the value a config
held in memory carries when `save_pretrained` leaves it out (None: dropped whatever its value).
`architectures` names the class a checkpoint was saved from, which `from_config` does not read; the
shape counts elements and measures activations in the dtype it builds with, never the saved one;
labels and the problem type serve classification heads; the output switches and `return_dict`
shape what a forward returns, not what it keeps; `chunk_size_feed_forward` and
`is_encoder_decoder` are keyed when set to anything but their defaults."""


def cache_dir() -> Path:
    return cache_root() / "shapes"


def cache_key(config: dict, *, attn_implementation: str, model_path: str | None = None,
              trust_remote_code: bool = False, images: bool = False) -> str:
    """sha256 of the config (canonical JSON), the attention implementation, the installed
    transformers version, the checkpoint's image processor settings (what an image-text model's
    vision side was measured on, vision.py), whether the run reads images (the class it builds:
    rules/vision.auto_class) and, for remote code, the model folder's .py files."""
    parts = [json.dumps(_model_part(config), sort_keys=True, default=str), attn_implementation,
             _transformers_version(), str(SCHEMA), *processor_files(model_path), *(["images"] if images else [])]
    if trust_remote_code and model_path and Path(model_path).is_dir():
        parts += [p.read_text() for p in sorted(Path(model_path).glob("*.py"))]
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()[:32]


def _model_part(config: dict) -> dict:
    """`config` less NOT_THE_MODEL, its text config (a multimodal checkpoint's) too."""
    kept = {k: v for k, v in config.items()
            if k not in NOT_THE_MODEL or (NOT_THE_MODEL[k] is not None and v != NOT_THE_MODEL[k])}
    for key in ("text_config", "text_config_dict"):
        if isinstance(kept.get(key), dict):
            kept[key] = _model_part(kept[key])
    return kept


def cached_shape(config: dict, *, attn_implementation: str = "sdpa", model_path: str | None = None,
                 trust_remote_code: bool = False, images: bool = False) -> ModelShape:
    """The shape of a text run (or with `images`, an image run) of the model `config` describes:
    read from the cache, else derived and stored. A text run that builds the image-text class (its
    shape has a vision side: Gemma 3, Qwen2-VL, Llava) builds what an image run builds, so each is
    also stored under the other's key; the runs of a checkpoint whose causal-LM class is text-only
    (Qwen 3.5, Llama 4) are two models, two entries."""
    where = dict(attn_implementation=attn_implementation, model_path=model_path, trust_remote_code=trust_remote_code)
    path = cache_dir() / f"{cache_key(config, **where, images=images)}.json"
    shape = _read(path)
    if shape is None and images:  # a text run's entry that holds the image-text model is this one
        text = _read(cache_dir() / f"{cache_key(config, **where)}.json")
        shape = text if text is not None and text.vision is not None else None
    if shape is not None:
        return shape
    from homelab_ft.plan.shape.derive import derive_shape, text_run_loads_tower

    shape = derive_shape(config, **where, images=images)
    # the other kind of run builds this very model: a text run that built the image-text class, or an
    # image run of a checkpoint whose text run builds it too
    other = shape.vision is not None and (not images or text_run_loads_tower(
        config, model_path=model_path, trust_remote_code=trust_remote_code))
    for runs_images in (images, not images) if other else (images,):
        for attn in (attn_implementation, *_same_derivation(attn_implementation, shape.attn_implementation)):
            key = cache_key(config, attn_implementation=attn, model_path=model_path, trust_remote_code=trust_remote_code,
                            images=runs_images)
            _store(cache_dir() / f"{key}.json", shape)
    return shape


def _read(path: Path) -> ModelShape | None:
    try:
        return ModelShape.from_dict(json.loads(path.read_text()))
    except FileNotFoundError:
        return None
    except (OSError, ValueError, TypeError, KeyError) as err:
        log.warning("ignoring the unreadable cached shape %s (%s); deriving it again", path, err)
        return None


def cached_image_tokens(config: dict, *, sizes: tuple[tuple[int, int], ...], model_path: str | None = None,
                        trust_remote_code: bool = False, max_pixels: int | None = None,
                        min_pixels: int | None = None) -> tuple[int, ...]:
    """Image tokens one image of each (height, width) of `sizes` becomes in the image-text model
    `config` describes, its processor given the recipe's pixel bounds where it takes them
    (derive.image_tokens_at), kept beside the shapes under the same key (the config, the processor
    files, transformers), one entry per size and bounds: a plan at a recipe's data.image_max_pixels
    seen before imports no torch."""
    key = cache_key(config, attn_implementation="sdpa", model_path=model_path, trust_remote_code=trust_remote_code)
    path = cache_dir() / f"{key}.image_tokens.json"
    try:
        known = {k: int(v) for k, v in json.loads(path.read_text()).items()}
    except FileNotFoundError:
        known = {}
    except (OSError, ValueError, TypeError, AttributeError) as err:
        log.warning("ignoring the unreadable cached image tokens %s (%s); counting them again", path, err)
        known = {}

    def entry(height: int, width: int) -> str:
        return f"{height}x{width}" + (f" {max_pixels} {min_pixels}" if (max_pixels, min_pixels) != (None, None) else "")

    missing = tuple(size for size in sizes if entry(*size) not in known)
    if missing:
        from homelab_ft.plan.shape.derive import image_tokens_at

        counted = image_tokens_at(config, sizes=missing, model_path=model_path, trust_remote_code=trust_remote_code,
                                  max_pixels=max_pixels, min_pixels=min_pixels)
        known.update({entry(*size): n for size, n in zip(missing, counted, strict=True)})
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            fsio.replace_text(path, json.dumps(known, indent=1))
        except OSError as err:
            log.warning("could not cache image tokens in %s (%s); the next plan counts them again", path.parent, err)
    return tuple(known[entry(*size)] for size in sizes)


def _same_derivation(requested: str, used: str) -> tuple[str, ...]:
    """The other attention settings that derive what `requested` did, given it used `used`: `auto`
    is sdpa where the class has it, else eager (derive.py), so `auto` and what it used agree, and an
    explicit `sdpa` that was honoured agrees with `auto`. An explicit eager does not: `auto` may
    have picked sdpa."""
    if requested == "auto":
        return (used,)
    if requested == "sdpa" and used == "sdpa":
        return ("auto",)
    return ()


def _store(path: Path, shape: ModelShape) -> None:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fsio.replace_text(path, json.dumps(shape.to_dict(), indent=1))
    except OSError as err:
        log.warning("could not cache the derived shape in %s (%s); the next plan derives it again", path.parent, err)


def _transformers_version() -> str:
    try:
        return metadata.version("transformers")
    except metadata.PackageNotFoundError:
        return "none"
