"""grpo.rollout=node across two network namespaces joined by a 1 Gbit shaped link (tests/netns.py),
started with the node commands `homelab-ft launch --iface lan0` prints: the trainer on one node, the
rollout rank on the other. The run completes, every sync sends exactly the adapters' bytes, and the
run equals the same recipe run colocated in one process. Root only."""

from __future__ import annotations

import json

import netns
import pytest
from procs import child_env
from test_grpo_rollout_node import (
    adapter_bytes,
    assert_same_run,
    assert_syncs,
    metrics,
    recipe,
    train_here,
    write_inputs,
)
from test_netns_train import _run_two_nodes

pytestmark = pytest.mark.skipif(netns.unavailable() is not None, reason=netns.unavailable() or "")

RATE_MBIT = 1000


def test_a_rollout_node_across_a_shaped_link(tmp_path, tiny_model_dir):
    tmp = write_inputs(tmp_path)
    body = recipe(tmp, tiny_model_dir, "netns_node", method="lora", rollout="node")
    body["cluster"] = {"nodes": 2, "gpus_per_node": 1, "device": "cpu"}
    body["output"]["dir"] = str(tmp / "runs" / "netns_node")
    path = tmp / "netns_node.yaml"
    path.write_text(json.dumps(body))
    with netns.shaped_link(RATE_MBIT) as link:
        _run_two_nodes(link, path, env=child_env())
    node = metrics(tmp / "runs" / "netns_node")
    assert_syncs(node, adapter_bytes(tiny_model_dir, "lora"))
    assert_same_run(node, train_here(tmp, recipe(tmp, tiny_model_dir, "colo", method="lora", rollout="colocated")))
