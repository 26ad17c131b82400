"""`homelab-ft doctor`'s pure parts (verdicts, table, bandwidth arithmetic, cluster values) and the
checks it makes before launching anything (interface, port, ssh), without a process group."""

from __future__ import annotations

import socket
import sys
from pathlib import Path

import pytest

from homelab_ft.cli import main as cli
from homelab_ft.cluster import clusterfile, launch
from homelab_ft.cluster.doctor import check as doctor
from homelab_ft.cluster.doctor import facts, report
from homelab_ft.cluster.doctor import rank as doctor_rank
from homelab_ft.cluster.doctor.facts import LinkResult, Needs, NodeFacts, Timing
from homelab_ft.cluster.doctor.report import FAIL, OK, WARN
from homelab_ft.cluster.supervise import rendezvous_failure
from homelab_ft.recipe.config import recipe_from_dict

VERSIONS = {"python": "3.11.7", "torch": "2.13.0", "cuda": "12.8", "nccl": "2.27.3", "transformers": "5.24.0",
            "peft": "0.21.2", "bitsandbytes": "0.50.2", "homelab-ft": "0.1.0"}
GPU = {"name": "NVIDIA GeForce RTX 3090", "memory_bytes": 24 * 2**30, "capability": "8.6", "bf16": True}


def node(name: str, **changes) -> NodeFacts:
    base = dict(name=name, hostname=name, versions=dict(VERSIONS), nproc=2, device="cuda", gpus=[GPU, GPU],
                address=name, iface="enp3s0", iface_given="enp3s0", nic_speed_mbit=1000, probe_dir="/srv/runs",
                sees_token=True, free_disk_bytes=500 * 2**30, host_ram_bytes=64 * 2**30,
                available_ram_bytes=60 * 2**30)
    base.update(changes)
    return NodeFacts(**base)


def link(gbit: float, *, scope="inter-node", ranks=2, latency_s=0.0003) -> LinkResult:
    """Timings that give `gbit` of all-reduce and all-gather bus bandwidth at 16 MiB."""
    big = 16 * 2**20
    timings = [Timing("all_reduce", 4, latency_s, ranks)]
    for op in ("all_reduce", "all_gather"):
        sent = facts.sent_bytes_per_rank(op, big, ranks)
        timings.append(Timing(op, 2**20, sent / 16 * 8 / 1e9 / (gbit * 1.3), ranks))  # faster at 1 MiB: a burst
        timings.append(Timing(op, big, sent * 8 / 1e9 / gbit, ranks))
    return LinkResult(scope=scope, where="a <-> b" if scope == "inter-node" else "a", ranks=ranks, backend="nccl",
                      timings=tuple(timings))


def by_check(lines, check, node_name=None):
    found = [ln for ln in lines if ln.check == check and (node_name is None or ln.node == node_name)]
    assert found, f"no {check} line in {lines}"
    return found[0]


# ----------------------------------------------------------------------------------- arithmetic


def test_bus_bandwidth_is_the_bytes_each_rank_sends():
    # ring all-reduce: 2 (n-1)/n x S per rank; 2 ranks send S: 125 MB in 1 s is 1 Gbit/s
    assert facts.bus_gbit("all_reduce", 125_000_000, 1.0, 2) == pytest.approx(1.0)
    assert facts.sent_bytes_per_rank("all_reduce", 800, 4) == 1200
    # all-gather of S per rank: (n-1) x S per rank
    assert facts.sent_bytes_per_rank("all_gather", 800, 4) == 2400
    assert facts.bus_gbit("all_gather", 62_500_000, 0.5, 2) == pytest.approx(1.0)
    with pytest.raises(ValueError):
        facts.sent_bytes_per_rank("broadcast", 1, 2)


