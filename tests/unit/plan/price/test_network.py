"""The planner's network model (network.communication): collective counts and latency, the overlap
FSDP2 and DDP achieve, HYBRID_SHARD's shared NIC, measured vs nominal links; and `--cluster FILE`
on plan / launch. bench/network.py checks the same model against runs over shaped links."""

from __future__ import annotations

import dataclasses
import functools
import json
from pathlib import Path

import build_recipe
import procs
import pytest

from homelab_ft.cli.main import main
from homelab_ft.cluster import clusterfile
from homelab_ft.plan.inputs import ETHERNET_EFFICIENCY, LATENCY_S, Cluster
from homelab_ft.plan.ladder import option_rung
from homelab_ft.plan.planner import default_request, plan
from homelab_ft.plan.price.memory import GiB, estimate
from homelab_ft.plan.price.network import DDP_FIRST_BUCKET_BYTES, LOOP_ALL_REDUCES
from homelab_ft.plan.shape.shapes import model_shape

ROOT = Path(__file__).resolve().parents[4]
CONFIGS = ROOT / "tests" / "configs"


@functools.cache
def llama_1b():
    """Derived when a test first needs it, not at collection (in each xdist worker)."""
    return model_shape(json.loads((CONFIGS / "llama-3.2-1b.json").read_text()))


LONG = default_request(data={"max_length": 2048}, train={"micro_batch_size": 1, "activation_checkpointing": True})


def cluster(*, device="cuda", nodes=2, per_node=1, gbit=1.0, **links) -> Cluster:
    return Cluster(device=device, nodes=nodes, gpus_per_node=per_node, device_bytes=80 * GiB,
                   host_ram_bytes=256 * GiB, inter_link_gbit=gbit, tflops=40.0, **links)


def est(method, strategy, c: Cluster, request=LONG, shape=None):
    shape = shape or llama_1b()
    return estimate(shape, rung=option_rung(method, strategy, False, request=request, cluster=c), request=request,
                    cluster=c)


def test_latency_counts_every_collective_fsdp2_issues():
    """With an infinitely fast link only latency is left: FULL_SHARD all-gathers the root and every
    block in forward and the blocks again in backward per micro-batch, reduce-scatters each unit per
    sync, and the loop adds its small all-reduces (2 ring steps each)."""
    fast = cluster(gbit=1e9, inter_latency_s=2e-3, inter_link_measured=True)
    hop = 1e-3  # half the measured 2-rank all-reduce
    layers = llama_1b().num_layers
    request = LONG.changed(train={"grad_accum_steps": 2})
    full = est("full", "full_shard", fast, request)
    gathers, scatters = 2 * (1 + 2 * layers), 2 * (layers + 1)  # not deferred: a full fine-tune syncs every micro-batch
    assert full.comm_s == pytest.approx((gathers + scatters + 2 * (LOOP_ALL_REDUCES + 1)) * hop, rel=1e-6)
    grad_op = est("full", "shard_grad_op", fast, request)  # blocks stay gathered; gradients sync once
    assert grad_op.comm_s == pytest.approx((2 * (1 + layers) + layers + 1 + 2 * (LOOP_ALL_REDUCES + 1)) * hop, rel=1e-6)
    # four nodes: every ring collective takes 3 steps instead of 1
    four = est("full", "full_shard", dataclasses.replace(fast, nodes=4), request)
    assert four.comm_s == pytest.approx(3 * full.comm_s, rel=1e-6)


def test_default_latency_per_link_kind_and_measured_bandwidth_as_is():
    nominal, measured = cluster(gbit=1.0), cluster(gbit=1.0, inter_link_measured=True, inter_latency_s=0.5e-3)
    assert nominal.inter_bytes_per_s == pytest.approx(1e9 / 8 * ETHERNET_EFFICIENCY)
    assert measured.inter_bytes_per_s == pytest.approx(1e9 / 8)
    assert nominal.inter_hop_s == LATENCY_S["ethernet"] / 2 and measured.inter_hop_s == 0.25e-3
    assert cluster(device="cpu", nodes=1, per_node=2).intra_hop_s == LATENCY_S["cpu"] / 2
    assert cluster(nodes=1, per_node=2, intra_link_gbit=80.0).intra_bytes_per_s == 10e9


def test_fsdp2_on_cuda_hides_collectives_behind_compute_but_not_on_cpu():
    """CUDA: prefetched all-gathers and reduce-scatters run on their own streams, so a fast link
    costs only the root's first all-gather, the last reduce-scatter and the loop's small
    all-reduces. CPU/gloo: FSDP2 waits for every collective, so the step is compute + comm."""
    gpu = est("full", "full_shard", cluster(gbit=100.0))
    assert 0 < gpu.comm_s < gpu.compute_s
    assert gpu.step_s == pytest.approx(gpu.compute_s + gpu.comm_s - gpu.comm_hidden_s)
    assert gpu.comm_hidden_s > 0.8 * gpu.comm_s
    cpu = est("full", "full_shard", cluster(device="cpu", gbit=100.0))
    assert cpu.comm_hidden_s == 0 and cpu.step_s == pytest.approx(cpu.compute_s + cpu.comm_s)
    # a slow link: the step is the communication, compute hidden under it
    slow = est("full", "full_shard", cluster(gbit=1.0))
    assert slow.comm_s > slow.compute_s and slow.comm_hidden_s == pytest.approx(slow.compute_s)
    assert slow.step_s == pytest.approx(slow.comm_s)


