"""Export as careful as training (issue 23, point 1): an `--out` that would overwrite a run is
refused; SIGTERM, SIGKILL, two exports into one `--out`, a full disk, a read-only target and a run
that prunes checkpoints while it is exported leave the run, the previous export and the disk as
they were.

One LoRA run of a 6-layer tiny Llama (~10 M parameters, so an export takes a few seconds and a
signal sent once its staging folder appears lands mid-export) is trained once and copied per test.
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import build_recipe
import procs
import pytest
import yaml

from homelab_ft.cli.main import main
from homelab_ft.store import checkpoint


def _recipe(tmp: Path, model_dir: Path, *, method: str = "lora") -> Path:
    procs.write_chat_data(tmp / "train.jsonl", 16, answer_prefix="answer: ", max_q_words=8, max_a_words=6)
    return build_recipe.write_recipe(tmp / f"{method}.yaml", build_recipe.tiny_run(
        model_dir, method=method, lora={"dropout": None} if method == "lora" else None,
        train={"micro_batch_size": 4, "lr": 5e-3, "save_every": 1, "keep_last": 5}))


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    from tiny import make_llama

    tmp = tmp_path_factory.mktemp("export-faults")
    model = make_llama(tmp / "model", hidden_size=384, intermediate_size=1024, num_hidden_layers=6,
                       num_attention_heads=6, num_key_value_heads=2)
    recipe = _recipe(tmp, model)
    run = tmp / "run"
    assert main(["train", str(recipe), "--run-dir", str(run)]) == 0
    return recipe, run


def _copy(run: Path, dst: Path) -> Path:
    shutil.copytree(run, dst)
    return dst


def _snapshot(root: Path) -> dict[str, str]:
    """Every file under `root` (the lock file aside) with its SHA-256: what "untouched" means."""
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file() and p.name != ".lock"}


def _leftovers(out: Path) -> list[Path]:
    """Anything an export left beside `out` (its staging folder, its lock file)."""
    return sorted(out.parent.glob(f".{out.name}.*"))


def _one_line(capsys, code: int, expected: int = 2) -> str:
    err = capsys.readouterr().err.strip()
    assert code == expected, err
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    return err


# ------------------------------------------------------------------ an --out over a run's own files


@pytest.mark.parametrize("where", ["run", "checkpoint", "inside", "parent"])
@pytest.mark.parametrize("overwrite", [False, True], ids=["", "overwrite"])
def test_out_over_a_run_is_refused(trained, tmp_path, capsys, where, overwrite):
    _, run = trained
    copy = _copy(run, tmp_path / "runs" / "run")
    before = _snapshot(copy)
    out = {"run": copy, "checkpoint": checkpoint.latest(copy), "inside": copy / "export",
           "parent": tmp_path / "runs"}[where]
    code = main(["export", str(copy), "--out", str(out), *(["--overwrite"] if overwrite else [])])
    err = _one_line(capsys, code)
    assert f"--out {out}" in err and "choose an --out outside" in err, err
    assert _snapshot(copy) == before
    assert not (copy / "export").exists() and not _leftovers(out)


@pytest.mark.parametrize("where", ["base", "inside"])
@pytest.mark.parametrize("overwrite", [False, True], ids=["", "overwrite"])
def test_out_into_the_base_model_folder_is_refused(trained, capsys, where, overwrite):
    """The run's base (run.json's model_dir) is never written into, nor deleted by --overwrite."""
    recipe, run = trained
    base = Path(yaml.safe_load(recipe.read_text())["model"]["path"])
    before = _snapshot(base)
    out = base if where == "base" else base / "merged"
    err = _one_line(capsys, main(["export", str(run), "--out", str(out), *(["--overwrite"] if overwrite else [])]))
    assert f"--out {out} {'is' if where == 'base' else 'is inside'} the run's base model folder {base}" in err, err
    assert _snapshot(base) == before and not (base / "merged").exists() and not _leftovers(out)


def test_a_damaged_base_model_is_one_line_before_anything_is_written(trained, tmp_path, capsys):
    """The merge streams the base's safetensors: a damaged header there (here a JSON list) is refused
    by model/files.py before the staging folder exists, not a traceback from safetensors."""
    import json
    import struct

    recipe, run = trained
    base = Path(yaml.safe_load(recipe.read_text())["model"]["path"])
    copy, damaged = _copy(run, tmp_path / "run"), tmp_path / "base"
    shutil.copytree(base, damaged)
    weights = damaged / "model.safetensors"
    weights.write_bytes(struct.pack("<Q", 7) + b"[1,2,3]" + weights.read_bytes()[8:])
    for name, key in (("run.json", None), ("recipe.yaml", "model")):
        path = copy / name
        body = json.loads(path.read_text()) if key is None else yaml.safe_load(path.read_text())
        if key is None:
            body["model_dir"] = str(damaged)
            path.write_text(json.dumps(body))
        else:
            body[key]["path"] = str(damaged)
            path.write_text(yaml.safe_dump(body))
    out = tmp_path / "out"
    err = _one_line(capsys, main(["export", str(copy), "--out", str(out)]))
    assert f"{weights} has a damaged safetensors header (a JSON list" in err, err
    assert not out.exists() and not _leftovers(out)


def test_out_that_is_a_file_is_refused(trained, tmp_path, capsys):
    _, run = trained
    out = tmp_path / "model.bin"
    out.write_bytes(b"precious")
    err = _one_line(capsys, main(["export", str(run), "--out", str(out), "--overwrite"]))
    assert f"--out {out} is a file" in err, err
    assert out.read_bytes() == b"precious"
    err = _one_line(capsys, main(["export", str(run), "--out", str(out / "inner")]))
    assert f"{out} is a file" in err, err


def test_adapter_only_on_a_full_fine_tune_is_refused(tmp_path, tiny_model_dir, capsys):
    recipe = _recipe(tmp_path, tiny_model_dir, method="full")
    run = tmp_path / "full-run"
    assert main(["train", str(recipe), "--run-dir", str(run), "train.max_steps=1"]) == 0
    out = tmp_path / "adapter"
    capsys.readouterr()
    err = _one_line(capsys, main(["export", str(run), "--out", str(out), "--adapter-only"]))
    assert "is a full run: it has no adapter; export it without --adapter-only" in err, err
    assert not out.exists() and not _leftovers(out)


# ------------------------------------------------------------------------ signals, and two at once


def _export_process(run: Path, out: Path, *extra: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "homelab_ft", "export", str(run), "--out", str(out), *extra],
                            env=procs.child_env(), cwd=procs.REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)


def _staging(out: Path) -> list[Path]:
    return [p for p in _leftovers(out) if p.is_dir()]


def _wait_for_staging(proc: subprocess.Popen, out: Path, *, timeout: float = 300) -> Path:
    """The export's staging folder once it appears (the export is then writing into it)."""
    deadline = time.monotonic() + timeout
    while not (found := _staging(out)):
        if proc.poll() is not None:
            raise AssertionError(f"export ended ({proc.returncode}) before its staging folder was seen:\n"
                                 f"{proc.stderr.read()}")
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.005)
    return found[0]


