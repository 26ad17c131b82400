"""A 2-node run whose rendezvous and collectives cross a real (shaped) link between two network
namespaces, against one process on the whole batch.

Each node is a namespace with its own interface `lan0` (tests/netns.py); the node commands are the
ones `homelab-ft launch --iface lan0` prints (cli/cluster.py: planned and checked once, here, then
torchrun with c10d rendezvous on the head node's address and the handoff on each command line), one
process per node, gloo. FSDP2 FULL_SHARD of a full fine-tune and adapter-only DDP (LoRA, no_shard)
must train exactly as one process with micro-batch 2B does, as the loopback parity tests
(test_sharded.py) check, and no worker may plan: `plan.hardware.detect` is counted in every
process on the nodes (a sitecustomize wrapper, PROBE) and must never run. Root only; the
namespaces are removed afterwards.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import build_recipe
import netns
import pytest
from procs import REPO, Workers, child_env, job_recipe, run_checked, write_chat_data

from homelab_ft.cli.cluster import launch_commands
from homelab_ft.cli.main import build_parser

pytestmark = pytest.mark.skipif(netns.unavailable() is not None, reason=netns.unavailable() or "")

TOL = 1e-5
STEPS = 4
RATE_MBIT = 1000
RECEIVED = "received the launching machine's rung"
PROBE = '''\
"""Test probe: every call of homelab_ft.plan.hardware.detect appends a line to $DETECT_LOG."""
import importlib.machinery
import os
import sys


class _Probe:
    def find_spec(self, name, path=None, target=None):
        if name != "homelab_ft.plan.hardware":
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        load = spec.loader.exec_module

        def exec_module(module):
            load(module)
            real = module.detect

            def detect(*args, **kwargs):
                with open(os.environ["DETECT_LOG"], "a") as log:
                    log.write(f"detect in pid {os.getpid()} rank {os.environ.get('RANK')}\\n")
                return real(*args, **kwargs)

            module.detect = detect

        spec.loader.exec_module = exec_module
        return spec


sys.meta_path.insert(0, _Probe())
'''


def _recipe(tmp: Path, model_dir: Path, name: str, *, method: str, procs: int, strategy: str) -> dict:
    # LoRA's dropout stays 0 (tiny_run's default): dropout draws per-rank random masks
    return job_recipe(tmp, model_dir, name, procs=procs, method=method, sharding={"strategy": strategy},
                      data={"max_length": 128},
                      train={"max_steps": STEPS, "micro_batch_size": 4 // procs, "grad_accum_steps": 1,
                             "lr": 5e-3 if method == "lora" else 1e-3, "save_every": 0, "num_threads": 1},
                      cluster={"nodes": procs, "gpus_per_node": 1, "device": "cpu"})


def _probed_env(probe_dir: Path, detect_log: Path) -> dict:
    """child_env with PROBE imported first in every Python process started with it."""
    probe_dir.mkdir(exist_ok=True)
    (probe_dir / "sitecustomize.py").write_text(PROBE)
    env = child_env()
    return {**env, "PYTHONPATH": f"{probe_dir}:{env['PYTHONPATH']}", "DETECT_LOG": str(detect_log)}


def _run_two_nodes(link: netns.Link, recipe_path: Path, *, env: dict) -> list[str]:
    """The two node commands `homelab-ft launch --iface lan0` prints, each inside its namespace;
    returns each node's output."""
    hostfile = recipe_path.with_suffix(".hosts")
    hostfile.write_text("".join(f"{node.addr}\n" for node in link.nodes))
    args = build_parser().parse_args(["launch", str(recipe_path), "--hosts", str(hostfile), "--iface", netns.IFACE,
                                      "--join-timeout", "60", "--workdir", str(REPO)])
    commands = launch_commands(args)
    procs = [subprocess.Popen(node.wrap(command.argv), env={**env, **command.env}, cwd=REPO,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for node, command in zip(link.nodes, commands, strict=True)]
    try:
        logs = [p.communicate(timeout=240)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    assert all(p.returncode == 0 for p in procs), "\n".join(log[-4000:] for log in logs)
    return logs


def _losses(run_dir: Path) -> list[float]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r["loss"] for r in rows if "loss" in r]


@pytest.fixture(scope="module")
def results(tmp_path_factory, tiny_model_dir) -> dict:
    tmp = tmp_path_factory.mktemp("netns")
    write_chat_data(tmp / "train.jsonl", 32)
    two = {
        "full_shard": _recipe(tmp, tiny_model_dir, "full_shard", method="full", procs=2, strategy="full_shard"),
        "lora_ddp": _recipe(tmp, tiny_model_dir, "lora_ddp", method="lora", procs=2, strategy="no_shard"),
    }
    out: dict = {"node_logs": {}}
    detect_log = tmp / "detect.log"
    env = _probed_env(tmp / "probe", detect_log)
    with netns.shaped_link(RATE_MBIT) as link:
        for name, recipe in two.items():
            path = build_recipe.write_recipe(tmp / f"{name}.yaml", recipe)
            out["node_logs"][name] = _run_two_nodes(link, path, env=env)
            out[name] = _losses(Path(recipe["output"]["dir"]))
    out["detect_calls"] = detect_log.read_text().splitlines() if detect_log.exists() else []
    # the probe counts: one call in a process started the same way is one line
    subprocess.run([sys.executable, "-c", "from homelab_ft.plan import hardware; hardware.detect()"],
                   env={**env, "DETECT_LOG": str(tmp / "probe.log")}, check=True, cwd=REPO)
    out["probe_calls"] = (tmp / "probe.log").read_text().splitlines()
    one = [{"kind": "train", "name": f"ref_{m}", "recipe": _recipe(tmp, tiny_model_dir, f"ref_{m}", method=m, procs=1,
                                                                   strategy="no_shard")}
           for m in ("full", "lora")]
    spec = tmp / "one.json"
    spec.write_text(json.dumps({"base_dir": str(tmp), "jobs": one}))
    run_checked(Workers(spec, tmp / "one.out.json"))
    out.update({k: v["losses"] for k, v in json.loads((tmp / "one.out.json").read_text()).items() if k.startswith("ref_")})
    return out


@pytest.mark.parametrize(("name", "ref"), [("full_shard", "ref_full"), ("lora_ddp", "ref_lora")])
def test_two_namespace_nodes_train_as_one_process(results, name, ref):
    expected, got = results[ref], results[name]
    assert len(expected) == STEPS and expected[-1] < expected[0]  # it trains
    assert len(got) == STEPS
    assert max(abs(a - b) for a, b in zip(got, expected, strict=True)) <= TOL, (got, expected)


@pytest.mark.parametrize("name", ["full_shard", "lora_ddp"])
def test_workers_on_every_node_take_the_heads_rung_and_never_plan(results, name):
    """Every rank on both nodes trains the handed-off rung: rank 0 says so once, and no process on
    either node probed the hardware (the probe does count: one line for one call)."""
    assert len(results["probe_calls"]) == 1
    assert results["detect_calls"] == []
    head, other = results["node_logs"][name]
    assert head.count(RECEIVED) == 1 and RECEIVED not in other, head[-3000:]
