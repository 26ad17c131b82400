"""The line between a GRPO trainer and its rollout rank (grpo.rollout=node): tensors over one process group.

Every message is a `torch.distributed.broadcast` over a group of the two ranks (the trainer, rank 0,
and the rollout rank, the last), so it runs on gloo (CPU) and NCCL (CUDA) alike and nothing is
written by hand. A request is a fixed header of int64s, then (when the adapters changed since the
last sync) the adapter tensors flattened into one buffer per dtype, then the left-padded prompt ids
and their mask; the reply is the shape of `generate`'s output, then the output ids.

The group's timeout bounds every wait: the rollout rank waits for the next request while the
trainer trains (and evaluates, and checkpoints), so the wait is the longest stretch between two
rollouts, not one collective; a trainer that dies without sending stop (killed, power lost) ends
the rollout rank's wait after `LINK_TIMEOUT_S` at the latest (gloo fails at once when the peer's
socket closes, which is the usual case).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

LINK_TIMEOUT_S = 1800.0
"""30 minutes: several GRPO steps of a 7B QLoRA on one homelab GPU (minutes each) plus a held-out
pass and a checkpoint fit between two rollouts; the world group's 300 s (comm.setup) would not."""

STOP, SAMPLE = 0, 1
_HEADER = ("command", "sync", "seed", "greedy", "rows", "width", "adapter_numel")


def flatten(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """`tensors` as one flat buffer per dtype, dtypes in the order they first appear (both sides build
    the same structure, so the same order): one collective per dtype instead of one per tensor."""
    groups: dict[torch.dtype, list[torch.Tensor]] = {}
    for t in tensors:
        groups.setdefault(t.dtype, []).append(t.detach().reshape(-1))
    return [torch.cat(parts) for parts in groups.values()]


def unflatten_into(tensors: list[torch.Tensor], buffers: list[torch.Tensor]) -> None:
    """Copy `flatten`'s buffers back into `tensors` (in place, each its own shape and device)."""
    offsets: dict[torch.dtype, int] = {}
    by_dtype = {b.dtype: b for b in buffers}
    with torch.no_grad():
        for t in tensors:
            start = offsets.get(t.dtype, 0)
            t.copy_(by_dtype[t.dtype][start:start + t.numel()].view(t.shape))
            offsets[t.dtype] = start + t.numel()


def empty_like_flat(tensors: list[torch.Tensor], *, device) -> list[torch.Tensor]:
    """Receive buffers for `flatten(tensors)`: one per dtype, in the same order."""
    sizes: dict[torch.dtype, int] = {}
    for t in tensors:
        sizes[t.dtype] = sizes.get(t.dtype, 0) + t.numel()
    return [torch.empty(n, dtype=dtype, device=device) for dtype, n in sizes.items()]


@dataclass(frozen=True)
class Request:
    """What the rollout rank received: the prompts to complete and how, and whether adapters came first."""

    seed: int
    greedy: bool
    prompt_ids: torch.Tensor
    prompt_mask: torch.Tensor
    synced: bool


@dataclass(frozen=True)
class Link:
    """Both ends of the line; `trainer` sends requests, `server` answers them."""

    group: object
    device: torch.device
    server: int
    trainer: int = 0

    @classmethod
    def open(cls, env) -> Link:
        """The two-rank group (every rank of the world calls this, as new_group requires)."""
        last = env.world_size - 1
        group = dist.new_group(ranks=[0, last], timeout=timedelta(seconds=LINK_TIMEOUT_S))
        return cls(group=group, device=env.device, server=last)

    def _cast(self, tensor: torch.Tensor, *, src: int) -> torch.Tensor:
        out = tensor.to(self.device)  # NCCL sends CUDA tensors only; gloo CPU ones
        dist.broadcast(out, src=src, group=self.group)
        return out

    def _header(self, values: list[int]) -> list[int]:
        return self._cast(torch.tensor(values, dtype=torch.int64), src=self.trainer).tolist()

    # ---- the trainer's end

    def request(self, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, *, seed: int, greedy: bool,
                adapters: list[torch.Tensor] | None) -> tuple[torch.Tensor, float]:
        """Send one request (the adapter buffers first when given) and return the rollout rank's
        `generate` output for it, on the link's device, and the seconds the adapters took to send."""
        numel = sum(b.numel() for b in adapters) if adapters is not None else 0
        self._header([SAMPLE, adapters is not None, seed, greedy, *prompt_ids.shape, numel])
        start = time.perf_counter()
        for buffer in adapters or ():
            self._cast(buffer, src=self.trainer)
        sync_s = time.perf_counter() - start if adapters is not None else 0.0
        self._cast(prompt_ids, src=self.trainer)
        self._cast(prompt_mask, src=self.trainer)
        shape = self._cast(torch.zeros(2, dtype=torch.int64), src=self.server).tolist()
        return self._cast(torch.empty(shape, dtype=torch.int64), src=self.server), sync_s

    def stop(self) -> None:
        """Tell the rollout rank to return (the trainer sends it however training ended)."""
        self._header([STOP, 0, 0, 0, 0, 0, 0])

    # ---- the rollout rank's end

    def receive(self, adapters: list[torch.Tensor]) -> Request | None:
        """Wait for the next request; None on stop. With a sync, the adapter buffers are received into
        `adapters` (empty_like_flat's, filled in place) first."""
        header = dict(zip(_HEADER, self._header([0] * len(_HEADER)), strict=True))
        if header["command"] == STOP:
            return None
        if header["sync"]:
            ours = sum(b.numel() for b in adapters)
            assert header["adapter_numel"] == ours, f"the trainer's adapters have {header['adapter_numel']} values, ours {ours}"
            for buffer in adapters:
                buffer.copy_(self._cast(buffer, src=self.trainer))
        shape = (header["rows"], header["width"])
        ids = self._cast(torch.empty(shape, dtype=torch.int64), src=self.trainer)
        mask = self._cast(torch.empty(shape, dtype=torch.int64), src=self.trainer)
        return Request(seed=header["seed"], greedy=bool(header["greedy"]), prompt_ids=ids, prompt_mask=mask,
                       synced=bool(header["sync"]))

    def reply(self, out: torch.Tensor) -> None:
        """Send `generate`'s output ids back to the trainer."""
        self._cast(torch.tensor(list(out.shape), dtype=torch.int64), src=self.server)
        self._cast(out.to(torch.int64), src=self.server)
