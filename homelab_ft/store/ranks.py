"""Which process this is, for the store's collective steps (hashing a checkpoint's files over all
ranks, gathering what each wrote). One process without a process group is rank 0 of 1."""

from __future__ import annotations

import torch.distributed as dist


def barrier() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.barrier()


def rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def world_size() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def all_gather(obj) -> list:
    if world_size() == 1:
        return [obj]
    out = [None] * world_size()
    dist.all_gather_object(out, obj)
    return out
