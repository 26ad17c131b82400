"""The planner's inputs (plan/inputs.py) and the seam between memory.py and network.py: the
request's derived values, and the gradient-sync decision memory.py makes for network.py."""

from __future__ import annotations

import functools
import json
from pathlib import Path

import pytest

from homelab_ft.plan.inputs import Cluster
from homelab_ft.plan.ladder import option_rung
from homelab_ft.plan.planner import default_request
from homelab_ft.plan.price.memory import GiB, sync_deferred
from homelab_ft.plan.price.network import communication
from homelab_ft.plan.shape.shapes import model_shape

CONFIGS = Path(__file__).resolve().parents[2] / "configs"


@functools.cache
def llama_1b():
    """Derived when a test first needs it, not at collection (in each xdist worker)."""
    return model_shape(json.loads((CONFIGS / "llama-3.2-1b.json").read_text()))


TWO_NODES = Cluster(device="cuda", nodes=2, gpus_per_node=1, device_bytes=80 * GiB, host_ram_bytes=256 * GiB)


@pytest.mark.parametrize(("reduce_dtype", "expected"), [("float32", 4), ("bfloat16", 2)])
def test_reduce_bytes_follows_sharding_reduce_dtype(reduce_dtype, expected):
    assert default_request(sharding={"reduce_dtype": reduce_dtype}).reduce_bytes == expected


def test_chunked_loss_only_for_sft_with_a_chunk_size():
    assert default_request(train={"loss_chunk_tokens": 128}).chunked_loss
    assert not default_request(train={"loss_chunk_tokens": 0}).chunked_loss
    assert not default_request(objective="dpo", train={"loss_chunk_tokens": 128}).chunked_loss


def test_dpo_rows_are_pairs():
    assert default_request(train={"micro_batch_size": 3}).rows_per_micro_batch == 3
    assert default_request(objective="dpo", train={"micro_batch_size": 3}).rows_per_micro_batch == 6


@pytest.mark.parametrize(("method", "strategy", "deferred"), [
    ("lora", "full_shard", True),  # adapters: far under DEFER_SYNC_TRAINABLE_FRACTION of the params
    ("full", "full_shard", False),  # a deferred full sync would keep a whole unsharded gradient
    ("full", "shard_grad_op", True),  # blocks stay gathered: one reduce-scatter per step
])
def test_sync_deferred(method, strategy, deferred):
    request = default_request()
    rung = option_rung(method, strategy, False, request=request, cluster=TWO_NODES)
    trainable = llama_1b().total_params if method == "full" else llama_1b().total_params // 100
    assert sync_deferred(llama_1b(), rung=rung, trainable=trainable) is deferred


def test_a_deferred_sync_sends_the_gradients_once_per_step():
    """Four micro-batches: reduce-scattering every one sends three more gradient copies."""
    request = default_request(train={"grad_accum_steps": 4})
    rung = option_rung("full", "full_shard", False, request=request, cluster=TWO_NODES)
    base = llama_1b().total_params * 2
    kwargs = dict(rung=rung, request=request, cluster=TWO_NODES, root_bytes=llama_1b().root_params * 2)
    every = communication(llama_1b(), base, llama_1b().total_params, sync_deferred=False, **kwargs)
    once = communication(llama_1b(), base, llama_1b().total_params, sync_deferred=True, **kwargs)
    grads = llama_1b().total_params * request.reduce_bytes
    assert every.sent_bytes - once.sent_bytes == pytest.approx(3 * grads / 2, abs=2)
    assert every.grads_s > once.grads_s


def test_pricing_reads_the_rung_for_what_the_key_leaves_out():
    """ladder.sized_price keeps prices under request.pricing_key, which leaves out method,
    sharding.strategy and sharding.cpu_offload: every option priced fresh (ladder._sized_price) is
    the same under any of them, and a key changes with everything else pricing reads."""
    from homelab_ft.plan.ladder import _sized_price, offers

    request = default_request(data={"max_length": 512})
    variants = [request.changed(method=m, sharding={"strategy": s, "cpu_offload": off})
                for m, s, off in [("full", "full_shard", True), ("qlora", "no_shard", False), ("lora", "shard_grad_op", True)]]
    assert {v.pricing_key for v in variants} == {request.pricing_key}
    options = offers(llama_1b(), request=request, cluster=TWO_NODES)[0]
    assert len(options) > 10
    for option in options:
        fresh = _sized_price(llama_1b(), rung=option.rung, request=request, cluster=TWO_NODES)
        for variant in variants:
            assert _sized_price(llama_1b(), rung=option.rung, request=variant, cluster=TWO_NODES) == fresh
    assert request.changed(sharding={"reduce_dtype": "bfloat16"}).pricing_key != request.pricing_key
    assert request.changed(data={"max_length": 256}).pricing_key != request.pricing_key
