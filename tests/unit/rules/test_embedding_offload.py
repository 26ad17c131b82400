"""train.embedding_offload: one rule for planner and trainer (homelab_ft/rules/embedding_offload.py), the
hooked host lookup bit-identical to the plain one on the CPU, and the refusals of `true`."""

from __future__ import annotations

import copy
import itertools
import json

import pytest
import torch
from families import tiny_config

from homelab_ft.errors import UserError
from homelab_ft.plan.inputs import Cluster
from homelab_ft.plan.planner import default_request, plan
from homelab_ft.plan.price import params
from homelab_ft.plan.shape.shapes import model_shape
from homelab_ft.recipe.config import recipe_from_dict
from homelab_ft.rules import embedding_offload
from homelab_ft.rung import Rung, RungError
from homelab_ft.train import host_embedding

GiB = 1 << 30
RUNGS = {
    "qlora": Rung(method="qlora", strategy="no_shard", cpu_offload=False),
    "lora": Rung(method="lora", strategy="no_shard", cpu_offload=False),
    "lora ddp": Rung(method="lora", strategy="no_shard", cpu_offload=False, procs_per_node=2),
    "full": Rung(method="full", strategy="no_shard", cpu_offload=False),
    "lora fsdp": Rung(method="lora", strategy="full_shard", cpu_offload=False, procs_per_node=2),
    "lora offload": Rung(method="lora", strategy="full_shard", cpu_offload=True),
    "lora pipeline": Rung(method="lora", strategy="no_shard", cpu_offload=False, procs_per_node=2, pipeline_stages=2),
}
TARGETS = {"all-linear": "all-linear", "q,v": ["q_proj", "v_proj"], "embed": ["embed_tokens", "q_proj"]}


@pytest.fixture(autouse=True)
def _own_cache(tmp_path_factory, monkeypatch):
    monkeypatch.setenv("HOMELAB_FT_CACHE", str(tmp_path_factory.getbasetemp() / "shape-cache"))


def _model_and_shape(tied: bool):
    from transformers import AutoModelForCausalLM

    config = tiny_config("llama", tie_word_embeddings=tied)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32), model_shape(config.to_dict())


def _cluster(device: str) -> Cluster:
    return Cluster(device=device, nodes=1, gpus_per_node=1, device_bytes=24 * GiB, host_ram_bytes=64 * GiB)


def _outcome(call, **kwargs):
    try:
        return call(**kwargs)
    except RungError:
        return "refused"


@pytest.mark.parametrize("tied", [False, True])
def test_the_rule_sets_the_rung_field_that_pricing_and_trainer_read(tied):
    """Every rung x targets x device x setting: `placed` decides `Rung.embedding_offload` once (or
    refuses `true`), the pricing puts the table in host RAM exactly where the field says, and a rung
    the field is set on cannot be built where the rule refuses it."""
    model, shape = _model_and_shape(tied)
    assert shape.embedding_name == "model.embed_tokens" and shape.tie_word_embeddings == tied
    # the trainer decides on the facts the plan hands it, which are the built model's
    embed, facts = model.get_input_embeddings(), shape.facts
    assert facts.tied_embeddings == (model.get_output_embeddings().weight is embed.weight)
    assert facts.embedding_name == next(n for n, m in model.named_modules() if m is embed)
    seen = set()
    for (rung_name, rung), (tname, targets), device, setting in itertools.product(
            RUNGS.items(), TARGETS.items(), ("cuda", "cpu"), ("auto", True, False)):
        request = default_request(lora={"target_modules": targets}, train={"embedding_offload": setting})  # method: the rung's
        built = _outcome(embedding_offload.placed, rung=rung, setting=setting, targets=request.lora.targets,
                         embedding_name=facts.embedding_name, tied=facts.tied_embeddings, device_type=device)
        kept = built if built == "refused" else built.embedding_offload
        if built != "refused":
            priced = params.host_embedding_bytes(shape, rung=built, request=request, cluster=_cluster(device))
            assert (priced > 0) == kept == (priced == shape.vocab_size * shape.hidden_size * 2), (rung_name, tname)

        seen.add(kept)
        applies = (not tied and tname != "embed" and device == "cuda" and rung_name in ("qlora", "lora", "lora ddp"))
        assert kept == (applies if setting == "auto" else False if setting is False else applies or "refused")
    assert seen == ({False, "refused"} if tied else {True, False, "refused"})


