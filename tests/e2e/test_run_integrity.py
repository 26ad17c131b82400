"""Run integrity on a tiny LoRA run: damaged checkpoints, planted pickles, a run directory's lock,
resume overrides, SIGTERM, and a full disk.

One trained run (4 steps, checkpoints at 2 and 4) is copied and damaged per test; each resume
trains at most two steps of a 2-layer model.
"""

from __future__ import annotations

import json
import os
import pickle
import shlex
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
from homelab_ft.store import checkpoint, manifest
from homelab_ft.train.metrics import read_metrics


def _recipe(tmp: Path, model_dir: Path, **train) -> Path:
    procs.write_chat_data(tmp / "train.jsonl", 48, answer_prefix="answer: ", max_q_words=8, max_a_words=6)
    return build_recipe.write_recipe(tmp / "tiny.yaml", build_recipe.tiny_run(
        model_dir, lora={"dropout": 0.1},
        # constant LR: a run stopped early and resumed with another max_steps has the same schedule
        train={"max_steps": 4, "micro_batch_size": 4, "lr": 5e-3, "lr_schedule": "constant",
               "save_every": 2, "keep_last": 5, **train}))


def _said(capsys, caplog) -> str:
    """stderr plus logged records (the library logs; pytest's logging plugin keeps those apart)."""
    return capsys.readouterr().err + caplog.text


def _losses(run: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in read_metrics(run / "metrics.jsonl") if "loss" in r}


@pytest.fixture(scope="module")
def trained(tmp_path_factory, tiny_model_dir):
    tmp = tmp_path_factory.mktemp("integrity")
    recipe = _recipe(tmp, tiny_model_dir)
    run = tmp / "run"
    assert main(["train", str(recipe), "--run-dir", str(run)]) == 0
    return recipe, run, _losses(run)


def _copy(run: Path, dst: Path) -> Path:
    shutil.copytree(run, dst)
    return dst


def _step(run: Path, step: int) -> Path:
    return run / "checkpoints" / f"step_{step:06d}"


def _shard(ckpt: Path) -> Path:
    return next((ckpt / "state").glob("*.distcp"))


def _truncate(ckpt: Path) -> None:
    shard = _shard(ckpt)
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])


def _zero(ckpt: Path) -> None:
    shard = _shard(ckpt)
    data = bytearray(shard.read_bytes())
    data[-600:-300] = bytes(300)  # same size: only the hash can tell
    shard.write_bytes(bytes(data))


def _edit_state(ckpt: Path) -> None:
    path = ckpt / "trainer_state.json"
    state = json.loads(path.read_text())
    state["sampler"]["rows_consumed"] += 4
    path.write_text(json.dumps(state, indent=1))


def _drop_metadata(ckpt: Path) -> None:
    (ckpt / "state" / ".metadata").unlink()


@pytest.mark.parametrize("damage", [_truncate, _zero, _edit_state, _drop_metadata], ids=lambda f: f.__name__[1:])
def test_damaged_newest_checkpoint_falls_back(trained, tmp_path, damage, capsys, caplog):
    recipe, run, full = trained
    copy = _copy(run, tmp_path / "run")
    damage(_step(copy, 4))
    assert main(["train", str(recipe), "--run-dir", str(copy), "--resume"]) == 0
    err = _said(capsys, caplog)
    assert "step_000004" in err and "going back to step_000002 (step 2)" in err, err
    resumed = _losses(copy)
    assert [r["step"] for r in read_metrics(copy / "metrics.jsonl")] == [1, 2, 3, 4]  # no duplicated rows
    for step in (3, 4):
        assert resumed[step] == pytest.approx(full[step], abs=1e-6), step
    checkpoint.verify(_step(copy, 4))  # rewritten intact


