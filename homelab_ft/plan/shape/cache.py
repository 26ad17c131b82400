"""Derived shapes kept as JSON, so planning a model seen before imports no torch.

Deriving a shape (derive.py) imports torch and transformers and builds the model on the meta
device: a few seconds the first time a config is planned. The result depends only on the config,
the attention implementation and the installed transformers (which writes the modeling code the
shape is read from), so it is stored under a hash of the three, in `$HOMELAB_FT_CACHE/shapes`
(else ~/.cache/homelab-ft/shapes: locate.cache_root, where converted models are kept too).
A hit reads one small JSON file; the transformers version is read from the installed package's
metadata, not by importing it.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from importlib import metadata
from pathlib import Path

from homelab_ft.locate import cache_root
from homelab_ft.plan.shape.types import ModelShape

log = logging.getLogger(__name__)

SCHEMA = 13
"""Bumped when derive.py or saved.py change what a cached shape holds or how it is measured."""


def cache_dir() -> Path:
    return cache_root() / "shapes"


def cache_key(config: dict, *, attn_implementation: str, model_path: str | None = None,
              trust_remote_code: bool = False) -> str:
    """sha256 of the config (canonical JSON), the attention implementation, the installed
    transformers version and, for remote code, the model folder's .py files."""
    parts = [json.dumps(config, sort_keys=True, default=str), attn_implementation, _transformers_version(), str(SCHEMA)]
    if trust_remote_code and model_path and Path(model_path).is_dir():
        parts += [p.read_text() for p in sorted(Path(model_path).glob("*.py"))]
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()[:32]


def cached_shape(config: dict, *, attn_implementation: str = "sdpa", model_path: str | None = None,
                 trust_remote_code: bool = False) -> ModelShape:
    key = cache_key(config, attn_implementation=attn_implementation, model_path=model_path,
                    trust_remote_code=trust_remote_code)
    path = cache_dir() / f"{key}.json"
    try:
        return ModelShape.from_dict(json.loads(path.read_text()))
    except FileNotFoundError:
        pass
    except (OSError, ValueError, TypeError, KeyError) as err:
        log.warning("ignoring the unreadable cached shape %s (%s); deriving it again", path, err)
    from homelab_ft.plan.shape.derive import derive_shape

    shape = derive_shape(config, attn_implementation=attn_implementation, model_path=model_path,
                         trust_remote_code=trust_remote_code)
    _store(path, shape)
    return shape


def _store(path: Path, shape: ModelShape) -> None:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(shape.to_dict(), indent=1))
        tmp.replace(path)
    except OSError as err:
        log.warning("could not cache the derived shape in %s (%s); the next plan derives it again", path.parent, err)


def _transformers_version() -> str:
    try:
        return metadata.version("transformers")
    except metadata.PackageNotFoundError:
        return "none"
