"""GRPO's pricing (plan/price/rollout.py, issue 33): the KV cache worked by hand, generation's peak beside
training's, generation time over the completion length and num_iterations, the training side priced as
SFT's over micro_batch x G sequences of prompt + completion tokens, and what the ladder refuses for GRPO."""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

import pytest

from homelab_ft.plan.hardware import Detected, resolve_cluster
from homelab_ft.plan.inputs import HOST_MEMORY_BYTES_PER_S, Cluster
from homelab_ft.plan.ladder import choose, option_rung
from homelab_ft.plan.planner import default_request, plan
from homelab_ft.plan.price.memory import GiB, estimate
from homelab_ft.plan.price.rollout import (
    ADAPTER_HOST_FACTOR,
    DECODE_HOST_S_PER_BLOCK,
    DEQUANT_BYTES_PER_PARAM,
    kv_cache_bytes,
)
from homelab_ft.plan.report import format_plan
from homelab_ft.plan.shape.shapes import model_shape
from homelab_ft.recipe.config import ClusterConfig
from homelab_ft.rung import Rung, RungError

CONFIGS = Path(__file__).resolve().parents[3] / "configs"
TINY = {"model_type": "llama", "vocab_size": 128, "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "intermediate_size": 128, "max_position_embeddings": 512}
ONE_GPU = Cluster(device="cuda", nodes=1, gpus_per_node=1, device_bytes=24 * GiB, host_ram_bytes=64 * GiB,
                  tflops=40.0, memory_bytes_per_s=1000e9)
REWARD = ["exact_answer"]


def _shape(name: str):
    return model_shape(json.loads((CONFIGS / f"{name}.json").read_text()))


def grpo(*, method: str = "qlora", micro_batch: int = 1, **section):
    """A GRPO request: 256-token prompts, the grpo section's defaults but `section`."""
    return default_request(method=method, objective="grpo", data={"max_length": 256},
                           train={"micro_batch_size": micro_batch, "activation_checkpointing": True},
                           grpo={"reward_funcs": REWARD, **section})


def priced(shape, request, cluster=ONE_GPU, *, strategy="no_shard", offload=False):
    rung = option_rung(request.method if request.method != "auto" else "qlora", strategy, offload, request=request,
                       cluster=cluster)
    return estimate(shape, rung=rung, request=request, cluster=cluster)


@pytest.mark.parametrize(("config", "elements"), [
    (TINY, 2 * 2 * 2 * 16),  # 2 layers x (key + value) x 2 KV heads x head_dim 64 / 4
    (json.loads((CONFIGS / "qwen3-8b.json").read_text()), 36 * 2 * 8 * 128),  # head_dim 128 from the config
    (json.loads((CONFIGS / "llama-3-8b.json").read_text()), 32 * 2 * 8 * 128),
])
def test_kv_width_from_the_config(config, elements):
    assert model_shape(config).kv_elements_per_token == elements


def test_kv_cache_bytes_by_hand():
    """2 prompts x G=4 = 8 rows of 32 + 16 tokens; 128 elements per token; bf16 on a GPU, fp32 on the CPU."""
    shape = model_shape(TINY)
    request = default_request(objective="grpo", data={"max_length": 32}, train={"micro_batch_size": 2},
                              grpo={"reward_funcs": REWARD, "num_generations": 4, "max_completion_length": 16})
    assert (request.rows_per_micro_batch, request.sequence_tokens, request.micro_batch_tokens) == (8, 48, 384)
    assert kv_cache_bytes(shape, request, 2) == 8 * 48 * 128 * 2 == 98_304
    est = priced(shape, request.changed(method="lora"))
    assert est.rollout.kv_cache_bytes == 98_304
    cpu = Cluster(device="cpu", nodes=1, gpus_per_node=1, device_bytes=8 * GiB, host_ram_bytes=8 * GiB)
    assert priced(shape, request.changed(method="lora"), cpu).rollout.kv_cache_bytes == 8 * 48 * 128 * 4


def test_the_training_side_is_sft_over_the_rollout_rows():
    """A GRPO micro-batch of 2 prompts x G=4 trains like an SFT micro-batch of 8 rows of prompt + completion."""
    s = _shape("llama-3.2-1b")
    g = grpo(method="lora", micro_batch=2, num_generations=4, max_completion_length=512)
    sft = default_request(method="lora", data={"max_length": 256 + 512},
                          train={"micro_batch_size": 8, "activation_checkpointing": True})
    a, b = priced(s, g), priced(s, sft)
    assert g.chunked_loss and g.rows_per_micro_batch == 8 and g.sequence_tokens == 768
    for item in ("weights", "optimizer", "activations", "logits", "recomputed"):
        assert getattr(a.memory, item) == getattr(b.memory, item), item
    assert a.memory.training_peak == b.memory.total and a.compute_s == b.compute_s
    assert b.rollout is None and b.memory.generation == 0 and b.step_s == b.training_s
    assert a.step_s == pytest.approx(a.training_s + a.rollout.seconds)


def test_the_peak_is_the_larger_phase_and_generation_holds_the_kv_cache():
    s = _shape("qwen3-8b")
    est = priced(s, grpo(num_generations=8, max_completion_length=1024))
    m = est.memory
    assert m.total == max(m.training_peak, m.generation_peak)
    # resident (weights + optimizer: one micro-batch per step, no gradients held) + KV + a transient
    resident = m.weights + m.optimizer + m.gathered
    assert m.generation - resident - est.rollout.kv_cache_bytes > 0
    assert est.rollout.kv_cache_bytes == 8 * (256 + 1024) * 36 * 2 * 8 * 128 * 2
    # more generations: the KV cache and so generation's peak grow with G
    more = priced(s, grpo(num_generations=16, max_completion_length=1024))
    assert more.rollout.kv_cache_bytes == 2 * est.rollout.kv_cache_bytes and more.memory.generation > m.generation
    # accumulated gradients stay resident through the next micro-batch's generation
    accum = priced(s, grpo(num_generations=8).changed(train={"grad_accum_steps": 2}))
    single = priced(s, grpo(num_generations=8))
    assert accum.memory.generation - single.memory.generation == accum.memory.gradients


def test_generation_time_grows_with_the_completion_and_divides_by_num_iterations():
    s = _shape("qwen3-8b")
    times = [priced(s, grpo(max_completion_length=c)).rollout.generation_s for c in (256, 512, 1024, 2048)]
    assert times == sorted(times) and len(set(times)) == 4
    # decode-bound: doubling the completion roughly doubles generation (the KV read grows a little, the prefill not)
    assert all(1.8 < b / a < 2.3 for a, b in zip(times, times[1:], strict=False))
    once = priced(s, grpo(num_iterations=1)).rollout
    four = priced(s, grpo(num_iterations=4)).rollout
    assert four.generation_s == pytest.approx(once.generation_s / 4)
    assert once.old_logprob_s == 0 and four.old_logprob_s > 0 and once.reference_s == four.reference_s == 0
    # grad_accum_steps micro-batches each generate
    assert priced(s, grpo().changed(train={"grad_accum_steps": 3})).rollout.generation_s == pytest.approx(3 * once.generation_s)


def test_a_decode_step_reads_the_weights_at_the_memory_bandwidth():
    """Memory-bound decode: twice the bandwidth halves the decode; a 4-bit base reads its dequantized copy too."""
    s = _shape("qwen3-8b")
    request = grpo(num_generations=2, max_completion_length=1024)
    slow, fast = (priced(s, request, dataclasses.replace(ONE_GPU, memory_bytes_per_s=bw)) for bw in (50e9, 100e9))
    prefill = 2 * (s.active_params - s.embedding_params) * 2 * 256 / 40e12 * 1.3  # QLoRA's slowdown
    assert (slow.rollout.generation_s - prefill) == pytest.approx(2 * (fast.rollout.generation_s - prefill), rel=1e-6)
    assert slow.rollout.decode_bound == fast.rollout.decode_bound == "memory"
    lora = priced(s, request.changed(method="lora"), dataclasses.replace(ONE_GPU, memory_bytes_per_s=100e9))
    decode_q = (fast.rollout.generation_s - prefill) / 1024
    decode_l = (lora.rollout.generation_s - prefill / 1.3) / 1024
    # QLoRA reads ~0.56 B of packed weight + DEQUANT_BYTES_PER_PARAM per linear weight against LoRA's 2 B
    assert decode_q > decode_l * (DEQUANT_BYTES_PER_PARAM + 0.5) / 2 * 0.9


def test_the_host_launching_the_ops_is_a_floor():
    """A device far faster than eager generate can feed it decodes at the host's pace (DECODE_HOST_S_PER_BLOCK)."""
    s = _shape("qwen3-8b")
    request = grpo(method="lora", num_generations=2, max_completion_length=1024, num_iterations=1)
    fast = dataclasses.replace(ONE_GPU, memory_bytes_per_s=1e15, tflops=1e6)
    est = priced(s, request, fast)
    prefill = 2 * (s.active_params - s.embedding_params) * 2 * 256 / 1e18
    floor = 36 * DECODE_HOST_S_PER_BLOCK["cuda"] * ADAPTER_HOST_FACTOR
    assert est.rollout.generation_s == pytest.approx(prefill + 1024 * floor)
    assert est.rollout.decode_bound == "host" and est.rollout.decode_step_s == pytest.approx(floor)
    assert "bound by the host launching eager generate's ops" in format_plan(plan(s, request=request, cluster=fast))


def test_beta_needs_the_adapters():
    """beta > 0: the reference is the base with the adapters disabled; a full fine-tune is not offered."""
    s = _shape("llama-3.2-1b")
    line = ("objective=grpo with grpo.beta > 0 needs a reference model, which a full fine-tune would hold as a "
            "second copy; use method: lora or qlora, or grpo.beta=0")
    got = plan(s, request=grpo(method="auto", beta=0.04), cluster=ONE_GPU)
    assert not any(o.method == "full" for o in got.options) and got.chosen.method == "qlora"
    assert {r.label for r in got.refused} == {"full no_shard", "full full_shard +offload"}
    assert all(r.reason == line for r in got.refused) and line in format_plan(got)
    assert got.chosen.rollout.reference_s > 0
    with pytest.raises(RungError, match=re.escape(line)):
        plan(s, request=grpo(method="full", beta=0.04), cluster=ONE_GPU)
    assert plan(s, request=grpo(method="full"), cluster=ONE_GPU).chosen.method == "full"  # beta = 0: no reference


def test_grpo_is_not_pipelined():
    two = Cluster(device="cuda", nodes=2, gpus_per_node=1, device_bytes=16 * GiB, host_ram_bytes=64 * GiB)
    got = plan(_shape("llama-3.2-1b"), request=grpo(method="full").changed(train={"grad_accum_steps": 4}), cluster=two)
    assert not any(o.rung.pipeline_enabled for o in got.options)
    assert any("objective=grpo is not run pipelined yet; set objective: sft" in r.reason for r in got.refused)


def test_the_plan_shows_both_phases():
    s = _shape("qwen3-8b")
    got = plan(s, request=grpo(max_completion_length=1024), cluster=ONE_GPU)
    text = format_plan(got)
    line = next(x for x in text.splitlines() if x.startswith("grpo     "))
    assert "G=8 x 1 prompt(s)" in line and "rollout KV cache" in line and "s generation" in line and "s training" in line
    assert "objective=grpo (8 sequences of <= 256+1024 tokens per micro-batch)" in text
    chosen = got.to_dict()["chosen"]
    assert chosen["rollout"]["kv_cache_bytes"] == got.chosen.rollout.kv_cache_bytes
    assert chosen["memory"]["generation_peak"] == got.chosen.memory.generation_peak
    assert chosen["step_s"] == pytest.approx(chosen["training_s"] + chosen["rollout"]["seconds"])
    assert got.to_dict()["request"]["grpo"]["num_generations"] == 8
    # an SFT plan's JSON holds none of it
    sft = plan(s, request=default_request(method="qlora"), cluster=ONE_GPU).to_dict()
    assert "rollout" not in sft["chosen"] and "generation" not in sft["chosen"]["memory"]
    assert "grpo" not in sft["request"] and "memory_bytes_per_s" not in sft["cluster"]


def test_what_would_fit_offers_fewer_or_shorter_rollouts():
    small = dataclasses.replace(ONE_GPU, device_bytes=10 * GiB)
    got = plan(_shape("qwen3-8b"), request=grpo(num_generations=16, max_completion_length=2048), cluster=small)
    assert got.chosen is None
    assert [t.split(":")[0] for t in got.suggestions[:2]] == ["grpo.num_generations=8", "grpo.max_completion_length=1024"]


def test_a_prompt_and_its_completion_fit_the_model():
    from homelab_ft.errors import UserError

    with pytest.raises(UserError, match=r"data.max_length=256 \+ grpo.max_completion_length=512 is beyond"):
        plan(model_shape(TINY), request=grpo(max_completion_length=512), cluster=ONE_GPU)


@pytest.mark.parametrize(("gpu_name", "device", "bandwidth"), [
    ("NVIDIA GeForce RTX 4090", "cuda", 1008e9),
    (None, "cuda", 936e9),  # unnamed 24 GB: priced as the table's slowest 24 GB card, the RTX 3090
    (None, "cpu", HOST_MEMORY_BYTES_PER_S / 2),  # two processes share the host's bandwidth
])
def test_the_cluster_carries_the_memory_bandwidth(gpu_name, device, bandwidth):
    cfg = ClusterConfig(device=device, gpus_per_node=2 if device == "cpu" else 1, vram_gib=24 if device == "cuda" else None,
                        gpu_name=gpu_name)
    detected = Detected(gpu_count=0, gpu_name=None, vram_bytes=None, host_ram_bytes=64 * GiB, cpu_cores=4)
    c = resolve_cluster(cfg, detected=detected)
    assert c.memory_bandwidth == bandwidth == c.memory_bytes_per_s


TWO_NODES = dataclasses.replace(ONE_GPU, nodes=2, inter_link_gbit=1.0)


def test_a_rollout_node_moves_generation_off_the_trainer_and_adds_the_adapters_sync():
    """grpo.rollout=node (version 1, synchronous): the trainer is one process (no gradient
    collectives), the rollout node's GPU holds the base and adapters only (no optimizer state), and
    the step adds the adapters' bytes over the 1 GbE link, once per sampled batch: PEFT's fp32
    adapters cross, and are held on the node, in the base's bf16 (rules/adapter_sync.py)."""
    shape = _shape("qwen3-8b")
    colocated = priced(shape, grpo(method="lora"), TWO_NODES)
    node = priced(shape, grpo(method="lora", rollout="node"), TWO_NODES)
    x = node.rollout
    adapter = node.trainable_params * 2  # fp32 adapters as bf16
    assert x.node and x.adapter_bytes == adapter and adapter / 2**20 == pytest.approx(83.2, abs=0.05)
    assert x.sync_s == pytest.approx(adapter / TWO_NODES.inter_bytes_per_s + 4 * TWO_NODES.inter_hop_s)
    assert node.comm_s == 0 and colocated.comm_s > 0
    assert node.memory.generation_peak == colocated.memory.generation_peak - colocated.memory.optimizer - adapter
    assert node.memory.training_peak == colocated.memory.training_peak
    assert x.generation_s == colocated.rollout.generation_s
    assert node.step_s == pytest.approx(node.training_s + x.seconds)
    # one sync per sampled batch: num_iterations spreads it as it does the generation
    twice = priced(shape, grpo(method="lora", rollout="node", num_iterations=2), TWO_NODES)
    assert twice.rollout.sync_s == pytest.approx(x.sync_s / 2)
    text = format_plan(plan(shape, request=grpo(method="lora", rollout="node"), cluster=TWO_NODES))
    assert "generated on the rollout node" in text and "adapter sync" in text and "grpo.max_staleness=0" in text
    named = plan(shape, request=grpo(method="lora", rollout="colocated"), cluster=TWO_NODES)
    assert "a second machine can generate instead: grpo.rollout=node" in format_plan(named)
    assert "a second machine can generate instead" not in format_plan(plan(shape, request=grpo(method="lora"),
                                                                            cluster=TWO_NODES))  # auto priced it


def test_an_overlapped_rollout_node_prices_the_longer_of_training_and_generation():
    """grpo.max_staleness=1: the node generates (and scores, for the importance weights) the next
    step's batch while this one trains, so the step is the sync plus the longer of the two; the
    planner then takes the node under `auto` when it is the faster option."""
    shape = _shape("qwen3-8b")
    waits = priced(shape, grpo(method="lora", rollout="node"), TWO_NODES)
    ahead = priced(shape, grpo(method="lora", rollout="node", max_staleness=1), TWO_NODES)
    x = ahead.rollout
    assert x.overlapped and not waits.rollout.overlapped and waits.rollout.node_logprob_s == 0
    assert x.generation_s == waits.rollout.generation_s and x.node_logprob_s > 0
    assert ahead.step_s == pytest.approx(x.sync_s + max(ahead.training_s, x.generation_s + x.node_logprob_s))
    assert ahead.step_s < waits.step_s
    text = format_plan(plan(shape, request=grpo(method="lora", rollout="node", max_staleness=1), cluster=TWO_NODES))
    assert "generates the next step's batch while this one trains" in text
    auto = plan(shape, request=grpo(method="lora", max_staleness=1), cluster=TWO_NODES)
    colocated = plan(shape, request=grpo(method="lora", rollout="colocated"), cluster=TWO_NODES)
    assert auto.chosen.rung.rollout_staleness == (auto.chosen.rung.rollout == "node")
    assert auto.chosen.step_s <= colocated.chosen.step_s
    assert colocated.chosen.rung.rollout_staleness == 0


def test_afford_answers_how_many_generations_and_how_long_a_completion_fit():
    shape = _shape("qwen3-8b")
    request = grpo(method="qlora", max_completion_length=1024)
    p = plan(shape, request=request, cluster=ONE_GPU)
    mine = p.affordable[0]
    assert mine.num_generations >= 2 and mine.completion_len >= 64

    def fits(**grpo_section) -> bool:
        chosen = plan(shape, request=request.changed(grpo=grpo_section), cluster=ONE_GPU).chosen
        return chosen is not None and chosen.method == "qlora"

    # at the limits the rung fits; at twice them it does not (the plan may turn on a saver the
    # afford search holds off, so the exact edge is the option's, not the plan's)
    assert fits(num_generations=mine.num_generations) and not fits(num_generations=2 * mine.num_generations)
    assert fits(max_completion_length=mine.completion_len) and not fits(max_completion_length=2 * mine.completion_len)
    text = format_plan(p)
    assert f"num_generations <= {mine.num_generations} at max_completion_length 1024" in text
    assert "num_generations" not in json.dumps(plan(shape, request=default_request(method="qlora"),
                                                    cluster=ONE_GPU).to_dict()["afford"])


def test_auto_rollout_prices_both_placements_and_takes_the_fastest_that_fits():
    """grpo.rollout: auto prices the node beside every colocated option of a 2-process job. Colocated
    trains on both ranks (two batches per step), so it wins wherever it fits; version 1's node, which
    only frees the trainer's GPU of generation, is taken where no colocated option fits (as `choose`
    does here over the node options alone: in v1 the training peak binds every such GRPO plan, so the
    node is never the only fit in practice), and `train` gets the chosen rung from the plan."""
    shape = _shape("qwen3-8b")
    request = grpo(method="qlora", max_completion_length=1024)
    auto = plan(shape, request=request, cluster=TWO_NODES)
    assert auto.chosen.rung.rollout == "colocated" and auto.chosen.rung.data_parallel_size == 2
    nodes = tuple(o for o in auto.options if o.rung.rollout_node_enabled and o.method == "qlora")
    assert [o.label for o in nodes] == ["qlora no_shard +ckpt +rollout-node"]
    assert not any("rollout-node" in r.label for r in auto.refused)  # auto lists no node refusal per strategy
    named = plan(shape, request=grpo(method="qlora", max_completion_length=1024, rollout="node"), cluster=TWO_NODES)
    assert named.chosen.rung == nodes[0].rung and named.chosen.step_s == nodes[0].step_s  # one price either way
    assert nodes[0].batch_s == nodes[0].step_s > 2 * auto.chosen.batch_s  # one trainer, and it waits
    chosen = choose(nodes, request=request)
    assert chosen is not None and chosen.rung.rollout_node_enabled
    assert Rung.from_dict(chosen.rung.to_dict()).rollout_node_enabled  # plan.json / the torchrun handoff
    one = plan(shape, request=request, cluster=ONE_GPU)
    assert all(o.rung.rollout == "colocated" for o in one.options)  # one process: nothing to generate on