def test_the_link_is_its_largest_size_between_nodes_and_its_best_inside_one():
    inter = link(0.94)
    assert inter.best("all_reduce").nbytes == 16 * 2**20 and inter.gbit == pytest.approx(0.94)
    assert inter.latency_ms == pytest.approx(0.3)
    intra = link(20.0, scope="intra-node")
    assert intra.best("all_reduce").nbytes == 2**20 and intra.gbit == pytest.approx(26.0)


def test_rates_and_sizes_read_naturally():
    assert report.rate(0.0467) == "46.7 Mbit/s" and report.rate(9.41) == "9.41 Gbit/s" and report.rate(None) == "?"
    assert report.size(4) == "4 B" and report.size(64 * 2**10) == "64 KiB" and report.size(3 * 2**30) == "3 GiB"


# ----------------------------------------------------------------------------------- verdicts


def test_matching_versions_are_one_ok_line_each():
    lines = report.version_lines([node("a"), node("b")])
    assert [ln.check for ln in lines] == list(report.VERSION_KEYS)
    assert all(ln.verdict == OK and ln.node == "all" for ln in lines)


def test_another_torch_on_one_node_fails_naming_both():
    lines = report.version_lines([node("a"), node("b", versions={**VERSIONS, "torch": "2.99.0"})])
    torch_line = by_check(lines, "torch")
    assert torch_line.verdict == FAIL and torch_line.node == "differs"
    assert "a: 2.13.0" in torch_line.result and "b: 2.99.0" in torch_line.result
    assert "same torch on every node" in torch_line.fix and "2.13.0" in torch_line.fix


@pytest.mark.parametrize("key, theirs, verdict", [
    ("python", "3.11.9", WARN),        # a patch release apart
    ("python", "3.12.1", FAIL),
    ("cuda", "12.4", WARN),
    ("bitsandbytes", None, WARN),
    ("nccl", "2.21.5", FAIL),
    ("peft", "0.17.0", FAIL),
])
def test_which_mismatches_fail(key, theirs, verdict):
    lines = report.version_lines([node("a"), node("b", versions={**VERSIONS, key: theirs})])
    assert by_check(lines, key).verdict == verdict


def test_missing_required_library_fails():
    lines = report.version_lines([node("a", versions={**VERSIONS, "peft": None})])
    assert by_check(lines, "peft").verdict == FAIL


def test_gpus_bf16_peer_access_and_mixed_models():
    old = {"name": "Tesla V100", "memory_bytes": 16 * 2**30, "capability": "7.0", "bf16": False}
    lines = report.gpu_lines([node("a", no_peer_access=[[0, 1]]), node("b", gpus=[old, old]),
                              node("c", device="cpu", gpus=[])])
    assert by_check(lines, "GPUs", "a").result == "2x NVIDIA GeForce RTX 3090 24.0 GiB, cc 8.6, bf16 yes"
    assert by_check(lines, "peer-to-peer", "a").verdict == WARN and "0<->1" in by_check(lines, "peer-to-peer", "a").result
    assert by_check(lines, "peer-to-peer", "b").verdict == OK
    assert by_check(lines, "GPUs", "b").verdict == WARN and "bf16" in by_check(lines, "GPUs", "b").fix
    assert by_check(lines, "GPUs", "c").result.startswith("none")
    assert by_check(lines, "GPU models").verdict == WARN


def test_rendezvous_over_another_interface_warns():
    lines = report.interface_lines([node("a"), node("b", iface="wg0", address="10.8.0.2")])
    assert by_check(lines, "interface", "a").verdict == OK
    warned = by_check(lines, "interface", "b")
    assert warned.verdict == WARN and "over wg0, not --iface enp3s0" in warned.fix


