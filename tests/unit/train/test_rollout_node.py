"""grpo.rollout=node without a process group: the refusals (one rule, asked by the planner and the
trainer), the adapter buffers' round trip, and the trainer engine's syncs (only when the adapters
changed, exactly their bytes) over a stand-in link."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from homelab_ft.distributed import rollout_link
from homelab_ft.distributed.rollout_link import empty_like_flat, flatten, unflatten_into
from homelab_ft.errors import UserError
from homelab_ft.plan.inputs import Cluster
from homelab_ft.plan.planner import default_request, plan
from homelab_ft.plan.price.memory import GiB
from homelab_ft.plan.shape.shapes import model_shape
from homelab_ft.recipe.config import recipe_from_dict
from homelab_ft.recipe.objectives import GrpoConfig
from homelab_ft.rules import refusals
from homelab_ft.rung import Rung, RungError, rung_for
from homelab_ft.train import rollout_node
from homelab_ft.train.rollout import Colocated

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
GRPO = {"objective": "grpo", "grpo": {"reward_funcs": ["exact_answer"], "rollout": "node"}}


def _rule(rung: Rung) -> str | None:
    return refusals.rollout_node(replace(rung, rollout="node"), objective="grpo")


def test_the_rule_refuses_each_layout_in_one_line():
    assert _rule(Rung("lora", "no_shard", False, procs_per_node=2)) is None
    assert _rule(Rung("qlora", "no_shard", False, nodes=2)) is None
    assert "cluster.nodes=2 and cluster.gpus_per_node=1" in _rule(Rung("lora", "no_shard", False))
    assert "cluster.nodes=2" in _rule(Rung("lora", "no_shard", False, procs_per_node=4))
    assert "method=full trains every weight" in _rule(Rung("full", "no_shard", False, procs_per_node=2))
    assert "grpo.rollout=node is not run pipelined yet" in _rule(
        Rung("lora", "no_shard", False, procs_per_node=2, pipeline_stages=2))
    assert "sharding.strategy=full_shard does not apply" in _rule(Rung("lora", "full_shard", False, procs_per_node=2))
    assert refusals.rollout_node(Rung("full", "no_shard", False), objective="grpo") is None  # colocated
    assert "objective=sft samples none" in refusals.rollout_node(
        Rung("lora", "no_shard", False, nodes=2, rollout="node"), objective="sft")
    assert all("\n" not in _rule(r) for r in (Rung("lora", "no_shard", False), Rung("full", "no_shard", False, nodes=2)))


def test_the_trainer_asks_the_same_rule():
    recipe = recipe_from_dict({**GRPO, "method": "full", "cluster": {"gpus_per_node": 2}})
    with pytest.raises(RungError, match="method=full trains every weight"):
        rollout_node.check(recipe, rung=rung_for(recipe))
    assert rung_for(recipe).rollout == "node"
    auto = recipe_from_dict({**GRPO, "grpo": {**GRPO["grpo"], "rollout": "auto"}, "cluster": {"gpus_per_node": 2}})
    assert rung_for(auto).rollout == "colocated"  # with no plan to choose, generation stays in the trainer


def test_the_planner_offers_only_what_the_rule_allows():
    shape = model_shape(json.loads((CONFIGS / "llama-3.2-1b.json").read_text()))
    two = Cluster(device="cuda", nodes=2, gpus_per_node=1, device_bytes=16 * GiB, host_ram_bytes=64 * GiB,
                  inter_link_gbit=1.0, tflops=40.0)
    got = plan(shape, request=default_request(method="lora", **GRPO), cluster=two)
    assert got.chosen.rung.strategy == "no_shard" and not got.chosen.rung.pipeline_enabled
    assert any("grpo.rollout=node" in r.reason for r in got.refused)
    one = Cluster(device="cuda", nodes=1, gpus_per_node=1, device_bytes=16 * GiB, host_ram_bytes=64 * GiB)
    with pytest.raises(UserError, match="grpo.rollout=node runs one trainer and one rollout rank"):
        plan(shape, request=default_request(method="lora", **GRPO), cluster=one)


def test_a_misspelt_engine_is_one_line():
    with pytest.raises(UserError, match="grpo.rollout"):
        recipe_from_dict({"objective": "grpo", "grpo": {"reward_funcs": ["exact_answer"], "rollout": "remote"}})


def test_adapter_buffers_round_trip_one_per_dtype():
    g = torch.Generator().manual_seed(0)
    tensors = [torch.randn(4, 3, generator=g), torch.randn(5, generator=g).bfloat16(), torch.randn(2, 2, generator=g),
               torch.randn(3, 1, generator=g).bfloat16()]
    buffers = flatten(tensors)
    assert [(b.dtype, b.numel()) for b in buffers] == [(torch.float32, 16), (torch.bfloat16, 8)]
    received = empty_like_flat(tensors, device=torch.device("cpu"))
    assert [(b.dtype, b.numel()) for b in received] == [(b.dtype, b.numel()) for b in buffers]
    for dst, src in zip(received, buffers, strict=True):
        dst.copy_(src)
    copies = [torch.zeros_like(t) for t in tensors]
    unflatten_into(copies, received)
    assert all(torch.equal(a, b) for a, b in zip(copies, tensors, strict=True))


class _Link:
    """Stands in for rollout_link.Link: records what was sent, answers with the prompts and one end token."""

    synced_dtype = rollout_link.Link.synced_dtype

    def __init__(self, compute_dtype: torch.dtype = torch.float32):
        self.sent: list[list[torch.Tensor] | None] = []
        self.compute_dtype = compute_dtype

    def request(self, ids, mask, *, seed, greedy, adapters):
        self.sent.append(adapters)
        return torch.cat([ids, torch.full((ids.size(0), 1), 2)], dim=1), 0.001 if adapters is not None else 0.0


class _Tokenizer:
    pad_token_id, eos_token_id = 0, 2

    def batch_decode(self, ids, skip_special_tokens=True):
        return [" ".join(map(str, i)) for i in ids]


def test_remote_sends_the_adapters_only_when_they_changed():
    model = torch.nn.Linear(3, 2)
    model.bias.requires_grad_(False)  # a frozen base weight is never sent
    local = Colocated(settings=GrpoConfig(num_generations=2), tokenizer=_Tokenizer(), device=torch.device("cpu"),
                      distributed=False)
    link = _Link()
    remote = rollout_node.Remote(local=local, link=link)
    rows = [{"prompt": json.dumps(p), "columns": "{}", "prompt_ids": ids} for p, ids in (("a", [5, 6]), ("b", [7]))]
    first = remote.sample(model, rows, seed=1)
    assert first.num_completions == 4 and first.completion_ids == [[2]] * 4
    remote.sample(model, rows, seed=2, greedy=True, num_generations=1)
    assert remote.sync_stats() == {"rollout/adapter_bytes": 24.0, "rollout/syncs": 1.0, "rollout/sync_s": 0.001}
    with torch.no_grad():
        model.weight.add_(1.0)
    remote.sample(model, rows, seed=3)
    assert [s is not None for s in link.sent] == [True, False, True]
    assert torch.equal(link.sent[-1][0], model.weight.reshape(-1))
    assert remote.sync_stats()["rollout/adapter_bytes"] == model.weight.numel() * model.weight.element_size()
    assert remote.sync_stats()["rollout/syncs"] == 0.0


def test_adapters_cross_in_a_narrower_compute_dtype():
    """A bf16 base: the fp32 adapters are sent rounded to bf16, half the bytes (rules/adapter_sync.py);
    integer and already-narrow tensors keep their dtype, and an fp32 base sends fp32."""
    model = torch.nn.Linear(3, 2)
    local = Colocated(settings=GrpoConfig(num_generations=2), tokenizer=_Tokenizer(), device=torch.device("cpu"),
                      distributed=False)
    link = _Link(compute_dtype=torch.bfloat16)
    remote = rollout_node.Remote(local=local, link=link)
    remote.sample(model, [{"prompt": json.dumps("a"), "columns": "{}", "prompt_ids": [5, 6]}], seed=1)
    [buffer] = link.sent[0]
    assert buffer.dtype == torch.bfloat16
    assert torch.equal(buffer, torch.cat([model.weight.reshape(-1), model.bias]).to(torch.bfloat16))
    assert remote.sync_stats()["rollout/adapter_bytes"] == 2 * (model.weight.numel() + model.bias.numel())
    assert link.synced_dtype(torch.int64) == torch.int64 and link.synced_dtype(torch.float16) == torch.float16
    assert _Link().synced_dtype(torch.float32) == torch.float32


def test_the_rollout_rank_holds_bf16_adapters_the_trainers_bf16_buffers_fill(tiny_model_dir):
    """The two ends of a bf16 base's sync agree: the rollout rank's adapters (PEFT's fp32) are cast to
    bf16 and its receive buffers are exactly the trainer's sent ones, dtype and size (half of fp32's)."""
    from homelab_ft.train.build import load_whole

    recipe = recipe_from_dict({"method": "lora", "model": {"path": str(tiny_model_dir), "dtype": "bfloat16"},
                               "lora": {"r": 4, "dropout": 0.0}}, source="test")
    rung, cpu = rung_for(recipe), torch.device("cpu")
    trainer = load_whole(recipe, model_dir=tiny_model_dir, rung=rung, device=cpu, dtype=torch.bfloat16)
    node = load_whole(recipe, model_dir=tiny_model_dir, rung=rung, device=cpu, dtype=torch.bfloat16)
    fp32 = sum(t.numel() * t.element_size() for t in rollout_node.adapter_tensors(trainer))
    assert {t.dtype for t in rollout_node.adapter_tensors(trainer)} == {torch.float32}
    link = _Link(compute_dtype=torch.bfloat16)
    local = Colocated(settings=GrpoConfig(num_generations=2), tokenizer=_Tokenizer(), device=cpu, distributed=False)
    sent = rollout_node.Remote(local=local, link=link)._changed(trainer)
    tensors, buffers = rollout_node.held_adapters(node, link, device=cpu)
    assert {t.dtype for t in tensors} == {torch.bfloat16} and all(t.requires_grad for t in tensors)
    assert [(b.dtype, b.numel()) for b in buffers] == [(b.dtype, b.numel()) for b in sent] == \
        [(torch.bfloat16, fp32 // 4)]
    for buffer, got in zip(buffers, sent, strict=True):
        buffer.copy_(got)
    unflatten_into(tensors, buffers)
    assert all(torch.equal(a, b.to(torch.bfloat16)) for a, b in
               zip(tensors, rollout_node.adapter_tensors(trainer), strict=True))


class _AheadLink(_Link):
    """A stand-in link that also takes requests ahead of their step, and logs every call in order."""

    def __init__(self):
        super().__init__()
        self.calls: list[str] = []
        self.due = None

    def request(self, ids, mask, *, seed, greedy, adapters):
        assert self.due is None, "a request while another is in flight deadlocks the real link"
        self.calls.append(f"request {seed}")
        return super().request(ids, mask, seed=seed, greedy=greedy, adapters=adapters)

    def send(self, batches, *, greedy, adapters, logps=False):
        assert self.due is None, "a request while another is in flight deadlocks the real link"
        self.sent.append(adapters)
        self.calls.append("send " + ",".join(str(b.seed) for b in batches) + (" +logps" if logps else ""))
        self.due = (batches, logps)
        return 0.0

    def collect(self):
        batches, logps = self.due
        self.due = None
        self.calls.append("collect")
        return [rollout_node.Reply(ids=torch.cat([b.ids, torch.full((b.ids.size(0), 1), 2)], dim=1),
                                   logps=torch.full((b.ids.size(0), 1), -0.5) if logps else None) for b in batches]


def test_remote_fetches_the_next_batch_ahead_and_frees_the_link_before_another_request():
    model = torch.nn.Linear(3, 2)
    settings = GrpoConfig(num_generations=2, rollout="node", max_staleness=1)
    local = Colocated(settings=settings, tokenizer=_Tokenizer(), device=torch.device("cpu"), distributed=False)
    link = _AheadLink()
    remote = rollout_node.Remote(local=local, link=link, staleness=1)
    rows = [{"prompt": json.dumps(p), "columns": "{}", "prompt_ids": ids} for p, ids in (("a", [5, 6]), ("b", [7]))]
    other = rows[:1]
    remote.prefetch(model, [rows, other], seeds=[7, 8])
    assert link.calls == ["send 7,8 +logps"] and link.due is not None  # generating while the trainer trains
    held_out = remote.sample(model, rows, seed=0, greedy=True, num_generations=1)  # an eval in between
    assert link.calls == ["send 7,8 +logps", "collect", "request 0"] and held_out.sampling_logps is None
    first = remote.sample(model, rows, seed=7)
    second = remote.sample(model, other, seed=8)
    assert link.calls[3:] == [] and remote.ahead is None  # both answered by the request sent ahead
    assert first.num_completions == 4 and second.num_completions == 2
    assert torch.equal(first.sampling_logps, torch.full((4, 1), -0.5))
    fresh = remote.sample(model, rows, seed=9)  # not fetched ahead (a step after a checkpoint): sent now, scored
    assert link.calls[3:] == ["send 9 +logps", "collect"] and fresh.sampling_logps is not None
    remote.prefetch(model, [rows], seeds=[10])
    assert remote.sample(model, other, seed=10).sampling_logps is not None  # other rows: not the batch sent ahead
    assert link.calls[5:] == ["send 10 +logps", "collect", "send 10 +logps", "collect"]


def test_staleness_is_a_rollout_node_setting():
    with pytest.raises(UserError, match="grpo.rollout=colocated generates in the training process") as err:
        recipe_from_dict({**GRPO, "grpo": {**GRPO["grpo"], "rollout": "colocated", "max_staleness": 1}})
    assert "\n" not in str(err.value)
    with pytest.raises(UserError, match="max_staleness"):
        recipe_from_dict({**GRPO, "grpo": {**GRPO["grpo"], "max_staleness": 2}})
    node = recipe_from_dict({**GRPO, "grpo": {**GRPO["grpo"], "max_staleness": 1}, "cluster": {"gpus_per_node": 2}})
    assert rung_for(node).rollout_staleness == 1
    assert rollout_node.trainer_rung(rung_for(node)).rollout_staleness == 0  # the trainer alone generates nothing
    auto = recipe_from_dict({**GRPO, "grpo": {**GRPO["grpo"], "rollout": "auto", "max_staleness": 1},
                             "cluster": {"gpus_per_node": 2}})
    assert rung_for(auto).rollout == "colocated" and rung_for(auto).rollout_staleness == 0
    with pytest.raises(RungError, match="max_staleness=1 is 0, or 1 with grpo.rollout=node"):
        Rung("lora", "no_shard", False, procs_per_node=2, rollout_staleness=1)
