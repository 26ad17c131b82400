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

import build_recipe
import pytest
import torch
from torch._dynamo.utils import counters

from homelab_ft.distributed import comm
from homelab_ft.model import compiling
from homelab_ft.plan.planner import recipe_shape
from homelab_ft.recipe.config import recipe_from_dict
from homelab_ft.rung import rung_for
from homelab_ft.train import optim
from homelab_ft.train.build import build_model
from homelab_ft.train.loss import batch_loss_sum
from homelab_ft.train.steps import IGNORE_INDEX
from homelab_ft.train.trainer import train_step

ENV = comm.DistEnv(0, 0, 1, 1, torch.device("cpu"), None, True)
TOL = 1e-4
NUM_STEPS = 3
# 2 rows x 24 tokens, the first label masked: 2 x 23 trained positions, 2 loss chunks of 23 (the
# shapes of tests/distributed/test_compile_fsdp.py, so inductor's cache serves one test from the other)
SEQ, MASKED, CHUNK = 24, 1, 23


def _batches(vocab: int, lengths: list[int]) -> list[dict]:
    g = torch.Generator().manual_seed(1)
    out = []
    for length in lengths:
        ids = torch.randint(0, vocab, (2, length), generator=g)
        labels = ids.clone()
        labels[:, :MASKED] = IGNORE_INDEX
        out.append({"input_ids": ids, "labels": labels, "attention_mask": torch.ones_like(ids)})
    return out


def _run(model_dir, *, method: str, compile: bool, checkpointing: bool,
         lengths: tuple[int, ...] = (SEQ,) * (NUM_STEPS + 1), train: dict | None = None) -> dict:
    """The first micro-batch's gradients, then NUM_STEPS optimizer steps through train_step."""
    recipe = recipe_from_dict(build_recipe.tiny_run(
        model_dir, method=method, model={"dtype": "float32"}, data=None, output=None,
        train={"micro_batch_size": None, "lr": 1e-2 if method == "lora" else 1e-3, "max_steps": NUM_STEPS,
               "warmup_steps": 0, "loss_chunk_tokens": CHUNK, "activation_checkpointing": checkpointing,
               "compile": compile, **(train or {})}))
    torch.manual_seed(0)
    model = build_model(recipe, model_dir=model_dir, facts=recipe_shape(recipe)[0].facts, rung=rung_for(recipe), env=ENV)
    names = [name for name, _ in model.named_parameters()]
    if compile:
        assert compiling.compile_blocks(model) == model.config.num_hidden_layers
    assert [name for name, _ in model.named_parameters()] == names  # checkpoints and exports unchanged
    batches = _batches(model.config.vocab_size, list(lengths))
    model.train()
    first = batch_loss_sum(model, batches[0], device=ENV.device, chunk_tokens=CHUNK, compiled=compile)
    first.backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    optimizer = optim.build_optimizer(model, recipe.train)
    s = SimpleNamespace(env=ENV, model=model, recipe=recipe, rung=rung_for(recipe), optimizer=optimizer,
                        scheduler=optim.build_scheduler(optimizer, recipe.train))
    losses = [train_step(s, [mb]).loss for mb in batches[1:]]
    trained = {name: p.detach().clone() for name, p in model.named_parameters() if p.requires_grad}
    return {"first": first.item(), "grads": grads, "losses": losses, "weights": trained,
            "state_keys": sorted(model.state_dict())}


def _max_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys() and a
    return max(float((a[k] - b[k]).abs().max()) for k in a)


# The full fine-tune also steps in backward: each parameter's gradient hook fires on what the
# compiled backward hands autograd. (Same block graph as without it: inductor's cache serves it.)
IN_BACKWARD = {"optimizer_in_backward": True, "max_grad_norm": 0.0}


# slow (make test-all): 15 s; make test keeps the compiled FSDP2 LoRA step against eager (tests/distributed/test_compile_fsdp.py, aot_eager)
@pytest.mark.slow
@pytest.mark.parametrize(("method", "checkpointing", "train"),
                         [("lora", True, {}), ("full", False, {}), ("full", False, IN_BACKWARD)],
                         ids=["lora-checkpointing", "full", "full-optimizer-in-backward"])
def test_compiled_training_matches_eager(tiny_model_dir, method, checkpointing, train):
    eager = _run(tiny_model_dir, method=method, compile=False, checkpointing=checkpointing, train=train)
    compiled = _run(tiny_model_dir, method=method, compile=True, checkpointing=checkpointing, train=train)
    assert compiled["state_keys"] == eager["state_keys"]
    assert abs(compiled["first"] - eager["first"]) <= TOL
    assert _max_diff(compiled["grads"], eager["grads"]) <= TOL
    assert max(abs(x - y) for x, y in zip(compiled["losses"], eager["losses"], strict=True)) <= TOL
    assert _max_diff(compiled["weights"], eager["weights"]) <= TOL
    assert eager["losses"][-1] < eager["first"]  # it trains, so the comparison compares something
    assert counters["stats"]["unique_graphs"] >= 2  # blocks and loss ran compiled (this process, so far)


@pytest.mark.slow
def test_changing_lengths_match_eager(tiny_model_dir):
    """What real runs do: each micro-batch is padded to its own longest row, so the second length
    compiles the blocks and the loss once more with symbolic shapes, which then serve every other
    length (and the loss chunks' changing sizes). Slow: ~2-3 min more of compiling on 2 cores."""
    lengths = (24, 17, 31, 20, 26)
    eager = _run(tiny_model_dir, method="lora", compile=False, checkpointing=True, lengths=lengths)
    compiled = _run(tiny_model_dir, method="lora", compile=True, checkpointing=True, lengths=lengths)
    assert abs(compiled["first"] - eager["first"]) <= TOL
    assert max(abs(x - y) for x, y in zip(compiled["losses"], eager["losses"], strict=True)) <= TOL
    assert _max_diff(compiled["weights"], eager["weights"]) <= TOL
