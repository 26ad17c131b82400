"""The optimizer and the learning-rate schedule of a run, built once from `train.*`.

One builder for every rung (the arithmetic torchtune's recipes each copied and let drift): AdamW or
bitsandbytes' 8-bit AdamW over the trainable parameters, or one optimizer per parameter stepped
inside backward (optim_backward.py), and the warmup-then-decay schedule over them.
"""

from __future__ import annotations

import functools
import math

import torch

from homelab_ft.errors import UserError
from homelab_ft.recipe.config import TrainConfig
from homelab_ft.train.optim_backward import OptimizerInBackward


def lr_factor(step: int, *, train_cfg: TrainConfig, max_steps: int) -> float:
    """Multiplier of train.lr after `step` optimizer steps of a `max_steps` run: linear warmup,
    then the decay to `min_lr_ratio` at `max_steps` (train.steps.total_steps: also for epochs)."""
    warmup = train_cfg.warmup_steps
    if step < warmup:
        return (step + 1) / (warmup + 1)
    if train_cfg.lr_schedule == "constant":
        return 1.0
    span = max(max_steps - warmup, 1)
    progress = min((step - warmup) / span, 1.0)
    floor = train_cfg.min_lr_ratio
    if train_cfg.lr_schedule == "linear":
        return floor + (1.0 - floor) * (1.0 - progress)
    return floor + (1.0 - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))


def build_optimizer(model: torch.nn.Module, train_cfg: TrainConfig) -> torch.optim.Optimizer:
    """AdamW over trainable parameters; no weight decay on biases, norms and 1-D params.

    Decaying norm gains and biases pulls them towards 0 rather than regularising (the GPT-2 /
    nanoGPT convention: decay only tensors with dim >= 2).
    """
    params = [p for p in model.parameters() if p.requires_grad]
    if not params:
        raise UserError("nothing to train: the model has no trainable parameters (check lora.target_modules)")
    if train_cfg.optimizer_in_backward:
        return OptimizerInBackward(model, make_optimizer=functools.partial(make_optimizer, train_cfg=train_cfg))
    return make_optimizer(params, train_cfg=train_cfg)


def make_optimizer(params: list[torch.nn.Parameter], *, train_cfg: TrainConfig) -> torch.optim.Optimizer:
    """The recipe's optimizer over `params` (also one parameter at a time: optim_backward.py)."""
    decay = [p for p in params if p.dim() >= 2]
    no_decay = [p for p in params if p.dim() < 2]
    groups = [
        {"params": decay, "weight_decay": train_cfg.weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    groups = [g for g in groups if g["params"]]
    if train_cfg.optimizer == "adamw":
        # torch picks the multi-tensor (foreach) kernels when every parameter is on a GPU, which
        # matters for LoRA's hundreds of small tensors, and the per-tensor loop otherwise.
        return torch.optim.AdamW(groups, lr=train_cfg.lr, betas=train_cfg.betas)
    from homelab_ft.model import quant

    return quant.make_optimizer(groups, train_cfg)


def build_scheduler(optimizer: torch.optim.Optimizer, train_cfg: TrainConfig, *, max_steps: int | None = None,
                    start_step: int = 0) -> torch.optim.lr_scheduler.LambdaLR:
    """`lr_factor` of a `max_steps` run as torch's scheduler, positioned after `start_step` steps.

    A resume builds it here rather than loading the saved scheduler state: the step is all the
    schedule needs (LambdaLR's rate is base_lr x factor(step), nothing accumulates), and the saved
    state carries the rate the old length gave, so loading it ran the first resumed step at the old
    schedule's rate (0.0 at the end of a finished cosine run) before jumping to the new one. With
    another `max_steps` the remaining steps therefore follow a run of the new length from
    `start_step`; the steps already run followed the old length and cannot (docs/recipes.md).
    `max_steps` defaults to train.max_steps; a `num_epochs` recipe passes train.steps.total_steps.
    """
    max_steps = train_cfg.max_steps if max_steps is None else max_steps
    assert max_steps is not None, "train.num_epochs: pass the run's steps (train.steps.total_steps)"
    for group in optimizer.param_groups:
        # LambdaLR's base rate; a resumed optimizer's state already holds it (train.lr is fixed on resume).
        group.setdefault("initial_lr", train_cfg.lr)
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: lr_factor(step, train_cfg=train_cfg, max_steps=max_steps), last_epoch=start_step - 1)
