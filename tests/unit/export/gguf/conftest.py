"""Fixtures the GGUF tests share: an f32 file written and read back for the family tests (the tiny
image-text checkpoints of the GGUF + mmproj tests, `vlm`, are tests/conftest.py's: tests/e2e uses them too)."""

from __future__ import annotations

import pytest


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
