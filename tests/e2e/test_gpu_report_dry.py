"""`bench/gpu_report.py --device cpu --tiny`: every part's code on a tiny Llama on the CPU, so the
report `make test-gpu` writes on a GPU is built and checked here (the figures mean nothing on CPU)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
MEMORY_ROWS = {"full", "full optim_in_bwd", "lora", "lora full logits", "lora ckpt", "lora offload", "lora compile",
               "qlora"}


def _report(tmp: Path, *extra: str) -> dict:
    out = tmp / "runs"
    cmd = [sys.executable, str(ROOT / "bench" / "gpu_report.py"), "--device", "cpu", "--tiny", "--out", str(out),
           "--rounds", "1", "--steps", "1", "--memory-steps", "1", *extra]
    proc = subprocess.run(cmd, env=dict(os.environ, PYTHONPATH=str(ROOT)), capture_output=True, text=True,
                          timeout=900, check=False)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert (out / "gpu-report.md").is_file()
    return json.loads((out / "gpu-report.json").read_text())


# slow (make test-all): 13 s of a whole dry report; make test keeps the report's budget cut (test_a_spent_budget_cuts_that_part_only)
@pytest.mark.slow
def test_dry_run_fills_every_field(tmp_path):
    report = _report(tmp_path)
    assert {"gpu", "torch", "peak_tflops", "peak_source", "model", "batch", "seq_len", "wall_s", "skipped"} <= set(report)
    parts = {p["name"]: p for p in report["parts"]}
    assert list(parts) == ["cuda_tests", "memory", "throughput", "bitsandbytes"]
    assert parts["cuda_tests"]["status"] == "skipped"
    memory = {r["row"]: r for r in parts["memory"]["rows"]}
    assert set(memory) == MEMORY_ROWS
    for row in memory.values():
        assert row["status"] == "ok", row
        assert row["allocated_bytes"] > 0 and row["reserved_bytes"] > 0 and row["planned_bytes"] > 0
        assert row["ratio"] == round(row["allocated_bytes"] / row["planned_bytes"], 3)
    assert [r["method"] for r in parts["throughput"]["rows"]] == ["full", "lora", "qlora"]
    for row in parts["throughput"]["rows"]:
        assert row["flops_per_token"] > 0
        for loop in ("ours", "plain", "hf_trainer"):
            assert row[loop]["tokens_per_s"] > 0 and row[loop]["steps"] == 1 and "mfu" in row[loop]
        assert row["ours_over_plain"] > 0 and row["ours_over_hf_trainer"] > 0
    assert parts["bitsandbytes"]["status"] == "ok"
    bnb = {r["path"].split()[0]: r for r in parts["bitsandbytes"]["rows"]}
    assert set(bnb) == {"dequantize_4bit", "gemv_4bit", "matmul_4bit"} and len(parts["bitsandbytes"]["rows"]) == 4
    assert all(r["rel_error"] <= 0.02 and r["status"] == "ok" for r in parts["bitsandbytes"]["rows"])
    md = (tmp_path / "runs" / "gpu-report.md").read_text()
    assert "## memory: ok" in md and "## skipped" in md and "ours_over_hf_trainer" in md


def test_a_spent_budget_cuts_that_part_only(tmp_path):
    report = _report(tmp_path, "--parts", "memory,throughput,bitsandbytes", "--memory-budget-s", "0",
                     "--throughput-budget-s", "0")
    parts = {p["name"]: p for p in report["parts"]}
    assert parts["memory"]["status"] == "cut" and "budget spent" in parts["memory"]["note"]
    assert {r["status"] for r in parts["memory"]["rows"]} == {"cut"} and len(parts["memory"]["rows"]) == len(MEMORY_ROWS)
    assert parts["throughput"]["status"] == "cut"
    assert parts["bitsandbytes"]["status"] == "ok"
