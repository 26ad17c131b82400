"""Disk space for checkpoints: what one costs (pure, priced by the planner) and whether the run
directory's disk holds the `keep_last + 1` of them a run needs at its fullest (the new one is
written before the oldest is pruned).

A checkpoint holds the trainable parameters and their AdamW state (checkpoint.py), plus for
adapters a safetensors copy that export reads: 16 bytes per adapter parameter, 6 per parameter of
a full fine-tune in bf16 (2 of weight + 4 of AdamW state). `homelab-ft plan` prints 0.4 GiB for
recipes/llama3-8b-qlora-24gb.yaml and 6.9 GiB for the full Llama-3.2-1B of
recipes/llama-1b-full-2x24gb.yaml. DCP adds a few hundred bytes per tensor, and `.metadata`.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import TYPE_CHECKING

from homelab_ft.plan.inputs import Cluster, PlanRequest
from homelab_ft.plan.price.params import optimizer_bytes_per_param, weight_bytes

if TYPE_CHECKING:
    from homelab_ft.plan.ladder import Option


def checkpoint_bytes(option: Option, *, request: PlanRequest, cluster: Cluster) -> int:
    """Bytes of one checkpoint on disk, all ranks' files together (pure)."""
    if not option.rung.adapters_enabled:
        param_bytes, adapter_copy = weight_bytes(request, cluster), 0
    else:
        param_bytes, adapter_copy = 4, 4  # PEFT keeps adapters in fp32 (memory.estimate)
    per_param = param_bytes + optimizer_bytes_per_param(request, param_bytes) + adapter_copy
    return int(option.trainable_params * per_param)


def space_warning(ckpts: Path, *, checkpoint_bytes: int, keep_last: int) -> str | None:
    """A one-line warning when the disk of the run's checkpoints folder (`RunDir.checkpoints`,
    named by the caller: plan imports nothing outside itself) cannot hold keep_last + 1 checkpoints
    (counting the space this run's own checkpoints already take); None when it can."""
    ckpts = Path(ckpts).resolve()
    existing = ckpts
    while not existing.exists():
        existing = existing.parent
    free = shutil.disk_usage(existing).free
    own = sum(p.stat().st_size for p in ckpts.rglob("*") if p.is_file()) if ckpts.is_dir() else 0
    need = (keep_last + 1) * checkpoint_bytes
    if free + own >= need:
        return None
    return (f"{existing} has {free / 2**30:.1f} GiB free but {keep_last + 1} checkpoints of about "
            f"{checkpoint_bytes / 2**30:.2f} GiB (train.keep_last={keep_last}, + the one being written) need "
            f"{need / 2**30:.1f} GiB; a save will fail (the previous checkpoint is kept). Free space, lower "
            "train.keep_last, or choose another --run-dir")