def test_no_intact_checkpoint_refuses_and_touches_nothing(trained, tmp_path, capsys):
    recipe, run, _ = trained
    copy = _copy(run, tmp_path / "run")
    _zero(_step(copy, 4))
    _truncate(_step(copy, 2))
    before = (copy / "metrics.jsonl").read_bytes()
    assert main(["train", str(recipe), "--run-dir", str(copy), "--resume"]) == 2
    err = capsys.readouterr().err
    assert "no intact checkpoint" in err and "SHA-256" in err and "bytes" in err
    assert len(err.strip().splitlines()) == 1
    assert (copy / "metrics.jsonl").read_bytes() == before


class _Planted:
    """A pickle that would create a file when unpickled (what an attacker plants as .metadata)."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def _plant(ckpt: Path, marker: Path) -> None:
    """Replace state/.metadata and make the manifest agree, so only the unpickler stands between."""
    path = ckpt / "state" / ".metadata"
    path.write_bytes(pickle.dumps(_Planted(marker)))
    data = json.loads((ckpt / manifest.NAME).read_text())
    data["files"]["state/.metadata"] = manifest.hash_file(path)
    (ckpt / manifest.NAME).write_text(json.dumps(data))


def test_planted_metadata_pickle_never_runs(trained, tmp_path, capsys):
    recipe, run, _ = trained
    copy = _copy(run, tmp_path / "run")
    marker = tmp_path / "pwned"
    for step in (2, 4):
        _plant(_step(copy, step), marker)
    assert main(["train", str(recipe), "--run-dir", str(copy), "--resume"]) == 2
    assert main(["export", str(copy), "--out", str(tmp_path / "export")]) == 2
    err = capsys.readouterr().err
    assert "posix.system" in err, err
    assert not marker.exists()
    assert not (tmp_path / "export").exists()


def test_export_needs_the_flag_for_remote_code(trained, tmp_path, capsys):
    _, run, _ = trained
    copy = _copy(run, tmp_path / "run")
    saved = yaml.safe_load((copy / "recipe.yaml").read_text())
    saved["model"]["trust_remote_code"] = True
    (copy / "recipe.yaml").write_text(yaml.safe_dump(saved))
    assert main(["export", str(copy), "--out", str(tmp_path / "export")]) == 2
    assert "--trust-remote-code" in capsys.readouterr().err
    assert not (tmp_path / "export").exists()


def test_resume_refuses_optimisation_overrides(trained, tmp_path, capsys):
    recipe, run, _ = trained
    copy = _copy(run, tmp_path / "run")
    saved = (copy / "recipe.yaml").read_bytes()
    assert main(["train", str(recipe), "--run-dir", str(copy), "--resume", "train.lr=5e-4"]) == 2
    assert "cannot change train.lr" in capsys.readouterr().err
    # on two processes the refusal comes before torchrun starts: one line, at once
    assert main(["train", str(recipe), "--run-dir", str(copy), "--resume", "cluster.gpus_per_node=2",
                 "sharding.strategy=full_shard"]) == 2
    err = capsys.readouterr().err
    assert err.count("homelab-ft:") == 1 and "rows per optimizer step (train.micro_batch_size" in err, err
    # the same global batch split over two processes is a legitimate resume
    from homelab_ft.recipe import config
    from homelab_ft.store import rundir

    old = config.load_recipe(copy / "recipe.yaml")
    halves = config.load_recipe(recipe, ["train.micro_batch_size=2", "cluster.gpus_per_node=2"])
    rundir.check_resume_overrides(old, halves, saved=copy / "recipe.yaml")
    assert (copy / "recipe.yaml").read_bytes() == saved


def test_resume_without_checkpoint_drops_logged_rows_and_takes_over_a_stale_lock(trained, tmp_path, capsys, caplog):
    """A kill during the first save leaves a metrics row of step 1 and no checkpoint; the dead
    run's lock names a pid that no longer runs."""
    recipe, run, full = trained
    copy = _copy(run, tmp_path / "run")
    shutil.rmtree(copy / "checkpoints")
    (copy / "checkpoints" / ".tmp-step_000002" / "state").mkdir(parents=True)  # the killed save
    (copy / ".lock").write_text("host elsewhere pid 999999 since 2026-01-01 00:00:00\n")
    assert main(["train", str(recipe), "--run-dir", str(copy), "--resume-or-start", "train.max_steps=1"]) == 0
    assert [p.name for p in (copy / "checkpoints").iterdir()] == ["step_000001"]
    assert "took over the lock" in _said(capsys, caplog)
    assert [r["step"] for r in read_metrics(copy / "metrics.jsonl")] == [1]
    assert _losses(copy)[1] == pytest.approx(full[1], abs=1e-6)