@pytest.mark.parametrize("fmt", ["safetensors", "gguf"])
def test_sigterm_removes_the_staging_folder_and_keeps_the_previous_export(trained, tmp_path, fmt):
    _, run = trained
    out = tmp_path / "out"
    assert main(["export", str(run), "--out", str(out), "--format", fmt]) == 0
    (out / "homelab_ft_export.json").write_text(json.dumps({"source": "another export"}))  # not "already done"
    before = _snapshot(out)
    proc = _export_process(run, out, "--format", fmt, "--overwrite")
    try:
        _wait_for_staging(proc, out)
        time.sleep(0 if fmt == "safetensors" else 1.0)  # at once (reading the adapter), and later on
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 143, err
    lines = [line for line in err.splitlines() if line.startswith("homelab-ft:")]
    assert len(lines) == 1 and "SIGTERM during export" in lines[0] and str(out) in lines[0], err
    assert not _leftovers(out)
    assert _snapshot(out) == before


@pytest.mark.parametrize("fmt", ["safetensors", "gguf"])
def test_sigkill_leftover_is_removed_by_the_next_command(trained, tmp_path, fmt, capsys, caplog):
    recipe, run = trained
    out = tmp_path / "out"
    proc = _export_process(run, out, "--format", fmt)
    try:
        staging = _wait_for_staging(proc, out)
        time.sleep(0.5)  # let it write something
        proc.kill()
        proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert staging.is_dir()  # what a SIGKILL leaves
    if fmt == "safetensors":  # the next export into the same --out removes it
        assert main(["export", str(run), "--out", str(out), "--format", fmt]) == 0
        assert (out / "homelab_ft_export.json").is_file()
    else:  # ... and so does a train into that path
        assert main(["train", str(recipe), "--run-dir", str(out), "train.max_steps=1"]) == 0
    said = capsys.readouterr().err + caplog.text
    assert f"removed {staging}" in said and "bytes freed" in said, said
    assert not _leftovers(out)


def test_two_exports_into_one_out(trained, tmp_path, capsys):
    from transformers import AutoModelForCausalLM

    _, run = trained
    out = tmp_path / "out"
    first = _export_process(run, out)
    try:
        _wait_for_staging(first, out)
        err = _one_line(capsys, main(["export", str(run), "--out", str(out), "--overwrite"]))
        _, first_err = first.communicate(timeout=300)
    finally:
        if first.poll() is None:
            first.kill()
    assert "is being written by another homelab-ft export" in err and f"pid {first.pid}" in err, err
    assert first.returncode == 0, first_err
    assert json.loads((out / "homelab_ft_export.json").read_text())["max_abs_diff"] is not None
    AutoModelForCausalLM.from_pretrained(out)  # complete: it loads
    assert not _leftovers(out)


