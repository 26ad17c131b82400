"""A read-only run directory: a resume is one line naming the path and the fix, and the run's
files are untouched (a bind mount in a private mount namespace, since root ignores permissions)."""

from __future__ import annotations

import errno
import os
import shutil
import subprocess
import sys
from pathlib import Path

import build_recipe
import pytest

from homelab_ft import fsio
from homelab_ft.cli.main import main


@pytest.fixture()
def good(tmp_path, tiny_model_dir):
    (tmp_path / "d.jsonl").write_text(
        '{"messages": [{"role": "user", "content": "hello"}, {"role": "assistant", "content": "yes"}]}\n' * 8)
    return build_recipe.tiny_run(tiny_model_dir, rows="d.jsonl", lora=None, train={"max_steps": 1})


def _can_bind_mount_read_only(path: Path) -> bool:
    return shutil.which("unshare") is not None and subprocess.run(
        ["unshare", "-m", "sh", "-c", f"mount --bind -o ro {path} {path}"], capture_output=True).returncode == 0


def test_read_only_run_directory(tmp_path, good):
    """A resume into a read-only run directory (a bind mount in a private mount namespace, since
    root ignores permissions): one line, and the run's files untouched."""
    body = good
    recipe = build_recipe.write_recipe(tmp_path / "r.yaml", body)
    run = tmp_path / "run"
    assert main(["train", str(recipe), "--run-dir", str(run)]) == 0
    if not _can_bind_mount_read_only(run):
        pytest.skip("needs unshare and mount (root)")
    before = {p: p.read_bytes() for p in run.rglob("*") if p.is_file()}
    command = [sys.executable, "-m", "homelab_ft", "train", str(recipe), "--run-dir", str(run), "--resume",
               "train.max_steps=2"]
    proc = subprocess.run(["unshare", "-m", "sh", "-c", f'mount --bind -o ro "{run}" "{run}" && exec "$@"', "sh",
                           *command], capture_output=True, text=True, env={**os.environ, "PYTHONPATH": os.getcwd()})
    err = proc.stderr.strip().splitlines()
    assert proc.returncode == 2, proc.stderr
    assert err[-1].startswith("homelab-ft: error: ") and "Read-only file system" in err[-1], proc.stderr
    assert fsio.FIXES[errno.EROFS] in err[-1] and "Traceback" not in proc.stderr
    assert {p: p.read_bytes() for p in run.rglob("*") if p.is_file()} == before
