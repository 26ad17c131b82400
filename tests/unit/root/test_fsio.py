"""File-system failures and undecodable files are one line naming the path and the fix, for every
command (fsio.py and the CLI's one handler), and nothing is created by a command that fails so."""

from __future__ import annotations

import errno
import json
import os
import shutil
import struct

import build_recipe
import pytest

from homelab_ft import fsio
from homelab_ft.cli.main import main


def one_line(capsys, code: int) -> str:
    err = capsys.readouterr().err.strip()
    assert code == 2, err
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    return err


@pytest.mark.parametrize("code", sorted(fsio.FIXES))
def test_every_mapped_errno_names_the_path_and_the_fix(code):
    line = fsio.describe(OSError(code, os.strerror(code), "/some/where"))
    assert line.startswith("/some/where: ") and line.endswith(fsio.FIXES[code]) and "\n" not in line
    assert fsio.describe(OSError(errno.EIO, "Input/output error", "/x")) is None  # not a user's to fix


@pytest.mark.parametrize("code", [errno.ENOSPC, errno.EROFS, errno.EACCES, errno.EISDIR, errno.ENOTDIR, errno.EEXIST])
def test_any_command_that_meets_one_says_one_line(capsys, monkeypatch, tmp_path, code):
    from homelab_ft.cli import plan

    def fail(args):
        raise OSError(code, os.strerror(code), str(tmp_path / "target"))

    monkeypatch.setattr(plan, "cmd_plan", fail)
    err = one_line(capsys, main(["plan", str(tmp_path / "r.yaml")]))
    assert f"{tmp_path / 'target'}: {os.strerror(code)}; {fsio.FIXES[code]}" in err


def test_an_unnamed_undecodable_file_is_one_line(capsys, monkeypatch, tmp_path):
    from homelab_ft.cli import plan

    def fail(args):
        b"\xff".decode("utf-8")

    monkeypatch.setattr(plan, "cmd_plan", fail)
    assert "is not UTF-8 text" in one_line(capsys, main(["plan", str(tmp_path / "r.yaml")]))


def test_hostfile_that_is_not_utf8(capsys, tmp_path, tiny_model_dir):
    hosts = tmp_path / "hosts"
    hosts.write_bytes(b"node1 slots=1\n\xff\xfe bad\n")
    recipe = build_recipe.write_recipe(tmp_path / "r.yaml", {"model": {"path": str(tiny_model_dir)}})
    err = one_line(capsys, main(["launch", str(recipe), "--hosts", str(hosts)]))
    assert f"hostfile {hosts} is not UTF-8 text (byte 0xff at offset 14)" in err


def test_recipe_that_is_a_directory(capsys, tmp_path):
    assert "is a directory" in one_line(capsys, main(["plan", str(tmp_path)]))


@pytest.fixture()
def good(tmp_path, tiny_model_dir):
    model = tmp_path / "model"
    shutil.copytree(tiny_model_dir, model)
    (tmp_path / "d.jsonl").write_text(
        '{"messages": [{"role": "user", "content": "hello"}, {"role": "assistant", "content": "yes"}]}\n' * 8)
    return model, build_recipe.tiny_run(model, rows="d.jsonl", lora=None, train={"max_steps": 1})


def refused(capsys, tmp_path, body) -> str:
    recipe = build_recipe.write_recipe(tmp_path / "r.yaml", body)
    err = one_line(capsys, main(["train", str(recipe), "--run-dir", str(tmp_path / "run")]))
    assert not (tmp_path / "run").exists()
    return err


def test_data_cache_dir_that_is_a_file(capsys, tmp_path, good):
    _, body = good
    (tmp_path / "afile").write_text("x")
    body["data"]["cache_dir"] = str(tmp_path / "afile")
    assert "data.cache_dir:" in refused(capsys, tmp_path, body)
    assert (tmp_path / "afile").read_text() == "x"


def test_chat_template_file_that_is_not_utf8(capsys, tmp_path, good):
    _, body = good
    (tmp_path / "t.jinja").write_bytes(b"{{ messages }}\xff")
    body["data"]["chat_template"] = "t.jinja"
    assert "data.chat_template file" in refused(capsys, tmp_path, body)


def test_safetensors_header_that_lies_about_a_size(capsys, tmp_path, good):
    model, body = good
    weights = model / "model.safetensors"
    data = weights.read_bytes()
    (length,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8:8 + length])
    name = next(k for k in header if k != "__metadata__")
    header[name]["shape"] = [header[name]["shape"][0] * 2, *header[name]["shape"][1:]]
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    weights.write_bytes(struct.pack("<Q", len(raw)) + raw + data[8 + length:])
    err = refused(capsys, tmp_path, body)
    assert "damaged safetensors header" in err and name in err
