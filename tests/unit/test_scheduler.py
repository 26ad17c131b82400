"""tests/conftest.py's xdist scheduler: which tests run on one worker together. (xdist's own
`loadgroup` marks stopped grouping anything under pytest 9.2 without a word; this notices.)"""

from __future__ import annotations

import importlib.util
import types
from pathlib import Path

import pytest


def _scheduler(dist: str):
    spec = importlib.util.spec_from_file_location("tests_conftest", Path(__file__).resolve().parents[1] / "conftest.py")
    conftest = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(conftest)
    values = {"dist": dist, "tx": ["2*popen"], "numprocesses": 2}
    config = types.SimpleNamespace(getvalue=values.get, getoption=lambda name, default=None: values.get(name, default))
    return conftest.pytest_xdist_make_scheduler(config, log=None)


def test_modules_sharing_fixtures_and_the_distributed_tests_run_together():
    split = _scheduler("loadfile")._split_scope
    eval_run = "tests/e2e/test_eval_run.py"  # its tests share a module fixture: a trained run
    assert split(f"{eval_run}::test_a") == split(f"{eval_run}::test_b[x]") == eval_run
    mmproj = "tests/unit/export/gguf/test_gguf_mmproj.py"  # uses conftest's module-scoped `vlm`
    assert split(f"{mmproj}::test_a") == mmproj
    assert split("tests/distributed/test_dpo.py::t") == split("tests/distributed/test_signals.py::t[x]") == "tests/distributed"
    # a module of independent tests: each wherever a worker is free
    assert split("tests/unit/root/test_fsio.py::test_a") != split("tests/unit/root/test_fsio.py::test_b")


@pytest.mark.parametrize("dist", ["each", "no", "worksteal"])
def test_other_modes_keep_xdists_own_scheduler(dist):
    assert _scheduler(dist) is None
