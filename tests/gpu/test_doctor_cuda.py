"""On a CUDA machine: `homelab-ft doctor` alone on it, one process per GPU over NCCL.

Written without a GPU at hand (`make test-gpu` runs it): the GPU facts must be torch's own, the
cluster file must describe the GPUs as `plan` needs them, and with two GPUs or more the NCCL
collectives inside the node must be timed and peer-to-peer reported.
"""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from procs import REPO, child_env

from homelab_ft.cluster import clusterfile

pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (make test-gpu)")]


def test_doctor_on_this_gpu_machine(tmp_path):
    out = tmp_path / "cluster.yaml"
    proc = subprocess.run([sys.executable, "-m", "homelab_ft", "doctor", "--out", str(out), "--run-dir", str(tmp_path)],
                          env=child_env(), cwd=REPO, capture_output=True, text=True, timeout=600)
    assert proc.returncode in (0, 2), proc.stderr[-3000:]
    table = proc.stdout
    count = torch.cuda.device_count()
    props = torch.cuda.get_device_properties(0)
    assert f"x {props.name} {props.total_memory / 2**30:.1f} GiB, cc {props.major}.{props.minor}" in table, table
    assert "NCCL (CUDA)" in table and "none (CPU build" not in table
    nccl_line = next(ln for ln in table.splitlines() if ln.startswith("nccl "))
    assert "none" not in nccl_line
    values = clusterfile.read(out)
    smallest = min(torch.cuda.get_device_properties(i).total_memory for i in range(count))
    assert values["device"] == "cuda" and values["gpus_per_node"] == count
    assert values["vram_gib"] == pytest.approx(smallest / 2**30, abs=0.01)
    if count > 1:
        assert "all-reduce inside node" in table and "peer-to-peer" in table
        assert values["intra_link_gbit"] > 1 and values["intra_link"] in ("pcie", "nvlink")
