"""The optimizer step in backward (optim_backward.py): the same training as one AdamW (sft and dpo),
no gradient left after backward, the logged norm, and its refusals (config.py and the rung check)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from homelab_ft.distributed import comm
from homelab_ft.errors import UserError
from homelab_ft.recipe.config import recipe_from_dict
from homelab_ft.rung import Rung, rung_for
from homelab_ft.train import optim
from homelab_ft.train.optim_backward import OptimizerInBackward
from homelab_ft.train.steps import IGNORE_INDEX
from homelab_ft.train.trainer import dpo_step, train_step

ENV = comm.DistEnv(0, 0, 1, 1, torch.device("cpu"), None, True)


def _llama(*, tied: bool):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=tied))


def _batches(num: int):
    g = torch.Generator().manual_seed(1)
    out = []
    for _ in range(num):
        ids = torch.randint(0, 128, (2, 17), generator=g)
        labels = ids.clone()
        labels[:, :4] = IGNORE_INDEX
        out.append({"input_ids": ids, "labels": labels})
    return out


def _pairs() -> dict:
    """Two preference pairs (chosen rows first) with cached reference log-probabilities, as a full
    fine-tune's DPO batch carries them (data.pairs.collate_pairs)."""
    ids = torch.randint(0, 128, (4, 17), generator=torch.Generator().manual_seed(2))
    labels = ids.clone()
    labels[:, :6] = IGNORE_INDEX  # the prompt the two answers share
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": labels,
            "reference_logps": torch.tensor([-55.0, -56.0, -54.0, -57.0])}


def _train(*, tied: bool, in_backward: bool, num_steps: int = 3, objective: str = "sft"):
    recipe = recipe_from_dict({"method": "full", "objective": objective, "data": {"packing": False}, "train": {
        "optimizer_in_backward": in_backward, "max_grad_norm": 0.0, "lr": 1e-2, "weight_decay": 0.1,
        "warmup_steps": 1, "max_steps": num_steps, "loss_chunk_tokens": 8}})
    model = _llama(tied=tied)
    optimizer = optim.build_optimizer(model, recipe.train)
    assert isinstance(optimizer, OptimizerInBackward) == in_backward
    s = SimpleNamespace(env=ENV, model=model, recipe=recipe, rung=rung_for(recipe), optimizer=optimizer,
                        scheduler=optim.build_scheduler(optimizer, recipe.train))
    step, batch = (dpo_step, _pairs()) if objective == "dpo" else (train_step, _batches(1)[0])
    results = []
    for _ in range(num_steps):  # the same rows every step: the loss must fall
        results.append(step(s, [batch]))
        assert all(p.grad is None for p in model.parameters())  # nothing is left for a step after backward
    # each step reports the rate it stepped with, not the next step's
    assert [r.lr for r in results] == [1e-2 * optim.lr_factor(i, train_cfg=recipe.train, max_steps=num_steps)
                                       for i in range(num_steps)]
    return model, [r.loss for r in results], [r.grad_norm for r in results], s


@pytest.mark.parametrize(("tied", "objective"), [(False, "sft"), (True, "sft"), (True, "dpo")])
def test_same_training_as_one_adamw(tied, objective):
    """dpo too: its step logs the norm the gradient hooks measured, not the 0 of no gradient left."""
    ref_model, ref_losses, ref_norms, _ = _train(tied=tied, in_backward=False, objective=objective)
    model, losses, norms, s = _train(tied=tied, in_backward=True, objective=objective)
    assert ref_losses[-1] < ref_losses[0]
    assert min(ref_norms) > 0
    assert max(abs(a - b) for a, b in zip(losses, ref_losses, strict=True)) <= 1e-6
    assert max(abs(a - b) / b for a, b in zip(norms, ref_norms, strict=True)) <= 1e-5
    for (name, p), q in zip(model.named_parameters(), ref_model.parameters(), strict=True):
        assert float((p.detach() - q.detach()).abs().max()) <= 1e-6, name
    # the scheduler drives every inner optimizer's LR
    lrs = {g["lr"] for opt in s.optimizer.optimizers for g in opt.param_groups}
    assert lrs == {s.scheduler.get_last_lr()[0]}


def test_recipe_refusals_are_one_line():
    with pytest.raises(UserError, match=r"^r: train.optimizer_in_backward .* set train.max_grad_norm=0"):
        recipe_from_dict({"train": {"optimizer_in_backward": True}}, source="r")
    with pytest.raises(UserError, match=r"set train.grad_accum_steps=1 .* instead of 4$"):
        recipe_from_dict({"train": {"optimizer_in_backward": True, "max_grad_norm": 0, "grad_accum_steps": 4}})


def test_rung_refusals():
    """The rung (rung.py) refuses what the trainer cannot run; the planner therefore never offers it."""
    bwd = {"optimizer_in_backward": True}
    Rung("full", "full_shard", False, procs_per_node=2, **bwd)
    Rung("full", "no_shard", False, **bwd)
    with pytest.raises(UserError, match="for full fine-tunes; with method=lora"):
        Rung("lora", "no_shard", False, **bwd)
    with pytest.raises(UserError, match="set sharding.strategy=full_shard"):
        Rung("full", "no_shard", False, procs_per_node=2, **bwd)
    recipe = recipe_from_dict({"train": {"optimizer_in_backward": True, "max_grad_norm": 0}})
    assert rung_for(recipe) == Rung("full", "no_shard", False, **bwd)  # auto with nothing planned: full


def test_scheduler_reaches_the_optimizers_after_a_state_load():
    """Loading a checkpoint gives the inner optimizers new group dicts; the LR must still arrive."""
    recipe = recipe_from_dict({"method": "full", "train": {"optimizer_in_backward": True, "max_grad_norm": 0.0,
                                                           "warmup_steps": 4, "lr": 1e-3}})
    model = _llama(tied=True)
    optimizer = optim.build_optimizer(model, recipe.train)
    scheduler = optim.build_scheduler(optimizer, recipe.train)
    for inner in optimizer.optimizers:
        inner.load_state_dict(inner.state_dict())
    optimizer.step()
    scheduler.step()
    assert {g["lr"] for opt in optimizer.optimizers for g in opt.param_groups} == {scheduler.get_last_lr()[0]}
    assert scheduler.get_last_lr()[0] == pytest.approx(1e-3 * 2 / 5)