def test_slow_link_warns_against_the_nic_and_the_recipes_assumption():
    nodes = [node("a"), node("b")]
    fine = report.all_lines(nodes, [link(0.94)])
    assert by_check(fine, "all-reduce between nodes").verdict == OK
    assert "94% of the NIC's 1.00 Gbit/s" in by_check(fine, "all-reduce between nodes").result
    slow = report.all_lines(nodes, [link(0.094)])
    assert by_check(slow, "all-reduce between nodes").verdict == WARN
    assert "ethtool" in by_check(slow, "all-reduce between nodes").fix
    no_nic = [node("a", nic_speed_mbit=None), node("b", nic_speed_mbit=None)]
    assumed = report.all_lines(no_nic, [link(0.3)], assumed_gbit=10.0)
    assert by_check(assumed, "all-reduce between nodes").verdict == WARN
    assert "--cluster" in by_check(assumed, "all-reduce between nodes").fix
    laggy = report.all_lines(nodes, [link(0.94, latency_s=0.02)])
    assert by_check(laggy, "latency between nodes").verdict == WARN


def test_storage_not_shared_disk_and_ram_against_the_plan():
    needs = Needs(recipe="r.yaml", option="qlora", host_ram_bytes=40 * 2**30, disk_bytes=100 * 2**30)
    nodes = [node("a"), node("b", sees_token=False, free_disk_bytes=50 * 2**30, host_ram_bytes=32 * 2**30),
             node("c", available_ram_bytes=20 * 2**30)]
    lines = report.storage_lines(nodes, needs)
    shared = by_check(lines, "shared run dir")
    assert shared.verdict == FAIL and shared.node == "b" and "NFS" in shared.fix
    assert by_check(lines, "disk", "a").verdict == OK and by_check(lines, "disk", "b").verdict == FAIL
    assert by_check(lines, "host RAM", "b").verdict == FAIL and by_check(lines, "host RAM", "c").verdict == WARN
    assert "the plan needs 40 GiB" in by_check(lines, "host RAM", "a").result
    assert report.storage_lines([node("a", writable=False)], None)[0].verdict == FAIL
    assert by_check(report.storage_lines([node("a"), node("b")], None), "shared run dir").verdict == OK


def test_plan_lines():
    assert report.plan_lines(None) == []
    assert report.plan_lines(Needs("r.yaml", "lora x2 no_shard"))[0].verdict == OK
    assert report.plan_lines(Needs("r.yaml", None))[0].verdict == FAIL
    assert "cluster.nodes=2" in report.plan_lines(Needs("r.yaml", None, problem="set cluster.nodes=2"))[0].result


def test_table_has_a_fix_under_each_failure_and_a_count():
    lines = [report.Line("torch", "differs", "a: 2.13.0, b: 2.99.0", FAIL, "install the same torch"),
             report.Line("disk", "a", "10 GiB free")]
    text = report.format_table(lines, title="homelab-ft doctor: test")
    rows = text.splitlines()
    assert rows[0] == "homelab-ft doctor: test" and rows[2].split() == ["CHECK", "NODE", "RESULT", "VERDICT"]
    assert rows[3].endswith("FAIL") and rows[4].strip() == "fix: install the same torch"
    assert rows[-1] == "1 FAIL, 0 warn, 1 ok"
    assert report.exit_code(lines) == 2 and report.exit_code(lines[1:]) == 0


def test_cluster_values_load_as_a_recipe_cluster(tmp_path):
    small = {**GPU, "memory_bytes": int(11.5 * 2**30), "name": "NVIDIA GeForce RTX 2080 Ti"}
    nodes = [node("a", nvlink=True), node("b", gpus=[small, small], host_ram_bytes=32 * 2**30)]
    values = report.cluster_values(nodes, [link(0.94), link(40.0, scope="intra-node"), link(20.0, scope="intra-node")])
    assert values == {"nodes": 2, "gpus_per_node": 2, "device": "cuda", "vram_gib": 11.5,
                      "gpu_name": "NVIDIA GeForce RTX 2080 Ti", "intra_link": "pcie", "host_ram_gib": 32.0,
                      "inter_link_gbit": 0.94, "inter_latency_ms": 0.3, "intra_link_gbit": 26.0,
                      "intra_latency_ms": 0.3, "node_vram_gib": [24.0, 11.5]}  # uneven: one per node
    path = tmp_path / "cluster.yaml"
    clusterfile.write(path, cluster=values, measured={})
    cluster = recipe_from_dict({}, overrides=clusterfile.overrides(path)).cluster
    assert (cluster.nodes, cluster.vram_gib, cluster.inter_link_gbit) == (2, 11.5, 0.94)
    assert cluster.node_vram_gib == (24.0, 11.5)
    even = report.cluster_values([node("a"), node("b")], [link(0.94)])
    assert "node_vram_gib" not in even
    cpu = report.cluster_values([node("a", device="cpu", gpus=[], nproc=1)], [])
    assert cpu == {"nodes": 1, "gpus_per_node": 1, "device": "cpu", "host_ram_gib": 64.0}


