"""The planner's network model against real runs over shaped links between two namespace nodes.

    sudo OMP_NUM_THREADS=1 .venv/bin/python bench/network.py            # ~10 minutes on 2 cores
    sudo OMP_NUM_THREADS=1 .venv/bin/python bench/network.py --rates 100 --no-hybrid

Two network namespaces joined by a tbf-shaped veth pair (tests/netns.py) are two machines; the
trainer runs on them exactly as `homelab-ft launch --iface lan0` starts it (launch.node_commands,
torchrun c10d rendezvous across the link, gloo). For each rate (about 20, 100 and 1000 Mbit) and
strategy this prints the measured seconds per step beside `memory.estimate`'s prediction for the
same cluster, described by the cluster file `homelab-ft doctor` writes after measuring the link (`cluster_file_for`):
- 2 nodes x 1 process: FSDP2 FULL_SHARD (full fine-tune) and adapter-only DDP (LoRA no_shard);
- 2 nodes x 2 processes (4 processes on this machine's 2 cores, each at half a core):
  FULL_SHARD, HYBRID_SHARD and LoRA DDP.
A small Llama (1.7M parameters, 7 MB fp32) keeps the 20 Mbit cells under a minute while its
weight traffic dominates them. Goals: every prediction within 25% of measured on the 20 and 100
Mbit links, and the planner's ranking of strategies equal to the measured one at every rate.

Compute speed is calibrated once per rate and method, not per cell: one process trains the same
model alone for a few steps (full fine-tune, then LoRA), and its seconds per step against the
planner's FLOP count give this CPU's TFLOPS per core for that method (on a model this small
LoRA's step is not FLOP-bound; the planner's stock hardware.CPU_TFLOPS_PER_CORE is printed
beside it). The machine is shared, so this is redone before each rate's cells. Everything about the network comes from
the cluster file. CPU seconds per step (utime + stime of every process of the cluster, read from
/proc while the steps run) are printed beside wall seconds, and each cell's total CPU seconds
from resource.getrusage of its children. Needs root (network namespaces).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

import netns  # noqa: E402  (tests/netns.py)
from procs import child_env, write_chat_data  # noqa: E402

from homelab_ft.cluster import clusterfile, launch  # noqa: E402
from homelab_ft.plan import hardware  # noqa: E402
from homelab_ft.plan.price.memory import GiB, estimate  # noqa: E402

WARMUP, STEPS = 1, 3
SEQ = 256
CELLS = (  # (label, method, strategy, processes per node, pipeline stages)
    ("full_shard", "full", "full_shard", 1, 1),
    ("lora ddp", "lora", "no_shard", 1, 1),
    ("full pp2", "full", "no_shard", 1, 2),
    ("lora pp2", "lora", "no_shard", 1, 2),
    ("full_shard", "full", "full_shard", 2, 1),
    ("hybrid_shard", "full", "hybrid_shard", 2, 1),
    ("lora ddp", "lora", "no_shard", 2, 1),
)
"""A pipeline cell is one pipeline of 2 stages, a stage per node, over PP_MICRO micro-batches of
one row: the 2 rows per step that the 2 x 1 sharded and DDP cells train (one row per rank), so the
cells of a link rank by the same work."""
PP_MICRO = 2


def make_model(out_dir: Path) -> Path:
    from tiny import make_llama

    return make_llama(out_dir, hidden_size=192, intermediate_size=512, num_hidden_layers=4, num_attention_heads=4,
                      num_key_value_heads=2)


def recipe_for(tmp: Path, model_dir: Path, name: str, *, method: str, strategy: str, nodes: int, per_node: int,
               stages: int = 1) -> dict:
    """Packed rows of SEQ tokens, one per rank and step (a pipeline: PP_MICRO per step): what the
    planner prices (it assumes full rows)."""
    sharding = {"strategy": strategy, **({"pipeline_stages": stages} if stages > 1 else {})}
    return {
        "name": name, "method": method, "model": {"path": str(model_dir)},
        "lora": {"r": 8, "alpha": 16, "dropout": 0.0},
        "data": {"sources": [{"path": str(tmp / "train.jsonl")}], "max_length": SEQ, "packing": True},
        "train": {"max_steps": WARMUP + STEPS, "micro_batch_size": 1, "grad_accum_steps": PP_MICRO if stages > 1 else 1,
                  "lr": 1e-4,
                  "save_every": 0, "device": "cpu", "num_threads": 1, "loss_chunk_tokens": 0},
        "output": {"dir": str(tmp / "runs" / name), "tensorboard": False},
        "cluster": {"nodes": nodes, "gpus_per_node": per_node, "device": "cpu"},
        "sharding": sharding if nodes * per_node > 1 else {},
    }


# --------------------------------------------------------------------------------------------
# the cluster file


def cluster_file_for(link: netns.Link, path: Path, *, per_node: int) -> Path:
    """The cluster as `homelab-ft doctor` measures it, as a user would run it: `doctor --hosts`
    prints one command per node (the same launcher path as training), each runs inside its
    namespace, and the head writes the cluster file (all-reduce bus bandwidth and tiny all-reduce
    latency between the nodes and, with 2 processes per node, inside one)."""
    hosts = path.with_suffix(".hosts")
    hosts.write_text("".join(f"{n.addr}\n" for n in link.nodes))
    printed = subprocess.run(
        [sys.executable, "-m", "homelab_ft", "doctor", "--hosts", str(hosts), "--iface", netns.IFACE,
         "--workdir", str(ROOT), "--nproc-per-node", str(per_node), "--out", str(path),
         "--run-dir", str(path.parent / "doctor-run"), "--join-timeout", "120"],
        env=child_env(), cwd=ROOT, capture_output=True, text=True, check=True)
    lines = [ln for ln in printed.stdout.splitlines() if ln and not ln.startswith("#")]
    procs = [subprocess.Popen(node.wrap(["bash", "-c", line]), env=child_env(), cwd=ROOT, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for node, line in zip(link.nodes, lines, strict=True)]
    outs = [p.communicate(timeout=300) for p in procs]
    if not path.is_file():
        raise RuntimeError("doctor wrote no cluster file:\n" + "\n".join(out + err[-2000:] for out, err in outs))
    return path


def predict(recipe: dict, cluster_path: Path, *, tflops_per_core: float):
    """memory.estimate for the recipe on the file's cluster (a pipelined recipe: the ladder's
    price of its pipeline, stages sized as `plan` sizes them); each node has one of this machine's
    two cores (the namespaces share them), shared by its processes."""
    from homelab_ft.locate import locate_config
    from homelab_ft.plan.ladder import option_rung, sized_price
    from homelab_ft.plan.planner import request_from_recipe
    from homelab_ft.plan.shape.shapes import model_shape
    from homelab_ft.recipe.config import recipe_from_dict

    r = recipe_from_dict(recipe, overrides=clusterfile.overrides(cluster_path))
    detected = hardware.Detected(gpu_count=0, gpu_name=None, vram_bytes=None, host_ram_bytes=8 * GiB, cpu_cores=1)
    cluster = hardware.resolve_cluster(r.cluster, detected=detected, cluster_file=cluster_path.name)
    cluster = dataclasses.replace(cluster, tflops=tflops_per_core * hardware.cpu_cores_per_process(1, r.cluster.gpus_per_node))
    request = request_from_recipe(r)
    shape = model_shape(locate_config(r.model.path)[0])
    stages = r.sharding.pipeline_stages if isinstance(r.sharding.pipeline_stages, int) else 1
    rung = option_rung(r.method, r.sharding.strategy if cluster.world_size > 1 else "no_shard", False,
                       request=request, cluster=cluster, stages=stages)
    if rung.pipeline_enabled:
        return sized_price(shape, rung=rung, request=request, cluster=cluster)[0]
    return estimate(shape, rung=rung, request=request, cluster=cluster)


# --------------------------------------------------------------------------------------------
# measured runs


def _cpu_seconds(namespaces: list[str]) -> float:
    """utime + stime of every process now inside the namespaces."""
    total = 0.0
    for ns in namespaces:
        pids = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True).stdout.split()
        for pid in pids:
            try:
                fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
                total += (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
            except (OSError, IndexError, ValueError):
                pass
    return total


def _rows(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip().endswith("}")]


def run_cell(link: netns.Link | None, recipe: dict, path: Path) -> dict:
    """Train the recipe on the two namespace nodes (or one plain process when `link` is None);
    seconds per step after WARMUP from metrics.jsonl's clock, CPU seconds per step from /proc."""
    path.write_text(json.dumps(recipe))
    run_dir = Path(recipe["output"]["dir"])
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    if link is None:
        argvs = [([sys.executable, "-m", "homelab_ft", "train", str(path), "-q"], {})]
        namespaces: list[str] = []
    else:
        per_node = recipe["cluster"]["gpus_per_node"]
        hosts = [launch.Host(address=n.addr, rdzv_address=n.addr) for n in link.nodes]
        commands = launch.node_commands(hosts, str(path), ["-q"], nodes=2, nproc_per_node=per_node,
                                        iface=netns.IFACE, join_timeout_s=120, python=sys.executable, num_threads=1)
        argvs = [(node.wrap(c.argv), c.env) for node, c in zip(link.nodes, commands, strict=True)]
        namespaces = [n.ns for n in link.nodes]
    procs = [subprocess.Popen(argv, env={**child_env(), **env}, cwd=ROOT, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True) for argv, env in argvs]
    own = [p.pid for p in procs]
    cpu_marks: dict[int, float] = {}
    try:
        while any(p.poll() is None for p in procs):
            steps = len(_rows(run_dir))
            for mark in (WARMUP, WARMUP + STEPS):
                if steps >= mark and mark not in cpu_marks:
                    cpu_marks[mark] = _cpu_seconds(namespaces) if namespaces else _own_cpu(own)
            time.sleep(0.05)
        logs = [p.communicate()[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    if any(p.returncode for p in procs):
        raise RuntimeError(f"{recipe['name']} failed:\n" + "\n".join(log[-3000:] for log in logs))
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    times = [r["time_s"] for r in _rows(run_dir)]
    step_s = (times[WARMUP + STEPS - 1] - times[WARMUP - 1]) / STEPS
    cpu_step = (cpu_marks[WARMUP + STEPS] - cpu_marks[WARMUP]) / STEPS if len(cpu_marks) == 2 else float("nan")
    return {"step_s": step_s, "cpu_s_per_step": cpu_step, "cell_wall_s": wall,
            "cell_cpu_s": after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime}


def _own_cpu(pids: list[int]) -> float:
    """utime + stime of these processes and their children so far (a one-process calibration run)."""
    total = 0.0
    for pid in pids:
        out = subprocess.run(["ps", "--ppid", str(pid), "-o", "pid="], capture_output=True, text=True).stdout.split()
        for p in [str(pid), *out]:
            try:
                fields = Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()
                total += (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
            except (OSError, IndexError, ValueError):
                pass
    return total


def calibrate(tmp: Path, model_dir: Path, *, tag: str, method: str) -> tuple[float, dict]:
    """TFLOPS per core: the planner's FLOPs of one step of `method` over one process's measured time.

    Per method, because on a model this small LoRA's step is not FLOP-bound (PEFT's extra modules
    and small matmuls cost more than their FLOPs: 0.1 s per step more than full fine-tuning's rate
    predicts), and this bench tests the network model, not the FLOP model of tiny models."""
    recipe = recipe_for(tmp, model_dir, f"calibrate-{tag}-{method}", method=method, strategy="no_shard", nodes=1,
                        per_node=1)
    measured = run_cell(None, recipe, tmp / f"calibrate-{tag}-{method}.yaml")
    path = tmp / "calibrate-cluster.yaml"
    clusterfile.write(path, cluster={"nodes": 1, "gpus_per_node": 1, "device": "cpu", "host_ram_gib": 8.0}, measured={})
    unit = predict(recipe, path, tflops_per_core=1.0).compute_s  # seconds at 1 TFLOPS
    return unit / measured["step_s"], measured


# --------------------------------------------------------------------------------------------


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rates", type=float, nargs="+", default=[20, 100, 1000], help="shaped link rates in Mbit/s")
    parser.add_argument("--no-hybrid", action="store_true", help="skip the 2 x 2 process cells")
    parser.add_argument("--no-pipeline", action="store_true", help="skip the 2-stage pipeline cells")
    args = parser.parse_args()
    reason = netns.unavailable()
    if reason:
        print(f"bench/network.py: {reason}", file=sys.stderr)
        return 2
    cells = [c for c in CELLS if not (args.no_hybrid and c[3] == 2) and not (args.no_pipeline and c[4] > 1)]
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        model_dir = make_model(tmp / "model")
        write_chat_data(tmp / "train.jsonl", 600, max_q_words=30, max_a_words=30)
        results = []
        for rate in args.rates:
            # calibrated again before each rate's cells: this machine's other work comes and goes
            tflops = {}
            for method in ("full", "lora"):
                tflops[method], calib = calibrate(tmp, model_dir, tag=f"{rate:g}", method=method)
                print(f"compute: one process, {method}: {calib['step_s']:.3f} s/step -> {tflops[method] * 1000:.1f} GFLOPS "
                      f"per core (planner's stock CPU_TFLOPS_PER_CORE: {hardware.CPU_TFLOPS_PER_CORE * 1000:.0f})",
                      flush=True)
            with netns.shaped_link(rate) as link:
                files = {}
                for per_node in sorted({c[3] for c in cells}):
                    files[per_node] = cluster_file_for(link, tmp / f"cluster-{rate:g}-{per_node}.yaml", per_node=per_node)
                    c = clusterfile.read(files[per_node])
                    print(f"{rate:g} Mbit, {per_node}/node: measured {c['inter_link_gbit'] * 1000:.1f} Mbit/s bus bandwidth, "
                          f"{c['inter_latency_ms']:.2f} ms tiny all-reduce between nodes"
                          + (f"; inside a node {c['intra_link_gbit'] * 1000:.0f} Mbit/s, {c['intra_latency_ms']:.2f} ms"
                             if per_node > 1 else ""), flush=True)
                for label, method, strategy, per_node, stages in cells:
                    name = f"{method}-{strategy}-{per_node}-pp{stages}-{rate:g}"
                    recipe = recipe_for(tmp, model_dir, name, method=method, strategy=strategy, nodes=2, per_node=per_node,
                                        stages=stages)
                    est = predict(recipe, files[per_node], tflops_per_core=tflops[method])
                    got = run_cell(link, recipe, tmp / f"{name}.yaml")
                    results.append({"rate": rate, "label": label, "per_node": per_node, "pred": est.step_s,
                                    "compute": est.compute_s, "comm": est.comm_s, **got})
                    r = results[-1]
                    print(f"  {label:13s} 2x{per_node}  predicted {r['pred']:6.2f} s  measured {r['step_s']:6.2f} s  "
                          f"({r['step_s'] / r['pred']:.2f})", flush=True)
    print()
    print(f"{'link':>9} {'cluster':>7} {'strategy':13} {'compute':>8} {'comm':>7} {'predicted':>9} {'measured':>9} "
          f"{'meas/pred':>9} {'CPU s/step':>10} {'cell wall':>9} {'cell CPU':>8}")
    for r in results:
        print(f"{r['rate']:>5g}Mbit {'2x' + str(r['per_node']):>7} {r['label']:13} {r['compute']:8.2f} {r['comm']:7.2f} "
              f"{r['pred']:9.2f} {r['step_s']:9.2f} {r['step_s'] / r['pred']:9.2f} {r['cpu_s_per_step']:10.2f} "
              f"{r['cell_wall_s']:8.0f}s {r['cell_cpu_s']:7.0f}s")
    print("(seconds per optimizer step; compute/comm: the planner's parts; CPU s/step: all processes of the cluster)")
    print()
    for rate in args.rates:
        for per_node in sorted({r["per_node"] for r in results}):
            cell = [r for r in results if r["rate"] == rate and r["per_node"] == per_node]
            planned = [r["label"] for r in sorted(cell, key=lambda r: r["pred"])]
            measured = [r["label"] for r in sorted(cell, key=lambda r: r["step_s"])]
            print(f"ranking {rate:g} Mbit 2x{per_node}: planned {' < '.join(planned)}; measured {' < '.join(measured)}"
                  f" -> {'same' if planned == measured else 'DIFFERENT'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
