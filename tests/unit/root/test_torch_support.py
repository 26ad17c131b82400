"""The torch floor: one constant, the same in pyproject.toml, and a CLI that refuses an older
torch in one line (exit 2) before any command runs, naming both versions."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from homelab_ft import torch_support
from homelab_ft.cli.main import main
from homelab_ft.torch_support import TORCH_MIN, TorchTooOld, check_torch, release

ROOT = Path(__file__).resolve().parents[3]


def test_pyproject_declares_the_same_floor():
    text = (ROOT / "pyproject.toml").read_text()
    found = re.search(r'"torch>=(\d+)\.(\d+)"', text)
    assert found and (int(found.group(1)), int(found.group(2))) == TORCH_MIN


@pytest.mark.parametrize("version", ["2.9.0", "2.9.0a0+50eac811a6.nv25.10", "2.11.0+cu130", "2.13.0+cpu", "3.0.0"])
def test_supported_versions_pass(version):
    check_torch(version)


@pytest.mark.parametrize("version", ["2.8.0+cu128", "2.6.0", "1.13.1"])
def test_older_versions_are_refused_naming_both(version):
    with pytest.raises(TorchTooOld) as err:
        check_torch(version)
    assert version in str(err.value) and "torch >= 2.9" in str(err.value)


def test_release_reads_major_minor():
    assert release("2.11.0+cu130") == (2, 11)
    assert release("2.10.0a0") == (2, 10)


def test_cli_refuses_old_torch_in_one_line(capsys, monkeypatch, tmp_path):
    monkeypatch.setattr(torch_support, "installed_torch", lambda: "2.7.1+cu126")
    code = main(["plan", str(ROOT / "recipes" / "smollm2-lora-cpu.yaml")])
    err = capsys.readouterr().err.strip()
    assert code == 2
    assert err.splitlines() == [err] and "torch 2.7.1+cu126 is installed" in err and ">= 2.9" in err


def test_no_torch_is_left_to_the_commands(monkeypatch):
    monkeypatch.setattr(torch_support, "installed_torch", lambda: None)
    check_torch()