# ----------------------------------------------------------------------------------- rendezvous


def test_a_node_that_never_joined_is_named():
    head = rendezvous_failure(timed_out=True, endpoint="10.0.0.1:29500", nnodes="2", join_timeout_s="300",
                              local_addr="10.0.0.1", nodes=["10.0.0.1", "10.0.0.2"])
    assert "within 300 s (waiting for 10.0.0.2)" in head and "TCP port 29500 is open on 10.0.0.1" in head
    three = rendezvous_failure(timed_out=True, endpoint="h:1", nnodes="3", join_timeout_s="9", local_addr="h",
                               nodes=["h", "b", "c"])
    assert "one of b, c is missing" in three
    worker = rendezvous_failure(timed_out=False, endpoint="10.0.0.1:29500", nnodes="2", join_timeout_s="300",
                                local_addr="10.0.0.2", nodes=["10.0.0.1", "10.0.0.2"])
    assert worker.startswith("could not reach the rendezvous at 10.0.0.1:29500 (the head node")


# ----------------------------------------------------------------------------------- before launch


def _doctor(capsys, *argv) -> tuple[int, str, str]:
    code = cli.main(["doctor", *argv])
    out, err = capsys.readouterr()
    return code, out, err


def test_an_interface_that_does_not_exist_stops_before_launch(capsys, monkeypatch):
    monkeypatch.setattr(launch, "run_supervised", lambda *a, **k: pytest.fail("launched"))
    code, _, err = _doctor(capsys, "--iface", "nosuch0")
    assert code == 2 and len(err.strip().splitlines()) == 1
    assert "--iface nosuch0: no such network interface on this machine" in err and "lo" in err


def test_run_needs_a_hostfile(capsys):
    code, _, err = _doctor(capsys, "--run")
    assert code == 2 and "--run starts the nodes of a hostfile over ssh; add --hosts HOSTFILE" in err


def test_a_rendezvous_port_in_use_on_the_head_stops_before_launch(capsys, tmp_path):
    hosts = tmp_path / "hosts"
    hosts.write_text("127.0.0.1\n10.0.0.2\n")
    code, _, err = _doctor(capsys, "--hosts", str(hosts), "--iface", "nosuch0")
    assert code == 2 and "--iface nosuch0: no such network interface" in err  # this machine is the head
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        code, out, err = _doctor(capsys, "--hosts", str(hosts), "--port", str(port))
    assert code == 2 and out == ""
    assert f"--port {port}: TCP port {port} is already in use on the head node 127.0.0.1" in err
    assert "choose a free port with --port" in err and len(err.strip().splitlines()) == 1


def test_without_run_it_prints_each_nodes_command(capsys, tmp_path):
    hosts = tmp_path / "hosts"
    hosts.write_text("10.0.0.1\nme@10.0.0.2\n")
    code, out, _ = _doctor(capsys, "--hosts", str(hosts), "--iface", "lo", "--out", "c.yaml", "--join-timeout", "30")
    assert code == 0
    lines = out.splitlines()
    assert lines[0] == "# on 10.0.0.1:" and lines[2] == "# on me@10.0.0.2:"
    assert "-m homelab_ft.cluster.supervise --nnodes=2 --nproc-per-node=1" in lines[3]
    assert lines[3].endswith("-m homelab_ft doctor --join-timeout=30 --iface=lo --out=c.yaml")
    assert "--local-addr=10.0.0.2" in lines[3] and "is_host=false" in lines[3] and "is_host=true" in lines[1]


