"""Which process this is, for the store's collective steps (hashing a checkpoint's files over all
ranks, gathering what each wrote). One process without a process group is rank 0 of 1, and so is a
process that works `alone()` inside a larger job (grpo.rollout=node's trainer, whose peer is a
rollout rank that holds no checkpoint and joins none of these collectives)."""

from __future__ import annotations

import contextlib

import torch.distributed as dist

_alone = False


@contextlib.contextmanager
def alone():
    """The store's steps run as one process inside this block, whatever process group exists."""
    global _alone
    before, _alone = _alone, True
    try:
        yield
    finally:
        _alone = before


def is_alone() -> bool:
    return _alone


def _grouped() -> bool:
    return not _alone and dist.is_available() and dist.is_initialized()


def barrier() -> None:
    if _grouped():
        dist.barrier()


def rank() -> int:
    return dist.get_rank() if _grouped() else 0


def world_size() -> int:
    return dist.get_world_size() if _grouped() else 1


def all_gather(obj) -> list:
    if world_size() == 1:
        return [obj]
    out = [None] * world_size()
    dist.all_gather_object(out, obj)
    return out
