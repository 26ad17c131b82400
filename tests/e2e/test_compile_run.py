"""`train.compile` against eager on CPU: the trainer's own step (train_step) for a few steps of a
tiny Llama, compiled and not, gives the same losses, gradients and weights to 1e-4, for LoRA with
activation checkpointing and for a full fine-tune; compiling keeps every parameter name.

Compiling is the cost here (inductor runs g++ per kernel: ~25 s per distinct graph on this 2-core
machine with an empty cache, seconds once /tmp/torchinductor_$USER holds it), so each model is
compiled once and serves every assertion, shapes are fixed (micro-batches of one length, loss
chunks of one size: one graph each) and dropout is 0 (inductor draws its own random numbers).
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from homelab_ft import compiling, distributed, steps
from homelab_ft.config import recipe_from_dict
from homelab_ft.loss import token_loss_sum
from homelab_ft.rung import rung_for
from homelab_ft.steps import IGNORE_INDEX
from homelab_ft.trainer import build_model, train_step

ENV = distributed.DistEnv(0, 0, 1, 1, torch.device("cpu"), None, True)
TOL = 1e-4
NUM_STEPS = 3
# 2 rows x 24 tokens, the first label masked: 2 x 23 trained positions, 2 loss chunks of 23 (the
# shapes of tests/distributed/test_compile_fsdp.py, so inductor's cache serves one test from the other)
SEQ, MASKED, CHUNK = 24, 1, 23


def _batches(vocab: int) -> list[dict]:
    g = torch.Generator().manual_seed(1)
    out = []
    for _ in range(NUM_STEPS + 1):
        ids = torch.randint(0, vocab, (2, SEQ), generator=g)
        labels = ids.clone()
        labels[:, :MASKED] = IGNORE_INDEX
        out.append({"input_ids": ids, "labels": labels, "attention_mask": torch.ones_like(ids)})
    return out


def _run(model_dir, *, method: str, compile: bool, checkpointing: bool) -> dict:
    """The first micro-batch's gradients, then NUM_STEPS optimizer steps through train_step."""
    recipe = recipe_from_dict({
        "method": method, "model": {"path": str(model_dir), "dtype": "float32"},
        "lora": {"r": 4, "alpha": 8, "dropout": 0.0},
        "train": {"lr": 1e-2 if method == "lora" else 1e-3, "max_steps": NUM_STEPS, "warmup_steps": 0,
                  "loss_chunk_tokens": CHUNK, "activation_checkpointing": checkpointing, "compile": compile,
                  "device": "cpu"}})
    torch.manual_seed(0)
    model = build_model(recipe, model_dir=model_dir, rung=rung_for(recipe), env=ENV)
    names = [name for name, _ in model.named_parameters()]
    if compile:
        assert compiling.compile_blocks(model) == model.config.num_hidden_layers
    assert [name for name, _ in model.named_parameters()] == names  # checkpoints and exports unchanged
    batches = _batches(model.config.vocab_size)
    model.train()
    first = token_loss_sum(model, batches[0], device=ENV.device, chunk_tokens=CHUNK, compiled=compile)
    first.backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    optimizer = steps.build_optimizer(model, recipe.train)
    s = SimpleNamespace(env=ENV, model=model, recipe=recipe, optimizer=optimizer,
                        scheduler=steps.build_scheduler(optimizer, recipe.train))
    losses = [float(train_step(s, [mb])[0]) for mb in batches[1:]]
    trained = {name: p.detach().clone() for name, p in model.named_parameters() if p.requires_grad}
    return {"first": float(first), "grads": grads, "losses": losses, "weights": trained,
            "state_keys": sorted(model.state_dict())}


def _max_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys() and a
    return max(float((a[k] - b[k]).abs().max()) for k in a)


@pytest.mark.parametrize(("method", "checkpointing"), [("lora", True), ("full", False)])
def test_compiled_training_matches_eager(tiny_model_dir, method, checkpointing):
    eager = _run(tiny_model_dir, method=method, compile=False, checkpointing=checkpointing)
    compiled = _run(tiny_model_dir, method=method, compile=True, checkpointing=checkpointing)
    assert compiled["state_keys"] == eager["state_keys"]
    assert abs(compiled["first"] - eager["first"]) <= TOL
    assert _max_diff(compiled["grads"], eager["grads"]) <= TOL
    assert max(abs(x - y) for x, y in zip(compiled["losses"], eager["losses"], strict=True)) <= TOL
    assert _max_diff(compiled["weights"], eager["weights"]) <= TOL
    assert eager["losses"][-1] < eager["first"]  # it trains, so the comparison compares something
