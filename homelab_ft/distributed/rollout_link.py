"""The line between a GRPO trainer and its rollout rank (grpo.rollout=node): tensors over one process group.

Every message is a `torch.distributed.broadcast` over a group of the two ranks (the trainer, rank 0,
and the rollout rank, the last), so it runs on gloo (CPU) and NCCL (CUDA) alike and nothing is
written by hand. A request is a fixed header of int64s, then (when the adapters changed since the
last sync) the adapter tensors flattened into one buffer per dtype, then each micro-batch's seed
and shape and its left-padded prompt ids and mask; the reply is, per micro-batch, the shape of
`generate`'s output, the output ids and (when asked: grpo.max_staleness > 0) the rollout rank's
log-probs of the completions it sampled, the behaviour policy's for truncated importance sampling.

A request is `send` and its reply `collect`: between the two the trainer is free (it trains the
step before while the rollout rank generates the next one's batch), and at most one request is in
flight (a second send while one waits would deadlock: the rollout rank's reply is a collective the
trainer must join first). `request` is the two back to back; `stop` collects a reply still due.

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
_HEADER = ("command", "sync", "greedy", "batches", "logps", "adapter_numel")


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
class Prompts:
    """One micro-batch to complete: its sampling seed and its left-padded prompt ids and mask."""

    seed: int
    ids: torch.Tensor
    mask: torch.Tensor


@dataclass(frozen=True)
class Reply:
    """One micro-batch's answer: `generate`'s output ids and, when asked, the completions' log-probs."""

    ids: torch.Tensor
    logps: torch.Tensor | None


@dataclass(frozen=True)
class Request:
    """What the rollout rank received: the micro-batches to complete and how, and whether adapters came first."""

    greedy: bool
    batches: list[Prompts]
    synced: bool
    logps: bool
    """Reply with the sampled completions' log-probs under the weights that sampled them."""


@dataclass
class Link:
    """Both ends of the line; `trainer` sends requests, `server` answers them."""

    group: object
    device: torch.device
    server: int
    trainer: int = 0
    staleness: int = 0
    """Steps ahead the trainer may send a request (the rung's rollout_staleness, grpo.max_staleness)."""
    compute_dtype: torch.dtype = torch.float32
    """The rollout rank's compute dtype: adapters wider than it cross rounded to it (rules/adapter_sync.py)."""
    due: tuple[int, bool] | None = None
    """The trainer's end: (micro-batches, with log-probs) of the request sent and not yet collected."""

    @classmethod
    def open(cls, env, *, staleness: int = 0, compute_dtype: torch.dtype = torch.float32) -> Link:
        """The two-rank group (every rank of the world calls this, as new_group requires)."""
        last = env.world_size - 1
        group = dist.new_group(ranks=[0, last], timeout=timedelta(seconds=LINK_TIMEOUT_S))
        return cls(group=group, device=env.device, server=last, staleness=staleness, compute_dtype=compute_dtype)

    def synced_dtype(self, dtype: torch.dtype) -> torch.dtype:
        """The dtype an adapter tensor of `dtype` crosses the link in, and is held in on the rollout rank."""
        from homelab_ft.rules.adapter_sync import synced_bytes

        narrower = synced_bytes(dtype.itemsize, self.compute_dtype.itemsize) < dtype.itemsize
        return self.compute_dtype if dtype.is_floating_point and narrower else dtype

    def _cast(self, tensor: torch.Tensor, *, src: int) -> torch.Tensor:
        out = tensor.to(self.device)  # NCCL sends CUDA tensors only; gloo CPU ones
        dist.broadcast(out, src=src, group=self.group)
        return out

    def _header(self, values: list[int]) -> list[int]:
        return self._cast(torch.tensor(values, dtype=torch.int64), src=self.trainer).tolist()

    # ---- the trainer's end

    def send(self, batches: list[Prompts], *, greedy: bool, adapters: list[torch.Tensor] | None,
             logps: bool = False) -> float:
        """Send one request (the adapter buffers first when given) and return the seconds the
        adapters took to send; its reply is `collect`'s. One request in flight at a time."""
        assert self.due is None, "collect the request in flight before sending another"
        numel = sum(b.numel() for b in adapters) if adapters is not None else 0
        self._header([SAMPLE, adapters is not None, greedy, len(batches), logps, numel])
        start = time.perf_counter()
        for buffer in adapters or ():
            self._cast(buffer, src=self.trainer)
        sync_s = time.perf_counter() - start if adapters is not None else 0.0
        self._cast(torch.tensor([[b.seed, *b.ids.shape] for b in batches], dtype=torch.int64), src=self.trainer)
        for b in batches:
            self._cast(b.ids, src=self.trainer)
            self._cast(b.mask, src=self.trainer)
        self.due = (len(batches), logps)
        return sync_s

    def collect(self) -> list[Reply]:
        """The rollout rank's replies to the request in flight, one per micro-batch, on the link's device."""
        assert self.due is not None, "no request in flight"
        count, logps = self.due
        self.due = None
        replies = []
        for _ in range(count):
            shape = self._cast(torch.zeros(2, dtype=torch.int64), src=self.server).tolist()
            ids = self._cast(torch.empty(shape, dtype=torch.int64), src=self.server)
            scores = None
            if logps:
                columns = int(  # the completion's columns: generate's output minus the prompt
                    self._cast(torch.zeros(1, dtype=torch.int64), src=self.server).item())
                scores = self._cast(torch.empty(shape[0], columns, dtype=torch.float32), src=self.server)
            replies.append(Reply(ids=ids, logps=scores))
        return replies

    def request(self, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, *, seed: int, greedy: bool,
                adapters: list[torch.Tensor] | None) -> tuple[torch.Tensor, float]:
        """One micro-batch sent and its output ids collected at once (the synchronous round trip),
        and the seconds the adapters took to send."""
        sync_s = self.send([Prompts(seed=seed, ids=prompt_ids, mask=prompt_mask)], greedy=greedy, adapters=adapters)
        return self.collect()[0].ids, sync_s

    def stop(self) -> None:
        """Tell the rollout rank to return (the trainer sends it however training ended), after
        collecting (and dropping) a reply still due, without which the rollout rank never listens."""
        if self.due is not None:
            self.collect()
        self._header([STOP, 0, 0, 0, 0, 0])

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
        meta = self._cast(torch.zeros(header["batches"], 3, dtype=torch.int64), src=self.trainer).tolist()
        batches = []
        for seed, rows, width in meta:
            ids = self._cast(torch.empty(rows, width, dtype=torch.int64), src=self.trainer)
            mask = self._cast(torch.empty(rows, width, dtype=torch.int64), src=self.trainer)
            batches.append(Prompts(seed=seed, ids=ids, mask=mask))
        return Request(greedy=bool(header["greedy"]), batches=batches, synced=bool(header["sync"]),
                       logps=bool(header["logps"]))

    def reply(self, out: torch.Tensor, logps: torch.Tensor | None = None) -> None:
        """Send one micro-batch's `generate` output ids back to the trainer (and its log-probs when asked)."""
        self._cast(torch.tensor(list(out.shape), dtype=torch.int64), src=self.server)
        self._cast(out.to(torch.int64), src=self.server)
        if logps is not None:
            self._cast(torch.tensor([logps.size(1)], dtype=torch.int64), src=self.server)
            self._cast(logps.float(), src=self.server)