# --------------------------------------------------------------------- a full disk, a read-only one


def test_full_disk_is_one_line_and_keeps_the_previous_export(trained, tmp_path, capsys, monkeypatch):
    from homelab_ft.export import merge

    _, run = trained
    out = tmp_path / "out"
    assert main(["export", str(run), "--out", str(out)]) == 0
    (out / "homelab_ft_export.json").write_text(json.dumps({"source": "another export"}))
    before = _snapshot(out)

    def full(tensors, path, **kwargs):
        Path(path).write_bytes(b"\0" * 1000)  # the disk filled part-way through the file
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), path)

    monkeypatch.setattr(merge, "save_file", full)
    capsys.readouterr()
    err = _one_line(capsys, main(["export", str(run), "--out", str(out), "--overwrite"]))
    assert f"export to {out} not written" in err and "no space left" in err and "bytes free" in err, err
    assert _snapshot(out) == before and not _leftovers(out)


@pytest.fixture
def small_disk(tmp_path):
    """A 60 MiB tmpfs: room for one export of the 39 MB model, not two."""
    yield from procs.small_tmpfs(tmp_path / "small", "60m")


def test_a_really_full_disk_is_one_line_too(trained, small_disk, capsys):
    """safetensors reports ENOSPC as its own SafetensorError ("No space left on device (os error 28)")."""
    _, run = trained
    out = small_disk / "out"
    assert main(["export", str(run), "--out", str(out)]) == 0
    (out / "homelab_ft_export.json").write_text(json.dumps({"source": "another export"}))
    before = _snapshot(out)
    capsys.readouterr()
    err = _one_line(capsys, main(["export", str(run), "--out", str(out), "--overwrite"]))
    assert f"export to {out} not written: no space left" in err, err
    assert _snapshot(out) == before and not _leftovers(out)


@pytest.fixture
def read_only(tmp_path):
    """A directory bind-mounted read-only onto itself (root ignores chmod). Always unmounted."""
    path = tmp_path / "ro"
    yield from procs.mounted(path, "--bind", str(path))


def test_read_only_target_is_one_line_and_keeps_the_previous_export(trained, read_only, capsys):
    _, run = trained
    out = read_only / "out"
    assert main(["export", str(run), "--out", str(out)]) == 0
    (out / "homelab_ft_export.json").write_text(json.dumps({"source": "another export"}))
    before = _snapshot(out)
    subprocess.run(["mount", "-o", "remount,ro,bind", str(read_only)], check=True)
    capsys.readouterr()
    for target in (out, read_only / "new"):
        err = _one_line(capsys, main(["export", str(run), "--out", str(target), "--overwrite"]))
        assert f"export to {target} not written" in err and "read-only" in err, err
        assert not _leftovers(target)
    assert _snapshot(out) == before


# ------------------------------------------------------------------------- a run that is training


def test_export_while_the_trainer_prunes(trained, tmp_path, monkeypatch, capsys):
    """The trainer saves a newer checkpoint and prunes (keep_last=1) while the export reads the
    newest one: the export's reader lock keeps it; the next save prunes it."""
    from homelab_ft.export import merged

    _, run = trained
    copy = _copy(run, tmp_path / "run")
    read = checkpoint.latest(copy)
    newer = read.parent / f"step_{checkpoint.step_of(read) + 1:06d}"
    original = merged.write_merged

    def save_and_prune(*args, **kwargs):  # what checkpoint.save does once its new folder is in place
        shutil.copytree(read, newer)
        checkpoint._prune(read.parent, keep_last=1)
        return original(*args, **kwargs)

    monkeypatch.setattr(merged, "write_merged", save_and_prune)
    out = tmp_path / "out"
    assert main(["export", str(copy), "--out", str(out)]) == 0, capsys.readouterr().err
    assert read.is_dir()  # kept while the export read it
    checkpoint._prune(read.parent, keep_last=1)
    assert [p.name for p in checkpoint.candidates(copy)] == [newer.name]


def test_export_of_a_run_training_before_its_first_save(trained, tmp_path, capsys):
    _, run = trained
    copy = _copy(run, tmp_path / "run")
    shutil.rmtree(copy / "checkpoints")
    with open(copy / ".lock", "w") as fh:  # a trainer that has not saved yet holds the run's lock
        fcntl.flock(fh, fcntl.LOCK_EX)
        err = _one_line(capsys, main(["export", str(copy), "--out", str(tmp_path / "out")]))
    assert "is training" in err and "no complete checkpoint yet" in err, err
