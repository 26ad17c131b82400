"""`homelab-ft doctor` on a 2-node cluster of network namespaces joined by a tbf-shaped veth pair.

Each test does what a user does: `doctor --hosts` prints one command per node, and each line runs
on its node (here: inside its namespace), one CPU process per node over gloo. The measured link
must come within 20% of the shaped rate, and the cluster file must be one `plan` takes. A node
given another torch version (a fake distribution record first on its PYTHONPATH, which is where
pip's metadata, and so doctor, reads versions from) is a FAIL line naming both; a node that never
joins ends the head's wait with one line naming it.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import time

import build_recipe
import netns
import pytest
from procs import REPO, child_env

from homelab_ft.cli import main as cli
from homelab_ft.cluster import clusterfile
from homelab_ft.plan.planner import plan_for_recipe
from homelab_ft.recipe.config import recipe_from_dict

pytestmark = pytest.mark.skipif(netns.unavailable() is not None, reason=netns.unavailable() or "")


def _node_lines(capsys, link, tmp_path, *extra: str) -> list[str]:
    """The per-node commands `doctor --hosts` prints (the CLI in this process: a second interpreter
    would add seconds of start-up; the checks the head makes on itself are in tests/unit/cluster/doctor/test_doctor.py)."""
    hosts = tmp_path / "hosts"
    hosts.write_text("".join(f"{n.addr}\n" for n in link.nodes))
    capsys.readouterr()
    code = cli.main(["doctor", "--hosts", str(hosts), "--iface", netns.IFACE, "--workdir", str(REPO), *extra])
    out, err = capsys.readouterr()
    assert code == 0, err
    lines = [ln for ln in out.splitlines() if ln and not ln.startswith("#")]
    assert len(lines) == 2
    return lines


def _run_on_nodes(link, lines, envs, *, nodes=None) -> list[subprocess.CompletedProcess]:
    """Each line on its node (`link.nodes`, or `nodes`), all at once."""
    procs = [subprocess.Popen(n.wrap(["bash", "-c", line]), env=env, cwd=REPO, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True)
             for n, line, env in zip(nodes or link.nodes, lines, envs, strict=True)]
    done = []
    for proc in procs:
        out, err = proc.communicate(timeout=240)
        done.append(subprocess.CompletedProcess(proc.args, proc.returncode, out, err))
    return done


def _fake_torch(tmp_path, version: str) -> str:
    """A directory whose torch distribution record says `version` (the real torch still runs)."""
    site = tmp_path / "fake-site"
    info = site / f"torch-{version}.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: torch\nVersion: {version}\n")
    return str(site)


@pytest.mark.parametrize("rate_mbit, other_torch", [(50, None), (200, "2.99.0")])
def test_doctor_measures_the_shaped_link_and_reports_another_torch(capsys, tmp_path, tiny_model_dir, rate_mbit,
                                                                   other_torch):
    out = tmp_path / "cluster.yaml"
    with netns.shaped_link(rate_mbit) as link:
        lines = _node_lines(capsys, link, tmp_path, "--out", str(out), "--run-dir", str(tmp_path / "run"), "--join-timeout", "120")
        envs = [child_env(), child_env()]
        if other_torch:
            envs[1]["PYTHONPATH"] = f"{_fake_torch(tmp_path, other_torch)}:{envs[1]['PYTHONPATH']}"
        head, other = _run_on_nodes(link, lines, envs)
    a, b = (n.addr for n in link.nodes)
    table = head.stdout
    assert f"all-reduce between nodes  {a} <-> {b}" in table, head.stderr[-3000:]
    assert f"interface                 {a}" in table and f"lan0 ({b})" in table
    assert "shared run dir" in table and f"wrote {out}" in table
    assert other.stdout == ""  # the table is the head's alone
    assert "Traceback" not in head.stderr + other.stderr and "Error" not in head.stderr + other.stderr

    measured = clusterfile.read(out)
    assert measured["nodes"] == 2 and measured["gpus_per_node"] == 1 and measured["device"] == "cpu"
    assert measured["inter_link_gbit"] == pytest.approx(rate_mbit / 1000, rel=0.2), table
    assert 0 < measured["inter_latency_ms"] < 50
    recipe = recipe_from_dict(build_recipe.tiny_run(tiny_model_dir, lora=None, data=None, train=None, output=None),
                              overrides=clusterfile.overrides(out))
    plan = plan_for_recipe(recipe)
    assert plan.cluster.inter_link_gbit == measured["inter_link_gbit"] and plan.cluster.nodes == 2

    torch_line = next(ln for ln in table.splitlines() if ln.startswith("torch "))
    if other_torch is None:
        assert (head.returncode, other.returncode) == (0, 0), head.stderr[-3000:] + other.stderr[-3000:]
        assert torch_line.split()[1] == "all" and torch_line.endswith("ok")
        assert "0 FAIL" in table
    else:
        assert (head.returncode, other.returncode) == (2, 2)
        assert torch_line.endswith("FAIL") and f"{b}: {other_torch}" in torch_line and f"{a}: 2." in torch_line
        assert "fix: install the same torch on every node" in table


def test_a_node_that_never_joins_is_named_within_the_join_timeout(capsys, tmp_path):
    """Two clusters at once (both sides mostly wait): on one only the head starts, on the other only
    the second node, so one reports the node that never came and the other the head it cannot reach."""
    timeout_s = 6
    with netns.shaped_link(None) as lonely_head, netns.shaped_link(None) as headless:
        (tmp_path / "a").mkdir()
        (tmp_path / "b").mkdir()
        head_line = _node_lines(capsys, lonely_head, tmp_path / "a", "--join-timeout", str(timeout_s))[0]
        second_line = _node_lines(capsys, headless, tmp_path / "b", "--join-timeout", str(timeout_s))[1]
        start = time.monotonic()
        head, second = _run_on_nodes(None, [head_line, second_line], [child_env(), child_env()],
                                     nodes=[lonely_head.nodes[0], headless.nodes[1]])
        elapsed = time.monotonic() - start
    for proc in (head, second):
        errors = [ln for ln in proc.stderr.splitlines() if ln.strip()]
        assert proc.returncode == 2 and len(errors) == 1, proc.stderr[-3000:]
    missing, head_addr = lonely_head.nodes[1].addr, headless.nodes[0].addr
    assert f"within {timeout_s} s (waiting for {missing})" in head.stderr and "TCP port 29500 is open" in head.stderr
    assert f"could not reach the rendezvous at {head_addr}:29500 (the head node" in second.stderr
    # the timeout plus interpreter start-up on a busy 2-core machine (load 8 here at times), far from
    # the default 300 s: the given timeout was the one honoured
    assert elapsed < timeout_s + 60, elapsed


@pytest.mark.skipif(shutil.which("ssh") is None, reason="no ssh client")
def test_run_names_every_host_ssh_cannot_reach_before_launching(tmp_path):
    """Real ssh from the head namespace: nothing listens on port 22 of the other node, and the third
    address is on the link's subnet but held by nobody."""
    with netns.shaped_link(None) as link:
        a, b = link.nodes
        nobody = a.addr.rsplit(".", 1)[0] + ".3"
        hosts = tmp_path / "hosts"
        hosts.write_text(f"{a.addr}\n{b.addr}\n{nobody}\n")
        start = time.monotonic()
        proc = subprocess.run(a.wrap([sys.executable, "-m", "homelab_ft", "doctor", "--hosts", str(hosts), "--run"]),
                              env=child_env(), cwd=REPO, capture_output=True, text=True, timeout=120)
        elapsed = time.monotonic() - start
    assert proc.returncode == 2 and proc.stdout == ""
    assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert f"{hosts}: ssh cannot reach {a.addr} (" in proc.stderr
    assert f"; {b.addr} (" in proc.stderr and f"; {nobody} (" in proc.stderr and "Connection refused" in proc.stderr
    assert elapsed < 60  # one ssh connect timeout (5 s) for all hosts at once, plus start-up
