"""The arithmetic every rung shares, written once: loss normalisation, LR schedule, optimizer.

torchtune's recipes each carried their own copy of this and the copies drifted (gradient
accumulation was normalised differently in different recipes); here there is one copy.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from homelab_ft.config import TrainConfig
from homelab_ft.data.templates import IGNORE_INDEX  # the one definition: transformers' -100
from homelab_ft.errors import UserError


def trained_tokens(labels: torch.Tensor) -> int:
    """Tokens that carry loss: a label at position t is predicted from position t-1."""
    return int((labels[:, 1:] != IGNORE_INDEX).sum())


def input_tokens(batch: dict) -> int:
    """Tokens the model reads (for tokens/s). Packed batches carry no attention mask (attention
    is split by position_ids) and are >= 99% full, so every position counts."""
    if "attention_mask" in batch:
        return int(batch["attention_mask"].sum())
    return batch["input_ids"].numel()


def next_token_loss_sum(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Summed (not averaged) next-token cross-entropy over trained tokens, in fp32, from a
    model's full logits (`loss.batch_loss_sum` runs the model and never makes them all at once).

    Summing and dividing once by the global token count makes the gradient independent of how
    tokens are split over micro-batches and ranks. Averaging per micro-batch (the usual
    `loss / grad_accum`) weights a short sample's tokens more than a long one's.
    """
    shift_logits = logits[:, :-1].float()
    shift_labels = labels[:, 1:].to(shift_logits.device)
    return F.cross_entropy(
        shift_logits.reshape(-1, shift_logits.size(-1)),
        shift_labels.reshape(-1),
        ignore_index=IGNORE_INDEX,
        reduction="sum",
    )


def loss_scale(*, world_size: int, global_tokens: int) -> float:
    """Factor for each rank's summed loss so that the averaged gradient is the global token mean.

    Data-parallel engines (FSDP2, DDP) average gradients over ranks, i.e. divide by world_size;
    multiplying by world_size first cancels that, and dividing by the token count of the whole
    step (all ranks, all accumulation micro-batches) gives the mean. Doing it in the loss rather
    than through a custom divide factor matters on CPU: gloo rejects ReduceOp.PREMUL_SUM.
    """
    return world_size / max(global_tokens, 1)


def lr_factor(step: int, *, train_cfg: TrainConfig) -> float:
    """Multiplier of train.lr after `step` optimizer steps: linear warmup, then the decay."""
    warmup = train_cfg.warmup_steps
    if step < warmup:
        return (step + 1) / (warmup + 1)
    if train_cfg.lr_schedule == "constant":
        return 1.0
    span = max(train_cfg.max_steps - warmup, 1)
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
        from homelab_ft.train.optim_backward import OptimizerInBackward

        return OptimizerInBackward(model, train_cfg)
    return make_optimizer(params, train_cfg)


def make_optimizer(params: list[torch.nn.Parameter], train_cfg: TrainConfig) -> torch.optim.Optimizer:
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


def build_scheduler(optimizer: torch.optim.Optimizer, train_cfg: TrainConfig):
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_factor(step, train_cfg=train_cfg))