def test_an_unreachable_host_stops_run_before_launch(capsys, tmp_path, monkeypatch):
    """ssh is asked with BatchMode and a connect timeout; every unreachable node is named."""
    calls = []

    def fake_ssh(argv, **kwargs):
        calls.append(argv)
        host = argv[argv.index("--") + 1]
        err = "" if host == "box1" else f"ssh: connect to host {host} port 22: No route to host\n"
        return type("P", (), {"returncode": 0 if host == "box1" else 255, "stderr": err})()

    monkeypatch.setattr(doctor.subprocess, "run", fake_ssh)
    monkeypatch.setattr(launch, "run_over_ssh", lambda *a: pytest.fail("launched"))
    hosts = tmp_path / "hosts"
    hosts.write_text("box1\nbox2\n")
    code, _, err = _doctor(capsys, "--hosts", str(hosts), "--run")
    assert code == 2 and len(err.strip().splitlines()) == 1
    assert f"{hosts}: ssh cannot reach box2 (ssh: connect to host box2 port 22: No route to host)" in err
    assert all(c[:5] == ["ssh", "-o", "BatchMode=yes", "-o", "ConnectTimeout=5"] for c in calls)


def test_standalone_on_this_machine_runs_doctor_under_torchrun(monkeypatch):
    started = doctor.prepare(recipe_path=None, overrides=[], hostfile=None, iface=None, port=29500, nproc_per_node=None,
                             run=False, worker_args=["--out=c.yaml"], join_timeout_s=30)
    gpus = doctor.hardware.detect().gpu_count
    assert started.argv == [sys.executable, "-m", "homelab_ft.cluster.supervise", "--standalone",
                            f"--nproc-per-node={gpus or 2}", "-m", "homelab_ft", "doctor", "--out=c.yaml"]


def test_token_probe_uses_the_nearest_existing_parent(tmp_path):
    path = doctor_rank.write_token(str(tmp_path / "runs" / "new"))
    assert Path(path).parent == tmp_path and Path(path).read_text() == Path(path).name


def test_plan_needs_prices_the_recipe_on_the_measured_cluster():
    recipe = recipe_from_dict({"method": "lora", "model": {"path": "smollm2"}, "train": {"keep_last": 2},
                               "cluster": {"nodes": 2, "gpus_per_node": 1, "device": "cpu"}})
    measured = {"nodes": 2, "gpus_per_node": 1, "device": "cpu", "host_ram_gib": 16.0, "inter_link_gbit": 0.19}
    needs = doctor_rank.plan_needs(recipe, measured, label="r.yaml")
    assert needs.problem == "" and needs.option.startswith("lora") and needs.recipe == "r.yaml"
    assert 0 < needs.host_ram_bytes < 16 * 2**30 and needs.disk_bytes > 0 and needs.disk_bytes % 3 == 0
    other = doctor_rank.plan_needs(recipe, {**measured, "nodes": 3}, label="r.yaml")
    assert other.option is None and "set cluster.nodes=3 cluster.gpus_per_node=1" in other.problem
    tight = doctor_rank.plan_needs(recipe, {**measured, "host_ram_gib": 0.01}, label="r.yaml")
    assert tight.option is None and tight.problem == ""  # priced with the measured RAM: nothing fits in 10 MiB


