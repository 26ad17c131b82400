"""Fixtures the GGUF tests share: the tiny image-text checkpoints of the GGUF + mmproj tests
(tests/tiny_vlm.py), and an f32 file written and read back for the family tests."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="module")
def vlm(tmp_path_factory):
    """model_type -> a tiny random checkpoint of it, saved once per test module."""
    from tiny_vlm import save_gguf_vlm

    cache = {}

    def get(model_type: str) -> Path:
        if model_type not in cache:
            cache[model_type] = save_gguf_vlm(tmp_path_factory.mktemp(model_type), model_type)
        return cache[model_type]

    return get


@pytest.fixture(scope="session")
def write_f32():
    """`write(model_dir, path)` writes `model_dir` as an f32 GGUF at `path` and returns (its
    architecture, its `<arch>.*` keys without the prefix, its tensors as numpy arrays in numpy's
    order): what the family tests read a written file by."""

    def write(model_dir, path):
        import numpy as np
        from gguf import GGUFReader

        from homelab_ft.export.gguf import export as gguf_export

        gguf_export.write_gguf(model_dir, path, gguf_type="f32", name="tiny")
        reader = GGUFReader(path)
        arch = reader.fields["general.architecture"].contents()
        fields = {k.removeprefix(f"{arch}."): f.contents() for k, f in reader.fields.items() if k.startswith(f"{arch}.")}
        tensors = {t.name: np.asarray(t.data).reshape([int(d) for d in reversed(t.shape)]) for t in reader.tensors}
        return arch, fields, tensors

    return write
