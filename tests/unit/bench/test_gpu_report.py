"""`make test-gpu` without a GPU: one line, exit 0, nothing run or written; and the MFU arithmetic."""

from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]


def _report_module():
    spec = importlib.util.spec_from_file_location("gpu_report", ROOT / "bench" / "gpu_report.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["gpu_report"] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def test_make_test_gpu_runs_the_report():
    makefile = (ROOT / "Makefile").read_text()
    recipe = re.search(r"^test-gpu:.*\n((?:\t.*\n)+)", makefile, re.MULTILINE).group(1)
    assert "bench/gpu_report.py" in recipe


def test_no_cuda_says_so_in_one_line_and_exits_0(capsys, monkeypatch, tmp_path):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    out = tmp_path / "runs"
    assert _report_module().main(["--out", str(out)]) == 0
    captured = capsys.readouterr()
    assert len(captured.out.strip().splitlines()) == 1 and "no CUDA GPU" in captured.out
    assert not out.exists()


def test_flops_per_token():
    report = _report_module()
    # full: 6N; adapters: 4N for the frozen base (forward 2N, activation gradients 2N) + 6 per adapter weight
    assert report.flops_per_token("full", num_params=1000, num_trainable=1000) == 6000
    assert report.flops_per_token("lora", num_params=1000, num_trainable=10) == 4060


@pytest.mark.parametrize("name", ["NVIDIA H200", "NVIDIA GeForce RTX 4090"])
def test_peak_figure_comes_from_the_one_gpu_table(monkeypatch, name):
    import torch

    from homelab_ft.plan import gpus

    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *_: name)
    found, peak, source = _report_module()._gpu("cuda")
    assert found == name and peak == gpus.lookup(name).tflops and "plan/gpus.py" in source