def test_ddp_hides_all_but_the_last_bucket_behind_backward():
    ddp = est("lora", "no_shard", cluster(gbit=1.0))
    grads = ddp.trainable_params * 4
    assert grads > 10 * DDP_FIRST_BUCKET_BYTES  # several buckets
    assert 0 < ddp.comm_hidden_s < ddp.comm_s
    # with accumulation only the last micro-batch's backward is left to hide it
    accum = est("lora", "no_shard", cluster(gbit=1.0), LONG.changed(train={"grad_accum_steps": 8}))
    assert accum.comm_s == pytest.approx(ddp.comm_s)
    assert accum.comm_hidden_s <= accum.compute_s * (4 / 6) / 8 + 1e-9
    # one bucket (a tiny adapter): nothing to overlap, its all-reduce waits at the end of backward
    tiny = est("lora", "no_shard", cluster(gbit=1.0), LONG.changed(lora={"r": 1, "target_modules": ("q_proj",)}))
    assert tiny.trainable_params * 4 <= DDP_FIRST_BUCKET_BYTES and tiny.comm_hidden_s == 0


def test_hybrid_shard_sends_only_gradient_shards_across_a_shared_nic():
    """Two 2-GPU nodes: each rank all-reduces half the gradients with its replica, and both replica
    groups cross the one NIC, so the Ethernet carries the whole gradients once (a 4-rank ring
    all-reduce would carry 1.5 x, FULL_SHARD the weights 3 x)."""
    c = cluster(per_node=2, gbit=1.0, intra_link_gbit=1e6, intra_latency_s=0.0, inter_latency_s=0.0)
    hybrid = est("full", "hybrid_shard", c)
    grads = hybrid.trainable_params * 4
    assert hybrid.comm_s == pytest.approx(grads / c.inter_bytes_per_s, rel=0.02)
    full = est("full", "full_shard", c)
    # FULL_SHARD's ring over 4 ranks: bf16 blocks gathered twice (the root with the tied embedding
    # once: it stays gathered for backward) and fp32 gradients scattered, all x 3/4
    root, blocks = llama_1b().root_params, llama_1b().total_params - llama_1b().root_params
    ring_bytes = (2 * (root + 2 * blocks) + 4 * (root + blocks)) * 3 / 4
    assert full.comm_s == pytest.approx(ring_bytes / c.inter_bytes_per_s, rel=0.02)
    assert full.comm_s > 1.4 * hybrid.comm_s
    assert hybrid.step_s < full.step_s


def test_slow_link_ranking_and_fast_link_ranking():
    """1 Gbit between two 1-GPU nodes: a full fine-tune is link-bound; at 100 Gbit compute-bound."""
    request = LONG.changed(method="full")
    slow = plan(llama_1b(), request=request, cluster=cluster(gbit=1.0))
    assert slow.chosen.comm_s > slow.chosen.compute_s
    fast = plan(llama_1b(), request=request, cluster=cluster(gbit=100.0))
    assert fast.chosen.step_s < 1.2 * fast.chosen.compute_s


# --------------------------------------------------------------------------------------------
# --cluster FILE


def _cluster_file(tmp_path: Path) -> Path:
    path = tmp_path / "cluster.yaml"
    clusterfile.write(path, cluster={"nodes": 2, "gpus_per_node": 1, "device": "cuda", "vram_gib": 24.0,
                                     "host_ram_gib": 64.0, "inter_link_gbit": 0.94, "inter_latency_ms": 0.3},
                      measured={"links": []})
    return path


def _recipe(tmp_path: Path) -> Path:
    recipe = tmp_path / "r.yaml"
    recipe.write_text(f"method: auto\nmodel:\n  path: {CONFIGS / 'llama-3.2-1b.json'}\n"
                      "data:\n  max_length: 2048\ntrain:\n  micro_batch_size: 1\n  activation_checkpointing: true\n"
                      "cluster:\n  nodes: 1\n  inter_link_gbit: 10\n")
    return recipe


def _demo_recipe(tmp_path: Path, model, output: dict | None = None) -> Path:
    """`method: auto` on the demo rows, every key the recipe does not name at its default."""
    return build_recipe.write_recipe(tmp_path / "r.yaml", build_recipe.tiny_run(
        model, method="auto", rows="demo:train", lora=None, data={"max_length": None}, train=None, output=output))


