"""`homelab-ft train` of a 2-process recipe under SIGTERM and with a rank killed by SIGKILL.

Two launches: the first is stopped with SIGTERM sent to the `homelab-ft train` command only
(it must reach both ranks through torchrun, leave a checkpoint and no process behind); the second
resumes it, is compared with one process on the whole batch, and then loses rank 1 to kill -9
(the OOM killer's signal): the job must end within seconds with one line naming the rank.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import build_recipe
import pytest
from procs import REPO, child_env, write_chat_data

from homelab_ft.cli.main import main
from homelab_ft.store import checkpoint
from homelab_ft.train.metrics import read_metrics

TOL = 1e-5  # one process on micro-batch 2B vs two ranks on B (test_sharded.py)


def _recipe(tmp: Path, model_dir: Path, *, procs: int) -> Path:
    return build_recipe.write_recipe(tmp / f"recipe{procs}.yaml", build_recipe.tiny_run(
        model_dir, method="full", rows=tmp / "train.jsonl", lora=None, data={"max_length": 160},
        train={"max_steps": 100000, "micro_batch_size": 4 // procs, "grad_accum_steps": 2, "lr": 1e-3,
               "lr_schedule": "constant", "save_every": 0, "num_threads": 1},
        cluster={"nodes": 1, "gpus_per_node": procs}, sharding={"strategy": "full_shard"} if procs > 1 else {}))


def _steps(run: Path) -> dict[int, float]:
    path = run / "metrics.jsonl"
    return {r["step"]: r["loss"] for r in read_metrics(path) if "loss" in r} if path.is_file() else {}


def _job_pids(marker: str) -> dict[int, str]:
    """pid -> RANK (or '' for the launcher and torchrun) of every live process whose command line
    names `marker` (the run directory)."""
    found = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            if marker not in (entry / "cmdline").read_bytes().decode(errors="replace"):
                continue
            if (entry / "stat").read_text().split(")")[-1].split()[0] == "Z":
                continue
            env = dict(v.split("=", 1) for v in (entry / "environ").read_bytes().decode(errors="replace").split("\0") if "=" in v)
        except OSError:
            continue
        found[int(entry.name)] = env.get("RANK", "") if "TORCHELASTIC_RUN_ID" in env else ""
    return found


def _start(recipe: Path, run: Path, *extra: str) -> subprocess.Popen:
    """`homelab-ft train` with its temporary files in TMP beside the run, which must stay empty."""
    return subprocess.Popen([sys.executable, "-m", "homelab_ft", "train", str(recipe), "--run-dir", str(run), *extra],
                            env=child_env(tmpdir=run.parent / "tmp"), cwd=REPO, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)


def _wait_for(predicate, proc: subprocess.Popen, *, timeout: float = 180) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if proc.poll() is not None:
            raise AssertionError(f"ended early ({proc.returncode}):\n{proc.stderr.read()[-4000:]}")
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.2)


def _finish(proc: subprocess.Popen, marker: str, *, timeout: float) -> str:
    try:
        _, err = proc.communicate(timeout=timeout)
    finally:
        if proc.poll() is None:
            proc.kill()
    time.sleep(0.5)
    assert _job_pids(marker) == {}, f"processes outlived the command: {_job_pids(marker)}"
    return err


def test_sigterm_then_a_killed_rank(tmp_path, tiny_model_dir):
    write_chat_data(tmp_path / "train.jsonl", 64)
    two, one = _recipe(tmp_path, tiny_model_dir, procs=2), _recipe(tmp_path, tiny_model_dir, procs=1)
    run = tmp_path / "run2"

    proc = _start(two, run)
    _wait_for(lambda: _steps(run), proc)
    proc.send_signal(signal.SIGTERM)  # to `homelab-ft train` only, as systemd or docker stop would
    err = _finish(proc, str(run), timeout=60)
    assert proc.returncode == 143, err
    said = [line for line in err.splitlines() if line.startswith("homelab-ft:")]
    assert len(said) == 1 and "SIGTERM after step" in said[0] and "Traceback" not in err, err
    # rank 0 of torchrun's workers says it: the recipe as typed, the run directory, not the overrides
    # the launching process made of the flags (issue 24, item 6)
    assert said[0].endswith(f"continue with: homelab-ft train {two} --resume --run-dir {run}"), err
    stopped = checkpoint.verify(checkpoint.newest_intact(run)).step
    assert checkpoint.verify(checkpoint.newest_intact(run)).world_size == 2

    proc = _start(two, run, "--resume")
    _wait_for(lambda: stopped + 2 in _steps(run), proc)
    ranks = {rank: pid for pid, rank in _job_pids(str(run)).items() if rank}
    assert sorted(ranks) == ["0", "1"]
    os.kill(ranks["1"], signal.SIGKILL)
    t0 = time.monotonic()
    err = _finish(proc, str(run), timeout=60)
    assert time.monotonic() - t0 < 15
    assert proc.returncode == 128 + signal.SIGKILL, err
    said = [line for line in err.splitlines() if line.startswith("homelab-ft:")]
    assert len(said) == 1 and "rank 1" in said[0] and "SIGKILL" in said[0] and "OOM" in said[0], err
    assert "ChildFailedError" not in err and "Traceback" not in err, err
    assert not list((tmp_path / "tmp").iterdir())  # torchrun's log folders removed, after a signal and a killed rank

    reference = tmp_path / "run1"
    assert main(["train", str(one), "--run-dir", str(reference), f"train.max_steps={stopped + 2}"]) == 0
    resumed, expected = _steps(run), _steps(reference)
    for step in range(1, stopped + 3):
        assert resumed[step] == pytest.approx(expected[step], abs=TOL), step
