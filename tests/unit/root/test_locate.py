"""locate.py's GGUF reading: gguf_reader parses what gguf-py's own GGUFReader does."""

from __future__ import annotations

import numpy as np
from gguf import GGUFReader

from homelab_ft.export.gguf import export as gguf_export
from homelab_ft.locate import gguf_config, gguf_reader, read_gguf


def test_gguf_reader_reads_every_field_and_tensor_gguf_py_reads(tmp_path, tiny_model_dir):
    path = tmp_path / "tiny.gguf"
    gguf_export.write_gguf(tiny_model_dir, path, gguf_type="q8_0", name="tiny")
    ours, theirs = gguf_reader(path), GGUFReader(path)
    assert list(ours.fields) == list(theirs.fields) and len(ours.fields) > 10
    for name, field in theirs.fields.items():
        got, want = ours.fields[name].contents(), field.contents()
        assert (got == want) if not isinstance(want, np.ndarray) else np.array_equal(got, want), name
    assert "tokenizer.ggml.tokens" in ours.fields  # an array of strings, the slow part for gguf-py
    assert [(t.name, t.tensor_type, list(t.shape), int(t.data_offset)) for t in ours.tensors] == \
        [(t.name, t.tensor_type, list(t.shape), int(t.data_offset)) for t in theirs.tensors]
    for a, b in zip(ours.tensors, theirs.tensors, strict=True):
        assert type(a.data) is np.ndarray and np.array_equal(a.data, b.data), a.name  # a plain view, same bytes
    assert read_gguf(path).fields.keys() == theirs.fields.keys()
    assert gguf_config(path)["model_type"] == "llama"
