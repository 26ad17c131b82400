"""The transformer blocks of any Hugging Face model, and activation checkpointing on them.

The blocks are the unit of FSDP2 wrapping, of checkpointing and of compilation; they are found from
what transformers itself declares, never from a per-family table.
"""

from __future__ import annotations

from torch import nn

from homelab_ft.errors import UserError
from homelab_ft.rules.decoder_blocks import decoder_blocks


def transformer_blocks(model: nn.Module) -> list[nn.Module]:
    """The repeated blocks (also under PEFT and FSDP2), by the rule the planner uses too
    (homelab_ft/rules/decoder_blocks.py)."""
    blocks = decoder_blocks(model)
    if not blocks:
        raise UserError(
            f"{type(model).__name__} declares no `_no_split_modules`, so its transformer blocks are "
            f"unknown; this architecture cannot be sharded with FSDP (use a LoRA/QLoRA recipe on one GPU)"
        )
    return blocks


def enable_activation_checkpointing(model: nn.Module) -> None:
    """Recompute each block's activations in backward (non-reentrant, so it composes with FSDP2).

    transformers' own switch is used rather than torch's checkpoint_wrapper: it keeps parameter
    names unchanged (checkpoints and exports stay plain HF names) and is the same code path as a
    single-device run.
    """
    target = model.get_base_model() if hasattr(model, "get_base_model") else model
    if not getattr(target, "supports_gradient_checkpointing", False):
        raise UserError(f"{type(target).__name__} does not support activation checkpointing; "
                        f"set train.activation_checkpointing=false")
    target.activation_checkpointing_enable({"use_reentrant": False})
