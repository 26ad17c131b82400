"""A 2-stage pipeline whose stages are two network-namespace nodes, against one process.

Stage 0 (embeddings, first blocks) runs on node a, stage 1 (last blocks, norm, head, loss) on node
b; the activations and their gradients cross the shaped veth link (tests/netns.py) through
torch.distributed.pipelining's send/recv over gloo. The node commands are the ones
`homelab-ft launch --iface lan0` prints, one process per node, as test_netns_train.py starts them.
Micro-batches (grad_accum_steps 4) exceed the stages, so the 1F1B schedule interleaves; the loss of
every step must equal one process's on the same rows within 1e-5 (issue 22: "a 2-node run across
the network namespaces ... matching a 1-process run"). Root only; the namespaces go afterwards.
"""

from __future__ import annotations

import json
from pathlib import Path

import build_recipe
import netns
import pytest
from procs import Workers, child_env, job_recipe, run_checked, write_chat_data
from test_netns_train import RATE_MBIT, STEPS, TOL, _losses, _run_two_nodes

pytestmark = pytest.mark.skipif(netns.unavailable() is not None, reason=netns.unavailable() or "")


def _recipe(tmp: Path, model_dir: Path, name: str, *, method: str, nodes: int) -> dict:
    """Micro-batches of 2 rows, 4 per step, on one pipeline (2 nodes) or one process: the same rows."""
    return job_recipe(tmp, model_dir, name, procs=nodes, method=method,
                      sharding={"strategy": "no_shard", "pipeline_stages": 2}, data={"max_length": 96},
                      train={"max_steps": STEPS, "grad_accum_steps": 4, "lr": 5e-3 if method == "lora" else 1e-3,
                             "save_every": 0, "num_threads": 1, "loss_chunk_tokens": 16},
                      cluster={"nodes": nodes, "gpus_per_node": 1, "device": "cpu"})


METHODS = ("full", "lora")


@pytest.fixture(scope="module")
def results(tmp_path_factory, tiny_model_dir) -> dict:
    tmp = tmp_path_factory.mktemp("netns_pp")
    write_chat_data(tmp / "train.jsonl", 48)
    out: dict = {"node_logs": {}}
    with netns.shaped_link(RATE_MBIT) as link:
        for method in METHODS:
            recipe = _recipe(tmp, tiny_model_dir, f"pp_{method}", method=method, nodes=2)
            path = build_recipe.write_recipe(tmp / f"pp_{method}.yaml", recipe)
            out["node_logs"][method] = _run_two_nodes(link, path, env=child_env())
            out[f"pp_{method}"] = _losses(Path(recipe["output"]["dir"]))
    # a pipeline stage draws each LoRA adapter from the seed and the module's name (loading.reset_adapters),
    # not from one process's RNG stream: the reference draws them the same way
    one = [{"kind": "train", "name": f"ref_{m}", "reset_adapters": m == "lora",
            "recipe": _recipe(tmp, tiny_model_dir, f"ref_{m}", method=m, nodes=1)} for m in METHODS]
    spec = tmp / "one.json"
    spec.write_text(json.dumps({"base_dir": str(tmp), "jobs": one}))
    run_checked(Workers(spec, tmp / "one.out.json"))
    out.update({k: v["losses"] for k, v in json.loads((tmp / "one.out.json").read_text()).items() if k.startswith("ref_")})
    return out


@pytest.mark.parametrize("method", METHODS)
def test_two_namespace_nodes_as_pipeline_stages_train_as_one_process(results, method):
    expected, got = results[f"ref_{method}"], results[f"pp_{method}"]
    assert len(expected) == STEPS and expected[-1] < expected[0]  # it trains
    assert len(got) == STEPS, results["node_logs"][method][0][-3000:]
    assert max(abs(a - b) for a, b in zip(got, expected, strict=True)) <= TOL, (got, expected)