def test_priced_bytes_and_copy():
    """Device weights lose the table (vocab x hidden x 2 B in bf16), host RAM gains it, and the step
    pays one tokens x hidden copy per micro-batch."""
    from homelab_ft.plan.ladder import option_rung
    from homelab_ft.plan.price.memory import estimate

    _, shape = _model_and_shape(False)
    on = default_request(method="lora", train={"embedding_offload": "auto", "grad_accum_steps": 4})
    off = default_request(method="lora", train={"embedding_offload": False, "grad_accum_steps": 4})
    cuda = _cluster("cuda")
    kept, plain = (option_rung("lora", "no_shard", False, request=r, cluster=cuda, shape=shape) for r in (on, off))
    assert kept.embedding_offload and not plain.embedding_offload  # the ladder decides it where it builds the rung
    a, b = estimate(shape, rung=kept, request=on, cluster=cuda), estimate(shape, rung=plain, request=off, cluster=cuda)
    table = shape.vocab_size * shape.hidden_size * 2
    assert b.memory.weights - a.memory.weights == table == a.host_bytes - b.host_bytes
    from homelab_ft.plan.price.network import OFFLOAD_BYTES_PER_S

    rows = 4 * on.data.max_length * on.train.micro_batch_size * shape.hidden_size * 2
    assert a.offload_s - b.offload_s == pytest.approx(rows / OFFLOAD_BYTES_PER_S)


def test_true_refused_in_one_line():
    with pytest.raises(UserError, match="train.embedding_offload=true: method=full"):
        recipe_from_dict({"method": "full", "train": {"embedding_offload": True}})
    with pytest.raises(UserError, match="sharding.strategy=full_shard shards"):
        recipe_from_dict({"cluster": {"gpus_per_node": 2}, "sharding": {"strategy": "full_shard"},
                          "train": {"embedding_offload": True}})
    recipe_from_dict({"sharding": {"strategy": "full_shard"}, "train": {"embedding_offload": True}})  # 1 GPU: no_shard
    _, tied = _model_and_shape(True)
    with pytest.raises(UserError, match="tied to the LM head"):
        plan(tied, request=default_request(method="lora", train={"embedding_offload": True}), cluster=_cluster("cuda"))
    _, untied = _model_and_shape(False)
    with pytest.raises(UserError, match="no GPU memory to save"):
        plan(untied, request=default_request(method="lora", train={"embedding_offload": True}), cluster=_cluster("cpu"))
    # method auto: `true` keeps the ladder to the adapter rungs
    chosen = plan(untied, request=default_request(train={"embedding_offload": True}), cluster=_cluster("cuda")).chosen
    assert chosen.method in ("qlora", "lora") and chosen.host_bytes > 0


def test_host_lookup_is_bit_identical_on_cpu():
    """LoRA with activation checkpointing: loss and every adapter gradient equal with the table
    hooked (ids to the host, rows back) and without; the rows the blocks get require grad (the
    checkpointing hook runs after ours), the module keeps its name and the first parameter is
    no longer the table (PreTrainedModel.device)."""
    from homelab_ft.model import loading
    from homelab_ft.model.blocks import enable_activation_checkpointing
    from homelab_ft.recipe.config import LoraConfig
    from homelab_ft.train.loss import batch_loss_sum

    base, _ = _model_and_shape(False)
    plain = loading.attach_lora(base, LoraConfig(r=4, alpha=8, dropout=0.0))
    for p in plain.parameters():
        if p.requires_grad:
            torch.nn.init.normal_(p, std=0.02)  # lora_B is zero: give the gradients something to differ by
    hooked = copy.deepcopy(plain)
    lm = hooked.get_base_model()
    names = [n for n, _ in hooked.named_parameters()]
    host_embedding.keep_on_host(lm, lm.get_input_embeddings(), device=torch.device("cpu"))
    assert sorted(n for n, _ in hooked.named_parameters()) == sorted(names)
    assert next(lm.parameters()) is not lm.get_input_embeddings().weight
    batch = {"input_ids": torch.randint(0, 320, (2, 24)), "attention_mask": torch.ones(2, 24, dtype=torch.long)}
    batch["labels"] = batch["input_ids"].clone()
    results = []
    for model in (plain, hooked):
        enable_activation_checkpointing(model)
        model.train()
        rows = model.get_base_model().get_input_embeddings()(batch["input_ids"])
        assert rows.requires_grad
        loss = batch_loss_sum(model, batch, device=torch.device("cpu"), chunk_tokens="auto")
        loss.backward()
        results.append((loss.detach(), {n: p.grad for n, p in model.named_parameters() if p.requires_grad}))
    (loss_a, grads_a), (loss_b, grads_b) = results
    assert torch.equal(loss_a, loss_b)
    assert grads_a.keys() == grads_b.keys() and all(torch.equal(grads_a[n], grads_b[n]) for n in grads_a)
    out = hooked.generate(input_ids=batch["input_ids"][:1, :4], max_new_tokens=3, do_sample=False)
    assert torch.equal(out, plain.generate(input_ids=batch["input_ids"][:1, :4], max_new_tokens=3, do_sample=False))


def test_shape_records_the_embedding_name():
    _, shape = _model_and_shape(False)
    assert json.loads(json.dumps(shape.to_dict()))["embedding_name"] == "model.embed_tokens"
