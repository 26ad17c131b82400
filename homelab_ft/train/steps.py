"""The arithmetic every rung shares, written once: token counts and loss normalisation.

torchtune's recipes each carried their own copy of this and the copies drifted (gradient
accumulation was normalised differently in different recipes); here there is one copy.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from homelab_ft.data.templates import IGNORE_INDEX  # the one definition: transformers' -100


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
