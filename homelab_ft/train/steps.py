"""The arithmetic every rung shares, written once: token counts, loss normalisation, run length; and
`StepResult`, one optimizer step as the loop logs it.

torchtune's recipes each carried their own copy of this and the copies drifted (gradient
accumulation was normalised differently in different recipes); here there is one copy.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from homelab_ft.errors import UserError
from homelab_ft.labels import IGNORE_INDEX
from homelab_ft.recipe.config import TrainConfig


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


def total_steps(train_cfg: TrainConfig, *, batches_per_epoch: int) -> int:
    """The optimizer steps of the run: `train.max_steps`, or what `train.num_epochs` means.

    `batches_per_epoch` is the sampler's count of global micro-batches in one pass over the rows
    after tokenising and packing (rows // (micro_batch_size x ranks): the incomplete last one is
    dropped). Rounded up, so every row is seen at least `num_epochs` times; the sampler carries on
    into the next epoch's order for the last step's remainder.
    """
    if train_cfg.num_epochs is None:
        return train_cfg.max_steps
    # Rounded to 1e-6 first: 0.1 epoch of 30 batches is 3.0000000000000004 in floats, and 3 steps.
    return max(math.ceil(round(train_cfg.num_epochs * batches_per_epoch / train_cfg.grad_accum_steps, 6)), 1)


def check_resume_point(train_cfg: TrainConfig, *, start_step: int, max_steps: int) -> None:
    """Refuse a resume from a checkpoint past the run's length: it would train nothing and say nothing."""
    if start_step > max_steps:
        what = (f"train.num_epochs={train_cfg.num_epochs:g} ({max_steps} steps)" if train_cfg.num_epochs is not None
                else f"train.max_steps={max_steps}")
        raise UserError(f"--resume: the checkpoint is of step {start_step}, past {what}; raise it to continue, "
                        "or export the checkpoint as it is")


def length_note(train_cfg: TrainConfig, *, batches_per_epoch: int, world_size: int) -> str:
    """What the start line adds about the run's length: how `num_epochs` became steps."""
    if train_cfg.num_epochs is None:
        return ""
    processes = f"{world_size} process" + ("es" if world_size > 1 else "")
    return (f" (train.num_epochs {train_cfg.num_epochs:g} of {batches_per_epoch} micro-batches: "
            f"{train_cfg.micro_batch_size} rows x {processes} each, {train_cfg.grad_accum_steps} per step)")


@dataclass(frozen=True)
class StepResult:
    """One optimizer step as the loop logs it, all ranks together."""

    loss: float
    """The step's mean loss: per trained token (sft), per pair (dpo, with any SFT term)."""
    grad_norm: float
    """The global gradient norm before clipping."""
    lr: float
    """The learning rate the step used (the schedule has moved on to the next step's)."""
    trained_tokens: int
    """Tokens that carried loss."""
    read_tokens: int
    """Tokens the model read (tokens/s counts these)."""
    metrics: dict[str, float] = field(default_factory=dict)
    """The objective's other per-step means (dpo: preference.METRICS but the loss); empty for sft."""
    nonfinite: str | None = None
    """"loss" or "gradient norm" when that was not finite and the step was not applied (divergence.py)."""

    def row(self, *, step: int, seconds: float, epoch: int, time_s: float) -> dict:
        """The step's metrics.jsonl row; `seconds`: the step's wall time, its micro-batches' collation included."""
        return {"step": step, "loss": self.loss, "lr": self.lr, "grad_norm": self.grad_norm,
                "tokens": self.read_tokens, "trained_tokens": self.trained_tokens,
                "tokens_per_s": self.read_tokens / seconds, "epoch": epoch, "time_s": time_s, **self.metrics}
