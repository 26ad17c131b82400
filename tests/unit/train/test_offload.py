"""Activation offload (offload.py): the checkpointed block inputs are what it moves, and training
with it is the same training."""

from __future__ import annotations

import pytest
import torch

from homelab_ft.errors import UserError
from homelab_ft.recipe.config import recipe_from_dict
from homelab_ft.rung import rung_for
from homelab_ft.train import loss
from homelab_ft.train.offload import MIN_OFFLOAD_BYTES, activations_on_host


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


def test_activation_offload_without_host_ram_to_spare_is_refused():
    from homelab_ft.errors import UserError
    from homelab_ft.rung import Rung
    from homelab_ft.train.preflight import check_activation_offload

    rung = Rung("lora", "no_shard", False, activation_checkpointing=True, activation_offload=True)
    with pytest.raises(UserError, match="need 3.0 GiB of host RAM on this node, but only 1.0 GiB is available; set "
                                        "train.activation_offload=false"):
        check_activation_offload(rung, device_type="cuda", offloaded_bytes=3 * 2**30, available_bytes=2**30)
    check_activation_offload(rung, device_type="cuda", offloaded_bytes=2**30, available_bytes=3 * 2**30)
    check_activation_offload(rung, device_type="cpu", offloaded_bytes=3 * 2**30, available_bytes=2**30)  # nothing offloads
