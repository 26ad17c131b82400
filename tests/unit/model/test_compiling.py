"""`train.compile` where torch.compile cannot run: one line naming train.compile and the fix,
exit 2, before the run directory exists (compiling.check_available, called by preflight)."""

from __future__ import annotations

import sysconfig

import build_recipe
import pytest
import torch
import torch._inductor.config as inductor_config

from homelab_ft.cli.main import main
from homelab_ft.errors import UserError
from homelab_ft.model import compiling


def test_available_here():
    compiling.check_available(device_type="cpu")  # g++ and Python.h are installed on this machine
    assert compiling.cxx_compiler()


def test_torch_without_compile(monkeypatch):
    monkeypatch.delattr(torch, "compile")
    with pytest.raises(UserError, match=r"train.compile=true needs torch.compile .*upgrade torch or set train.compile=false"):
        compiling.check_available(device_type="cpu")


def test_python_that_dynamo_does_not_support(monkeypatch):
    from torch import _dynamo

    monkeypatch.setattr(_dynamo, "is_dynamo_supported", lambda: False)
    with pytest.raises(UserError, match=r"cannot compile on Python 3\.\d+.*set train.compile=false"):
        compiling.check_available(device_type="cpu")


NO_CXX = {"cpp.cxx": (None, "no-such-cxx-compiler")}  # inductor's own config.patch restores it


def test_no_cxx_compiler():
    with inductor_config.patch(NO_CXX):
        assert compiling.cxx_compiler() is None
        with pytest.raises(UserError, match=r"no C\+\+ compiler \(no-such-cxx-compiler\) on PATH.*apt install g\+\+"):
            compiling.check_available(device_type="cpu")


def test_no_python_headers(monkeypatch, tmp_path):
    real = sysconfig.get_path
    monkeypatch.setattr(sysconfig, "get_path", lambda name, *a, **k: str(tmp_path) if name == "include" else real(name, *a, **k))
    with pytest.raises(UserError, match=r"Python.h is missing.*python3-dev"):
        compiling.check_available(device_type="cpu")


def test_cuda_without_triton(monkeypatch):
    import torch.utils._triton as triton_utils

    monkeypatch.setattr(triton_utils, "has_triton", lambda: False)
    with pytest.raises(UserError, match=r"on CUDA needs Triton"):
        compiling.check_available(device_type="cuda")


def test_cli_refuses_before_the_run_directory(capsys, tmp_path, tiny_model_dir):
    (tmp_path / "train.jsonl").write_text('{"text": "the quick brown fox"}\n')
    recipe = build_recipe.write_recipe(tmp_path / "r.yaml", build_recipe.tiny_run(
        tiny_model_dir, lora=None, data={"sources": [{"path": "train.jsonl", "format": "text"}], "max_length": None},
        train={"max_steps": None, "micro_batch_size": None, "compile": True}, output=None))
    run = tmp_path / "run"
    with inductor_config.patch(NO_CXX):
        code = main(["train", str(recipe), "--run-dir", str(run)])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1, err
    assert "train.compile=true" in err and "set train.compile=false" in err and "Traceback" not in err
    assert not run.exists()
