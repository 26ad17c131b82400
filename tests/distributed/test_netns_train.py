"""A 2-node run whose rendezvous and collectives cross a real (shaped) link between two network
namespaces, against one process on the whole batch.

Each node is a namespace with its own interface `lan0` (tests/netns.py); the node commands are the
ones `homelab-ft launch --iface lan0` prints (launch.node_commands: torchrun, c10d rendezvous on the
head node's address), one process per node, gloo. FSDP2 FULL_SHARD of a full fine-tune and
adapter-only DDP (LoRA, no_shard) must train exactly as one process with micro-batch 2B does, as
the loopback parity tests (test_sharded.py) check. Root only; the namespaces are removed afterwards.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import netns
import pytest
from procs import REPO, child_env, run_checked, write_chat_data

from homelab_ft.cluster import launch

pytestmark = pytest.mark.skipif(netns.unavailable() is not None, reason=netns.unavailable() or "")

WORKER = Path(__file__).with_name("worker.py")
TOL = 1e-5
STEPS = 4
RATE_MBIT = 1000


def _recipe(tmp: Path, model_dir: Path, name: str, *, method: str, procs: int, strategy: str) -> dict:
    return {
        "name": name,
        "method": method,
        "model": {"path": str(model_dir)},
        "lora": {"r": 4, "alpha": 8, "dropout": 0.0},  # dropout draws per-rank random masks
        "data": {"sources": [{"path": str(tmp / "train.jsonl")}], "max_length": 128},
        "train": {"max_steps": STEPS, "micro_batch_size": 4 // procs, "grad_accum_steps": 1,
                  "lr": 5e-3 if method == "lora" else 1e-3, "save_every": 0, "device": "cpu", "num_threads": 1},
        "output": {"dir": str(tmp / "runs" / name), "tensorboard": False},
        "cluster": {"nodes": procs, "gpus_per_node": 1, "device": "cpu"},
        "sharding": {"strategy": strategy} if procs > 1 else {},
    }


def _run_two_nodes(link: netns.Link, recipe_path: Path) -> None:
    """The two node commands of `homelab-ft launch --iface lan0`, each inside its namespace."""
    hosts = [launch.Host(address=node.addr, rdzv_address=node.addr) for node in link.nodes]
    commands = launch.node_commands(hosts, str(recipe_path), [], nodes=2, nproc_per_node=1, iface=netns.IFACE,
                                    join_timeout_s=60, python=sys.executable, num_threads=1)
    procs = [subprocess.Popen(node.wrap(command.argv), env={**child_env(), **command.env}, cwd=REPO,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for node, command in zip(link.nodes, commands, strict=True)]
    try:
        logs = [p.communicate(timeout=240)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    assert all(p.returncode == 0 for p in procs), "\n".join(log[-4000:] for log in logs)


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
    out = {}
    with netns.shaped_link(RATE_MBIT) as link:
        for name, recipe in two.items():
            path = tmp / f"{name}.yaml"
            path.write_text(json.dumps(recipe))
            _run_two_nodes(link, path)
            out[name] = _losses(Path(recipe["output"]["dir"]))
    one = [{"kind": "train", "name": f"ref_{m}", "recipe": _recipe(tmp, tiny_model_dir, f"ref_{m}", method=m, procs=1,
                                                                   strategy="no_shard")}
           for m in ("full", "lora")]
    spec = tmp / "one.json"
    spec.write_text(json.dumps({"base_dir": str(tmp), "jobs": one}))
    run_checked([sys.executable, str(WORKER), str(spec), str(tmp / "one.out.json")])
    out.update({k: v["losses"] for k, v in json.loads((tmp / "one.out.json").read_text()).items() if k.startswith("ref_")})
    return out


@pytest.mark.parametrize(("name", "ref"), [("full_shard", "ref_full"), ("lora_ddp", "ref_lora")])
def test_two_namespace_nodes_train_as_one_process(results, name, ref):
    expected, got = results[ref], results[name]
    assert len(expected) == STEPS and expected[-1] < expected[0]  # it trains
    assert len(got) == STEPS
    assert max(abs(a - b) for a, b in zip(got, expected, strict=True)) <= TOL, (got, expected)