def test_a_cuda_recipe_on_a_cpu_build_of_torch_fails_with_the_fix():
    """Issue 24 item 5: this used to print 0 FAIL and a plan for the CPU."""
    cpu_build = node("a", device="cpu", gpus=[], nproc=1, versions={**VERSIONS, "cuda": None, "torch": "2.13.0+cpu"})
    recipe = recipe_from_dict({"method": "lora", "model": {"path": "smollm2"}, "train": {"device": "cuda"}})
    outcome = doctor_rank._report([cpu_build], [], recipe=recipe, recipe_path="r.yaml", out=None)
    assert outcome.code == 2
    assert "train.device=cuda, but torch 2.13.0+cpu is a CPU-only build" in outcome.table
    assert "install a CUDA build of torch" in outcome.table and "set train.device=cpu" in outcome.table
    assert "\nplan " not in outcome.table  # not priced for the CPU it would not run on
    no_gpu = report.device_lines([node("a", device="cpu", gpus=[])], wants_cuda="cluster.device=cuda")[0]
    assert no_gpu.verdict == FAIL and "sees no GPU" in no_gpu.result and "CUDA_VISIBLE_DEVICES" in no_gpu.fix
    assert report.device_lines([node("a")], wants_cuda="train.device=cuda") == []
    assert report.device_lines([cpu_build], wants_cuda=None) == []
    cpu_recipe = recipe_from_dict({"method": "lora", "model": {"path": "smollm2"}, "train": {"device": "cpu"}})
    assert doctor_rank.cuda_key(cpu_recipe) is None


def test_the_measured_matmul_goes_to_the_cluster_file_and_the_plan(tmp_path):
    """doctor times a bf16 matmul per GPU; the slowest is `cluster.gpu_tflops`, which the plan then prices with."""
    from homelab_ft.plan.hardware import Detected, resolve_cluster

    fast, slow = {**GPU, "matmul_tflops": 68.0}, {**GPU, "matmul_tflops": 61.5}
    values = report.cluster_values([node("a", gpus=[fast, slow])], [])
    assert values["gpu_tflops"] == 61.5
    assert "matmul 61.5 TFLOPS" in by_check(report.gpu_lines([node("a", gpus=[fast, slow])]), "GPUs").result
    path = tmp_path / "cluster.yaml"
    clusterfile.write(path, cluster=values, measured={})
    cfg = recipe_from_dict({}, overrides=clusterfile.overrides(path)).cluster
    cluster = resolve_cluster(cfg, detected=Detected(gpu_count=0, gpu_name=None, vram_bytes=None,
                                                     host_ram_bytes=64 * 2**30, cpu_cores=4))
    assert cluster.tflops == 61.5 * 0.4 and "61.5 TFLOPS bf16 matmul measured by doctor" in cluster.tflops_source


def test_a_cpu_nodes_measured_core_rate_goes_to_the_cluster_file_and_the_plan(tmp_path):
    """Issue 39 point 5: doctor times one core's fp32 matmul on a CPU node, as it times each GPU's; the
    slowest node's is `cluster.cpu_gflops_per_core`, which a CPU plan prices its steps with."""
    from homelab_ft.plan.hardware import CPU_TRAINING_EFFICIENCY, Detected, resolve_cluster

    nodes = [node(n, device="cpu", gpus=[], nproc=1, cpu_gflops_per_core=g) for n, g in (("a", 150.0), ("b", 96.5))]
    values = report.cluster_values(nodes, [])
    assert values["cpu_gflops_per_core"] == 96.5
    assert "fp32 matmul 96.5 GFLOPS per core" in by_check(report.gpu_lines(nodes), "GPUs", "b").result
    path = tmp_path / "cluster.yaml"
    clusterfile.write(path, cluster=values, measured={})
    cfg = recipe_from_dict({}, overrides=clusterfile.overrides(path)).cluster
    cluster = resolve_cluster(cfg, detected=Detected(gpu_count=0, gpu_name=None, vram_bytes=None,
                                                     host_ram_bytes=64 * 2**30, cpu_cores=4, cpu_gflops_per_core=300.0))
    assert cluster.tflops == pytest.approx(96.5 * CPU_TRAINING_EFFICIENCY * 4 / 1000)
    assert "(cluster.cpu_gflops_per_core)" in cluster.tflops_source
