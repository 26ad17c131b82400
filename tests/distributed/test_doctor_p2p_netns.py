"""`homelab-ft doctor RECIPE` of a 2-stage pipelined recipe on two namespace nodes joined by a
shaped link: the table gains the boundary's point-to-point line, timed with torch.distributed
send/recv across the link, near the link's rate (tbf: gloo reaches 90-97% of it). Root only."""

from __future__ import annotations

import re

import build_recipe
import netns
import pytest
from procs import child_env
from test_doctor_cluster import _node_lines, _run_on_nodes

pytestmark = pytest.mark.skipif(netns.unavailable() is not None, reason=netns.unavailable() or "")

RATE_MBIT = 50


def test_doctor_times_the_pipeline_boundary_between_the_stages_nodes(capsys, tmp_path, tiny_model_dir):
    recipe = build_recipe.write_recipe(tmp_path / "pp.yaml", build_recipe.tiny_run(
        tiny_model_dir, lora=None, data=None, train={"max_steps": None, "micro_batch_size": None, "grad_accum_steps": 4},
        output=None, cluster={"nodes": 2, "gpus_per_node": 1, "device": "cpu"},
        sharding={"strategy": "no_shard", "pipeline_stages": 2}))
    with netns.shaped_link(RATE_MBIT) as link:
        lines = _node_lines(capsys, link, tmp_path, str(recipe), "--run-dir", str(tmp_path / "run"),
                            "--join-timeout", "120")
        head, other = _run_on_nodes(link, lines, [child_env(), child_env()])
    a, b = (n.addr for n in link.nodes)
    assert (head.returncode, other.returncode) == (0, 0), head.stdout + head.stderr[-3000:] + other.stderr[-3000:]
    line = next((ln for ln in head.stdout.splitlines() if ln.startswith("p2p stage 0 -> 1")), None)
    assert line is not None, head.stdout
    # the veth reports a 10 Gbit/s NIC with the shaper behind it: under half of it warns, as the
    # collectives' lines do on this link (docs/multi-node.md's doctor table)
    assert f"{a} -> {b}" in line and line.endswith("warn"), line
    mbit = float(re.search(r"([\d.]+) Mbit/s", line).group(1))
    assert mbit == pytest.approx(RATE_MBIT, rel=0.2), line
