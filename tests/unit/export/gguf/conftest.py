"""The tiny image-text checkpoints the GGUF + mmproj tests share (tests/tiny_vlm.py)."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="module")
def vlm(tmp_path_factory):
    """model_type -> a tiny random checkpoint of it, saved once per test module."""
    from tiny_vlm import save_tiny_vlm

    cache = {}

    def get(model_type: str) -> Path:
        if model_type not in cache:
            cache[model_type] = save_tiny_vlm(tmp_path_factory.mktemp(model_type), model_type)
        return cache[model_type]

    return get
