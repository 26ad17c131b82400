"""`homelab-ft doctor`'s point-to-point line for a pipelined recipe (cluster/doctor/p2p.py): which
ranks each boundary times, which recipes get the check, and the report line, without a process group
(tests/distributed/test_doctor_p2p_netns.py times a real shaped link)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from homelab_ft.cluster.doctor import p2p as doctor_p2p
from homelab_ft.cluster.doctor import report
from homelab_ft.cluster.doctor.p2p import StageLink
from homelab_ft.cluster.doctor.report import OK, WARN
from homelab_ft.recipe.config import recipe_from_dict


@pytest.mark.parametrize(("stages", "world", "pairs"), [
    (2, 2, [(0, 1)]),
    (2, 4, [(0, 2)]),  # 2 stages x 2 replicas: rank = stage x replicas + replica (pipeline.process_groups' mesh)
    (4, 4, [(0, 1), (1, 2), (2, 3)]),
])
def test_each_boundary_is_timed_between_the_first_replicas_of_neighbouring_stages(stages, world, pairs):
    assert doctor_p2p.boundary_ranks(stages=stages, world_size=world) == pairs


def test_only_a_recipe_that_names_a_pipeline_gets_the_check(tiny_model_dir):
    def recipe(**sharding):
        return recipe_from_dict({"method": "lora", "model": {"path": str(tiny_model_dir)},
                                 "train": {"grad_accum_steps": 4}, "sharding": sharding})

    assert doctor_p2p.recipe_stages(recipe(pipeline_stages=2), world_size=2) == 2
    assert doctor_p2p.recipe_stages(recipe(), world_size=2) == 1
    assert doctor_p2p.recipe_stages(recipe(pipeline_stages="auto"), world_size=2) == 1
    assert doctor_p2p.recipe_stages(recipe(pipeline_stages=2), world_size=3) == 1  # the plan's line says why
    assert doctor_p2p.recipe_stages(None, world_size=2) == 1


def test_the_report_line_gives_each_boundary_its_send_bandwidth_against_the_nic():
    fast = StageLink(stage=0, src="10.0.0.1", dst="10.0.0.2", nbytes=4 * 2**20, seconds=4 * 2**20 * 8 / 0.94e9)
    slow = StageLink(stage=1, src="10.0.0.2", dst="10.0.0.3", nbytes=2**20, seconds=2**20 * 8 / 0.1e9)
    inside = StageLink(stage=2, src="10.0.0.3", dst="10.0.0.3", nbytes=2**20, seconds=2**20 * 8 / 0.05e9)
    lines = doctor_p2p.stage_lines([fast, slow, inside], expected_gbit=1.0)
    assert [(ln.check, ln.node, ln.verdict) for ln in lines] == [
        ("p2p stage 0 -> 1", "10.0.0.1 -> 10.0.0.2", OK),
        ("p2p stage 1 -> 2", "10.0.0.2 -> 10.0.0.3", WARN),
        ("p2p stage 2 -> 3", "10.0.0.3", OK),  # inside one node: not judged against the NIC
    ]
    assert lines[0].result == "940.0 Mbit/s at 4 MiB (send/recv, what a pipeline boundary carries)"
    assert "under 50% of the NIC's 1.00 Gbit/s" in lines[1].fix
    table = report.format_table(lines, title="homelab-ft doctor: test")
    assert "p2p stage 0 -> 1" in table and "940.0 Mbit/s" in table


def test_without_every_nics_speed_the_line_is_not_judged():
    slow = StageLink(stage=0, src="a", dst="b", nbytes=2**20, seconds=2**20 * 8 / 0.1e9)
    nodes = [SimpleNamespace(nic_speed_mbit=1000), SimpleNamespace(nic_speed_mbit=None)]
    assert [ln.verdict for ln in doctor_p2p.report_lines([slow], nodes)] == [OK]
    nodes[1].nic_speed_mbit = 1000
    assert [ln.verdict for ln in doctor_p2p.report_lines([slow], nodes)] == [WARN]
    assert doctor_p2p.report_lines([], nodes) == []
