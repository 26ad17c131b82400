"""The process group and the few collectives the loop needs.

Everything that talks to `torch.distributed` directly lives here (and in `parallelize.py`,
`sharded_loading.py`), so the training loop reads the same on one device and on many: it calls
`setup`, `all_reduce_sum` and `clip_grad_norm_`, and none of them does anything when there is one
process. No collective is written by hand: each is one `torch.distributed` call.
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn

from homelab_ft.errors import UserError
from homelab_ft.rung import Rung


@dataclass(frozen=True)
class DistEnv:
    """Where this process sits in the job. One process without torchrun: rank 0 of 1."""

    rank: int
    local_rank: int
    world_size: int
    num_nodes: int
    device: torch.device
    backend: str | None
    """`nccl` on CUDA, `gloo` on CPU, None when no process group was created."""
    is_main: bool
    """Rank 0: the only rank that logs, writes metrics and prints."""

    @property
    def distributed(self) -> bool:
        return self.backend is not None


def _env_int(name: str) -> int | None:
    value = os.environ.get(name)
    return int(value) if value not in (None, "") else None


def device_type(pref: str) -> str:
    """`train.device` resolved: cuda when asked (refused without a GPU) or, with `auto`, available."""
    if pref == "cuda" and not torch.cuda.is_available():
        raise UserError("train.device=cuda but torch sees no CUDA GPU; use train.device=cpu or auto")
    return "cuda" if pref == "cuda" or (pref == "auto" and torch.cuda.is_available()) else "cpu"


def setup(*, device_pref: str = "auto", timeout_s: float = 300.0) -> DistEnv:
    """Read torchrun's environment and create the process group (gloo on CPU, NCCL on CUDA).

    Without torchrun's variables this is a single process: no process group, world size 1.
    `timeout_s` bounds both the rendezvous and every later collective, so an unreachable master
    address ends in a UserError instead of a silent hang.
    """
    world_size = _env_int("WORLD_SIZE") or 1
    rank = _env_int("RANK") or 0
    local_rank = _env_int("LOCAL_RANK") or 0
    local_world = _env_int("LOCAL_WORLD_SIZE") or world_size
    use_cuda = device_type(device_pref) == "cuda"
    if use_cuda:
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    if world_size == 1 and not os.environ.get("TORCHELASTIC_RUN_ID"):
        return DistEnv(0, 0, 1, 1, device, None, True)
    if world_size % local_world:
        raise UserError(f"WORLD_SIZE={world_size} is not a multiple of LOCAL_WORLD_SIZE={local_world}")
    backend = "nccl" if use_cuda else "gloo"
    addr, port = os.environ.get("MASTER_ADDR", "?"), os.environ.get("MASTER_PORT", "?")
    try:
        dist.init_process_group(
            backend,
            rank=rank,
            world_size=world_size,
            timeout=timedelta(seconds=timeout_s),
            device_id=device if use_cuda else None,
        )
        # The first collective proves every rank is there; init alone can return before peers join.
        dist.barrier()
    except (RuntimeError, dist.DistError, TimeoutError) as err:
        first = str(err).strip().splitlines()[0][:200] if str(err).strip() else type(err).__name__
        raise UserError(
            f"rank {rank} could not join the process group at {addr}:{port} within {timeout_s:.0f} s "
            f"({first}); check that every node runs the same command, that the address is reachable "
            f"and the port is open (see docs/multi-node.md)"
        ) from None
    return DistEnv(rank, local_rank, world_size, world_size // local_world, device, backend, rank == 0)


def teardown(env: DistEnv) -> None:
    """Destroy the process group. The caller should then leave with `os._exit(code)`.

    With torch 2.13 on CPU, FSDP2 processes sometimes abort at interpreter exit after
    `destroy_process_group()` ("terminate called without an active exception", measured here),
    turning a finished run into a non-zero exit. `exit_now` below flushes and skips that teardown.
    """
    if env.distributed and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


def exit_now(code: int) -> None:
    """Flush stdio and leave without running interpreter finalizers (see `teardown`)."""
    import sys

    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def check_job(env: DistEnv, rung: Rung) -> None:
    """The job torchrun started against the rung the plan decided (same world size and nodes)."""
    if env.world_size != rung.world_size:
        raise UserError(
            f"torchrun started {env.world_size} processes but the recipe's cluster says "
            f"{rung.nodes} node(s) x {rung.procs_per_node} = {rung.world_size}; fix cluster.nodes / "
            f"cluster.gpus_per_node or the torchrun --nnodes/--nproc-per-node flags"
        )
    if rung.hybrid_enabled and env.num_nodes != rung.nodes:
        raise UserError(
            f"sharding.strategy=hybrid_shard over cluster.nodes={rung.nodes}, but torchrun placed the "
            f"{env.world_size} ranks on {env.num_nodes} node(s); start one torchrun per node (homelab-ft launch)"
        )


def all_reduce_sum(value: float | int | torch.Tensor, env: DistEnv) -> float:
    """Sum a number over ranks (the global trained-token count); identity on one process."""
    tensor = torch.as_tensor(value, dtype=torch.float64).reshape(())
    if not env.distributed:
        return float(tensor)
    # NCCL reduces only CUDA tensors; gloo only CPU ones.
    tensor = tensor.to(env.device)
    dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
    return float(tensor.cpu())


def all_reduce_max(value: int, env: DistEnv) -> int:
    """The largest of one integer over ranks (a stop request: 0, or a signal's number)."""
    if not env.distributed:
        return int(value)
    tensor = torch.tensor(int(value), dtype=torch.int64, device=env.device)
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    return int(tensor.cpu())


def all_reduce_sum_tensor(tensor: torch.Tensor, env: DistEnv) -> torch.Tensor:
    """Sum a tensor over ranks (per-step metric sums, reference log-probabilities); a copy on one process."""
    if not env.distributed:
        return tensor.clone()
    out = tensor.to(env.device, copy=True)  # NCCL reduces only CUDA tensors; gloo only CPU ones
    dist.all_reduce(out, op=dist.ReduceOp.SUM)
    return out.to(tensor.device)


def clip_grad_norm_(model: nn.Module, max_norm: float, env: DistEnv) -> float:
    """Clip the global gradient norm (over all ranks' shards); returns the norm before clipping.

    torch's get_total_norm gives, for sharded DTensor gradients, a DTensor whose value is still
    partial per rank; `full_tensor()` reduces it over the mesh (HSDP: over the shard dimension
    only; replicas hold equal gradients). With CPU offload on CUDA the local gradients sit in host
    memory while NCCL reduces only device tensors, so the partial norm is moved to the device first.
    `max_norm <= 0` only measures.
    """
    from torch.distributed.tensor import DTensor

    params = [p for p in model.parameters() if p.grad is not None]
    if not params:
        return 0.0
    grads = [p.grad for p in params]
    total = torch.nn.utils.get_total_norm(grads, norm_type=2.0, foreach=None)
    if isinstance(total, DTensor):
        local = total.to_local()
        if local.device.type != total.device_mesh.device_type:
            local = local.to(env.device)
            total = DTensor.from_local(local, total.device_mesh, total.placements, run_check=False)
        total = total.full_tensor()
    if max_norm > 0:
        torch.nn.utils.clip_grads_with_norm_(params, max_norm, total.to(grads[0].device), foreach=None)
    return float(total)


def free_port() -> int:
    """An unused TCP port on this machine (for a standalone torchrun's rendezvous)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def barrier(env: DistEnv) -> None:
    """Wait for every rank (no-op on one process)."""
    if env.distributed:
        dist.barrier()
