"""The optimizer and its schedule (train/optim.py): the learning-rate schedule, the optimizer built over the trainable parameters, and checkpoint pruning past keep_last."""

from __future__ import annotations

import math

import pytest
import torch

from homelab_ft.recipe.config import TrainConfig
from homelab_ft.store import checkpoint
from homelab_ft.train import optim


@pytest.mark.parametrize("schedule", ["cosine", "linear", "constant"])
def test_warmup_then_decay_to_the_floor(schedule):
    cfg = TrainConfig(max_steps=10, warmup_steps=2, lr_schedule=schedule, min_lr_ratio=0.1)
    factors = [optim.lr_factor(s, train_cfg=cfg, max_steps=10) for s in range(11)]
    assert factors[:2] == [pytest.approx(1 / 3), pytest.approx(2 / 3)]  # linear warmup, never 0
    assert factors[2] == pytest.approx(1.0)
    if schedule == "constant":
        assert all(f == 1.0 for f in factors[2:])
        return
    assert factors[10] == pytest.approx(0.1)  # the floor at max_steps
    assert all(a >= b for a, b in zip(factors[2:], factors[3:], strict=False))  # monotone decay
    middle = optim.lr_factor(6, train_cfg=cfg, max_steps=10)  # halfway through the decay
    expected = 0.1 + 0.9 * (0.5 if schedule == "linear" else 0.5 * (1 + math.cos(math.pi * 0.5)))
    assert middle == pytest.approx(expected)


def test_the_scheduler_gives_each_step_its_own_rate():
    cfg = TrainConfig(max_steps=4, lr=1.0, lr_schedule="linear")
    model = torch.nn.Linear(2, 2)
    optimizer = optim.build_optimizer(model, cfg)
    scheduler = optim.build_scheduler(optimizer, cfg)
    used = []
    for _ in range(cfg.max_steps):
        used.append(scheduler.get_last_lr()[0])  # what the trainer logs for the step it is about to take
        optimizer.step()
        scheduler.step()
    assert used == pytest.approx([1.0, 0.75, 0.5, 0.25])  # the last step trains at 0.25, not 0


def test_a_resumed_scheduler_starts_at_its_step_of_the_new_length():
    # Resuming after 10 steps with max_steps=15 builds the schedule of a 15-step run positioned at
    # step 10: the optimizer's restored rate (the 10-step run's last, 0 here) is not used again.
    cfg = TrainConfig(max_steps=15, lr=1.0, lr_schedule="linear")
    optimizer = optim.build_optimizer(torch.nn.Linear(2, 2), cfg)
    for group in optimizer.param_groups:
        group["lr"] = 0.0  # what a finished 10-step linear run leaves in the optimizer state
    scheduler = optim.build_scheduler(optimizer, cfg, start_step=10)
    used = []
    for _ in range(5):
        used.append(scheduler.get_last_lr()[0])
        assert optimizer.param_groups[0]["lr"] == used[-1]  # the rate the step really uses
        optimizer.step()
        scheduler.step()
    assert used == pytest.approx([5 / 15, 4 / 15, 3 / 15, 2 / 15, 1 / 15])


def test_pruning_keeps_the_newest_complete_checkpoints(tmp_path):
    model = torch.nn.Linear(3, 2)
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.ones(1, 3)).sum().backward()
    optimizer.step()
    for step in range(1, 6):
        state = checkpoint.TrainerState(step=step, scheduler={}, sampler={}, model_fingerprint="m", world_size=1)
        checkpoint.save(tmp_path, model=model, optimizer=optimizer, state=state, keep_last=2)
    # a half-written one (no trainer_state.json) is neither counted nor picked
    (checkpoint.checkpoints_dir(tmp_path) / "step_000009").mkdir()
    names = sorted(p.name for p in checkpoint.checkpoints_dir(tmp_path).iterdir() if p.name.startswith("step_"))
    assert names == ["step_000004", "step_000005", "step_000009"]
    assert checkpoint.latest(tmp_path).name == "step_000005"
