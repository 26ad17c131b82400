"""Activation offload (offload.py): the checkpointed block inputs are what it moves, and training
with it is the same training."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from homelab_ft.errors import UserError
from homelab_ft.recipe.config import recipe_from_dict
from homelab_ft.rung import rung_for
from homelab_ft.train import loss
from homelab_ft.train.offload import MIN_OFFLOAD_BYTES, activations_on_host

CONFIGS = Path(__file__).resolve().parents[2] / "configs"


def _llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=3,
                                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True))
    model.activation_checkpointing_enable({"use_reentrant": False})
    return model.train()


def _loss_and_grads(model, batch, *, offload: bool):
    model.zero_grad(set_to_none=True)
    with activations_on_host(enabled=offload, pin_memory=False):
        summed = loss.batch_loss_sum(model, batch, device=torch.device("cpu"), chunk_tokens=64)
    summed.backward()
    return float(summed.detach()), {n: p.grad.clone() for n, p in model.named_parameters()}


def test_offload_moves_the_checkpointed_block_inputs_and_changes_nothing(monkeypatch):
    model = _llama()
    ids = torch.randint(0, 256, (4, 600), generator=torch.Generator().manual_seed(0))
    batch = {"input_ids": ids, "labels": ids}
    block_input_bytes = 4 * 600 * 128 * 4
    assert block_input_bytes >= MIN_OFFLOAD_BYTES
    moved = []
    real_empty = torch.empty

    def counting_empty(*args, **kwargs):
        out = real_empty(*args, **kwargs)
        moved.append(out.numel() * out.element_size())
        return out

    want_loss, want = _loss_and_grads(model, batch, offload=False)
    monkeypatch.setattr("homelab_ft.train.offload.torch.empty", counting_empty)
    got_loss, got = _loss_and_grads(model, batch, offload=True)
    # each of the 3 checkpointed blocks saved its input; nothing else that big is saved outside them
    assert moved.count(block_input_bytes) >= 3
    assert got_loss == want_loss
    for name, grad in want.items():
        assert torch.equal(got[name], grad), name


def test_offload_needs_checkpointing():
    with pytest.raises(UserError, match="set train.activation_checkpointing=true as well"):
        recipe_from_dict({"train": {"activation_offload": True, "activation_checkpointing": False}})
    recipe_from_dict({"train": {"activation_offload": True, "activation_checkpointing": True}})
    # left to `auto`, checkpointing comes with the offload that needs it
    assert rung_for(recipe_from_dict({"method": "lora", "train": {"activation_offload": True}})).activation_checkpointing


def test_host_ram_the_run_keeps_is_checked_against_what_is_available():
    """Activation offload's block inputs and a host-side embedding table (train.embedding_offload),
    over the node's ranks: refused in one line naming each part and its switch when short."""
    from homelab_ft.errors import UserError
    from homelab_ft.train.preflight import check_host_ram

    with pytest.raises(UserError, match=r"keeps the checkpointed block inputs \(train.activation_offload\) 3.0 GiB in "
                                        "host RAM on this node, but only 1.0 GiB is available; set "
                                        "train.activation_offload=false"):
        check_host_ram(device_type="cuda", offloaded_bytes=3 * 2**30, available_bytes=2**30)
    with pytest.raises(UserError, match=r"3.0 GiB \+ the input embedding table \(train.embedding_offload\) 1.0 GiB .* "
                                        "only 3.5 GiB is available; set train.activation_offload=false or "
                                        "train.embedding_offload=false"):
        check_host_ram(device_type="cuda", offloaded_bytes=3 * 2**30, table_bytes=2**30, available_bytes=int(3.5 * 2**30))
    check_host_ram(device_type="cuda", offloaded_bytes=2**30, table_bytes=2**30, available_bytes=3 * 2**30)
    check_host_ram(device_type="cpu", offloaded_bytes=3 * 2**30, available_bytes=2**30)  # nothing offloads


def test_train_checks_the_host_embedding_table_before_launching(monkeypatch):
    """`train` asks check_host_ram with the plan's table (Qwen2.5-7B LoRA on one 24 GB GPU keeps its
    1.0 GiB input embedding table in host RAM under embedding_offload: auto)."""
    from homelab_ft import host
    from homelab_ft.cli import train
    from homelab_ft.distributed import comm
    from homelab_ft.errors import UserError
    from homelab_ft.plan.planner import plan_for_recipe
    from homelab_ft.recipe.config import recipe_from_dict

    recipe = recipe_from_dict({"method": "lora", "model": {"path": str(CONFIGS / "qwen2.5-7b.json")},
                               "train": {"device": "cuda"}, "cluster": {"gpus_per_node": 1, "vram_gib": 24,
                                                                        "host_ram_gib": 64}})
    plan = plan_for_recipe(recipe)
    monkeypatch.setattr(comm, "device_type", lambda name: "cuda")  # this machine has no GPU; the check is the same
    monkeypatch.setattr(host, "available_ram_bytes", lambda: 2**29)
    with pytest.raises(UserError, match=r"the input embedding table \(train.embedding_offload\) 1.0 GiB"):
        train._check_this_machine(recipe, plan=plan, rung=plan.chosen.rung)
    monkeypatch.setattr(host, "available_ram_bytes", lambda: 8 * 2**30)
    train._check_this_machine(recipe, plan=plan, rung=plan.chosen.rung)
