"""The per-test budget of tests/budget.py fails a unit test that spends more CPU than its share,
also when the CPU is spent in a child process, and leaves the others alone."""

from __future__ import annotations

import budget
import pytest

BURN = '''
import subprocess, sys, time


def _burn(seconds):
    end = time.process_time() + seconds
    while time.process_time() < end:
        pass


def test_cheap():
    pass


def test_costly():
    _burn(0.25)


def test_costly_child():
    subprocess.run([sys.executable, "-c", "import time\\nend = time.process_time() + 0.25\\n"
                    "while time.process_time() < end: pass"], check=True)
'''


def _session(tmp_path, monkeypatch, *args: str):
    (tmp_path / "tests" / "unit").mkdir(parents=True)
    (tmp_path / "tests" / "unit" / "test_burn.py").write_text(BURN)
    (tmp_path / "tests" / "e2e").mkdir()
    (tmp_path / "tests" / "e2e" / "test_burn_e2e.py").write_text(BURN)
    (tmp_path / "pytest.ini").write_text("[pytest]\n")
    monkeypatch.chdir(tmp_path)
    reports = []

    class Collect:
        def pytest_runtest_logreport(self, report):
            reports.append(report)

    code = pytest.main(["-q", "-p", "no:cacheprovider", "-p", "no:xdist", "--import-mode=importlib", *args, "tests"],
                       plugins=[budget, Collect()])
    failed = {r.nodeid for r in reports if r.failed}
    return code, failed


def test_a_unit_test_over_its_cpu_budget_fails_children_included(tmp_path, monkeypatch):
    code, failed = _session(tmp_path, monkeypatch, "--unit-budget-cpu-s=0.12")
    assert code == pytest.ExitCode.TESTS_FAILED
    assert failed == {"tests/unit/test_burn.py::test_costly", "tests/unit/test_burn.py::test_costly_child"}


def test_within_budget_or_outside_tests_unit_passes(tmp_path, monkeypatch):
    code, failed = _session(tmp_path, monkeypatch, "--unit-budget-cpu-s=5")
    assert code == pytest.ExitCode.OK and not failed


def test_readme_states_the_budget():
    from pathlib import Path

    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    assert f"{budget.UNIT_BUDGET_CPU_S:g} CPU seconds" in readme
