"""A GGUF model is dequantized into an fp32 copy in our cache: the user is told where and how big
before it is written, told when a later run reuses it, and refused when the disk has no room."""

from __future__ import annotations

import math
import shutil
from collections import namedtuple
from pathlib import Path

import pytest

from homelab_ft import logs
from homelab_ft.errors import UserError
from homelab_ft.export.gguf import export as gguf_export
from homelab_ft.model import loading


@pytest.fixture()
def tiny_gguf(tmp_path, tiny_model_dir, monkeypatch) -> Path:
    monkeypatch.setenv("HOMELAB_FT_CACHE", str(tmp_path / "cache"))
    path = tmp_path / "tiny.gguf"
    gguf_export.write_gguf(tiny_model_dir, path, gguf_type="q8_0", name="tiny")
    return path


def fp32_weight_bytes(model_dir: Path) -> int:
    from safetensors import safe_open

    with safe_open(model_dir / "model.safetensors", framework="pt") as f:
        return 4 * sum(math.prod(f.get_slice(k).get_shape()) for k in f.keys())


def test_conversion_says_where_and_how_big_then_reuse_says_so(tiny_gguf, capsys):
    logs.configure(logs.NORMAL)  # info is visible by default
    out = loading.convert_gguf(tiny_gguf)
    first = capsys.readouterr().out
    from gguf import GGUFReader

    predicted = loading.FP32_BYTES * sum(int(t.n_elements) for t in GGUFReader(tiny_gguf).tensors)
    assert predicted == fp32_weight_bytes(out)  # the size announced is the size written
    assert f"tiny.gguf: dequantizing to an fp32 Hugging Face copy of {loading.format_size(predicted)} in {out}" in first
    assert "the next run with this file reuses it" in first

    assert loading.convert_gguf(tiny_gguf) == out
    second = capsys.readouterr().out
    assert f"tiny.gguf: reusing its fp32 copy in {out}" in second and "dequantizing" not in second


def test_quiet_hides_the_conversion_lines(tiny_gguf, capsys):
    logs.configure(logs.QUIET)
    try:
        loading.convert_gguf(tiny_gguf)
    finally:
        logs.configure(logs.NORMAL)
    assert capsys.readouterr().out == ""


def test_a_disk_without_room_is_refused_before_anything_is_written(tiny_gguf, monkeypatch):
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage(10**9, 10**9 - 1000, 1000))
    with pytest.raises(UserError) as err:
        loading.convert_gguf(tiny_gguf)
    message = str(err.value)
    assert "dequantizing tiny.gguf writes an fp32 copy of" in message and "has 0 MiB free" in message
    assert "HOMELAB_FT_CACHE" in message and "\n" not in message
    models = Path(loading.cache_root()) / "models"
    assert not [p for p in models.iterdir() if p.is_dir()]


def test_the_tokenizer_comes_from_the_gguf_even_beside_an_exports_tokenizer_files(tiny_gguf, tiny_model_dir):
    """`export --format safetensors,gguf` writes tokenizer.json beside the GGUF; transformers then
    built the tokenizer from that file, without the GGUF's chat template and end-of-sequence token
    (issue 39: `generate OUT/model-q8_0.gguf` ended in "chat_template is not set")."""
    from transformers import AutoTokenizer

    shutil.copy(tiny_model_dir / "tokenizer.json", tiny_gguf.parent / "tokenizer.json")
    out = loading.convert_gguf(tiny_gguf)
    tokenizer, reference = AutoTokenizer.from_pretrained(out), AutoTokenizer.from_pretrained(tiny_model_dir)
    assert tokenizer.chat_template == reference.chat_template and tokenizer.eos_token == "<|im_end|>"


def test_a_copy_that_is_incomplete_or_unchecked_is_converted_again(tiny_gguf, capsys):
    """Only a folder whose record (written last) matches its files is reused: not one killed
    mid-write, nor one an older homelab-ft left (no record) with a broken tokenizer."""
    logs.configure(logs.NORMAL)
    out = loading.convert_gguf(tiny_gguf)
    (out / loading.CONVERSION_RECORD).unlink()
    (out / "chat_template.jinja").unlink()  # what the old conversion left: a tokenizer without its template
    assert loading.convert_gguf(tiny_gguf) == out
    assert "incomplete or was never checked" in capsys.readouterr().out
    assert (out / "chat_template.jinja").is_file() and (out / loading.CONVERSION_RECORD).is_file()
    with open(out / "model.safetensors", "r+b") as fh:
        fh.truncate(100)  # a damaged copy: its size no longer what the record says
    loading.convert_gguf(tiny_gguf)
    assert "converting it again" in capsys.readouterr().out and fp32_weight_bytes(out) > 0