def _wait_for(predicate, *, timeout: float, proc=None) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if proc is not None and proc.poll() is not None:
            raise AssertionError(f"process ended early ({proc.returncode}):\n{proc.stderr.read()}")
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.1)


def test_sigterm_stops_with_a_checkpoint_and_one_writer_per_run(trained, tmp_path, capsys):
    recipe, _, _ = trained
    run = tmp_path / "run"
    proc = subprocess.Popen(
        [sys.executable, "-m", "homelab_ft", "train", str(recipe), "--run-dir", str(run),
         "train.max_steps=100000", "train.save_every=0"],
        env=procs.child_env(), cwd=procs.REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
    )
    try:
        _wait_for(lambda: (run / "metrics.jsonl").is_file(), timeout=120, proc=proc)
        # A second writer is refused while the first runs: resume, overwrite, or a plain train.
        for extra in (["--resume"], ["--overwrite"], []):
            assert main(["train", str(recipe), "--run-dir", str(run), *extra]) == 2
            err = capsys.readouterr().err
            assert f"pid {proc.pid}" in err and "in use" in err, err
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 143, err
    lines = [line for line in err.splitlines() if line.startswith("homelab-ft:")]
    assert len(lines) == 1 and "SIGTERM after step" in lines[0], err
    # The line names the real recipe and the overrides the run was started with (issue 24, item 6).
    again = f"homelab-ft train {recipe} train.max_steps=100000 train.save_every=0 --resume --run-dir {run}"
    assert lines[0].endswith(f"continue with: {again}"), err
    ckpt = checkpoint.newest_intact(run)
    stopped = checkpoint.verify(ckpt).step
    assert stopped >= 1
    # ... and it runs as printed (one override more, for a short test: the later value wins).
    assert main([*shlex.split(again)[1:], f"train.max_steps={stopped + 2}"]) == 0
    # the reference: the same recipe run without a stop to the same step
    reference = tmp_path / "reference"
    assert main(["train", str(recipe), "--run-dir", str(reference), f"train.max_steps={stopped + 2}",
                 "train.save_every=0"]) == 0
    resumed, expected = _losses(run), _losses(reference)
    assert sorted(resumed) == list(range(1, stopped + 3))
    for step in (stopped + 1, stopped + 2):
        assert resumed[step] == pytest.approx(expected[step], abs=1e-6), step


@pytest.fixture
def small_disk(tmp_path):
    """A 700 KiB tmpfs: room for the run's files and one checkpoint of the tiny run (~400 KiB)
    but not two."""
    yield from procs.small_tmpfs(tmp_path / "small", "700k")


def test_full_disk_keeps_the_previous_checkpoint(trained, small_disk, capsys):
    recipe, _, _ = trained
    run = small_disk / "run"
    code = main(["train", str(recipe), "--run-dir", str(run), "train.save_every=1", "train.keep_last=1"])
    err = capsys.readouterr().err
    assert code == 2, err
    line = err.strip().splitlines()[-1]
    assert "checkpoint of step 2 not saved" in line and "bytes free" in line and "needs about" in line, err
    assert [p.name for p in (run / "checkpoints").iterdir()] == ["step_000001"]  # no .tmp-step_000002 left
    assert checkpoint.verify(run / "checkpoints" / "step_000001").step == 1