def test_plan_takes_a_cluster_file_over_the_recipe_and_flags_over_the_file(tmp_path):
    path, recipe = _cluster_file(tmp_path), _recipe(tmp_path)
    out, flagged, without = procs.plans_without_torch([[str(recipe), "--cluster", str(path)],
                                                        [str(recipe), "--cluster", str(path), "--link", "10Gbit", "--json"],
                                                        [str(recipe), "--nodes", "2"]])
    assert out.returncode == 0, out.stderr
    line = next(ln for ln in out.stdout.splitlines() if ln.startswith("cluster"))
    assert "2 node(s)" in line and "[cluster file cluster.yaml]" in line
    assert "0.94 Gbit/s (118 MB/s, 0.30 ms all-reduce latency, measured) between nodes" in line
    assert "comm s" in out.stdout

    data = json.loads(flagged.stdout)["cluster"]
    assert data["inter_link_gbit"] == 10 and not data["inter_link_measured"] and data["inter_latency_s"] == 0.3e-3

    line = next(ln for ln in without.stdout.splitlines() if ln.startswith("cluster"))
    assert "10 Gbit/s Ethernet (1125 MB/s, 0.20 ms all-reduce latency, assumed) between nodes" in line


def test_plan_with_a_bad_cluster_file_is_one_line_exit_2(tmp_path, capsys):
    bad = tmp_path / "c.yaml"
    bad.write_text("format: homelab-ft-cluster/1\ncluster: {nodes: 0}\n")
    assert main(["plan", str(_recipe(tmp_path)), "--cluster", str(bad)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and str(bad) in err and "cluster.nodes" in err


def test_launch_pins_the_measured_cluster_on_every_node(tmp_path, tiny_model_dir, capsys):
    """The other nodes need not have the file: its values are on their command lines."""
    path = _cluster_file(tmp_path)
    recipe = _demo_recipe(tmp_path, tiny_model_dir)
    hosts = tmp_path / "hosts"
    hosts.write_text("10.0.0.1\n10.0.0.2\n")
    assert main(["launch", str(recipe), "--hosts", str(hosts), "--cluster", str(path)]) == 0
    lines = [ln for ln in capsys.readouterr().out.splitlines() if "homelab_ft.cluster.supervise" in ln]
    assert len(lines) == 2
    for line in lines:
        for pinned in ("cluster.nodes=2", "cluster.inter_link_gbit=0.94", "cluster.inter_latency_ms=0.3",
                       "cluster.inter_link_measured=true"):
            assert pinned in line, line
    assert all("--cluster" not in line for line in lines)


def test_gloo_reduce_scatter_costs_an_all_reduce_and_all_gather_runs_slower():
    """CPU runs use gloo, whose reduce_scatter_tensor takes as long as an all-reduce of its input
    and whose all_gather_into_tensor reaches GLOO_ALL_GATHER_EFFICIENCY of the all-reduce's bus
    bandwidth (measured between namespace nodes, see network.py); NCCL's reach the link's. FSDP2's
    host copies around each gloo collective add GLOO_FSDP_HOST_S_PER_BYTE per unsharded byte
    gathered or reduced."""
    from homelab_ft.plan.price.network import GLOO_ALL_GATHER_EFFICIENCY, GLOO_FSDP_HOST_S_PER_BYTE

    links = dict(gbit=1.0, inter_link_measured=True, inter_latency_s=0.0)
    request = LONG.changed(model={"dtype": "float32"})
    nccl = est("full", "full_shard", cluster(**links), request)
    gloo = est("full", "full_shard", cluster(device="cpu", **links), request)
    weights = llama_1b().total_params * 4
    root, blocks = llama_1b().root_params * 4, weights - llama_1b().root_params * 4
    gathered = (root + 2 * blocks) / 2  # each rank sends half of every gathered unit
    bw = 1e9 / 8
    assert nccl.comm_s == pytest.approx((gathered + weights / 2) / bw, rel=1e-3)
    copies = (root + 2 * blocks + weights) * GLOO_FSDP_HOST_S_PER_BYTE
    assert gloo.comm_s == pytest.approx((gathered / GLOO_ALL_GATHER_EFFICIENCY + weights) / bw + copies, rel=1e-3)
    assert nccl.comm_bytes == gloo.comm_bytes  # the bytes the ring moves are the same


@pytest.mark.parametrize("command", ["train", "launch"])
def test_train_and_launch_refuse_a_bad_cluster_file_before_anything_starts(tmp_path, capsys, command):
    bad = tmp_path / "c.yaml"
    bad.write_text("format: homelab-ft-cluster/1\ncluster: {inter_link_gbit: fast}\n")
    recipe = _demo_recipe(tmp_path, "smollm2", output={"tensorboard": None, "dir": str(tmp_path / "run")})
    hosts = tmp_path / "hosts"
    hosts.write_text("10.0.0.1\n10.0.0.2\n")
    extra = ["--hosts", str(hosts)] if command == "launch" else []
    assert main([command, str(recipe), *extra, "--cluster", str(bad)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "cluster.inter_link_gbit" in err
    assert not (tmp_path / "run").exists()
