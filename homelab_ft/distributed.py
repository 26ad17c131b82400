"""Process group, device mesh and the one function that parallelizes a model.

Everything that talks to `torch.distributed` lives here (and in `sharded_loading.py` for weight
loading), so the training loop reads the same on one device and on many: it calls `setup`,
`parallelize`, `all_reduce_sum`, `accumulation_sync` and `clip_grad_norm_`, and none of them does
anything when there is one process.

The engine is PyTorch's own FSDP2 (`fully_shard`) and, for adapter-only data parallelism,
`DistributedDataParallel`; no collective or sharding scheme is written by hand here.
"""

from __future__ import annotations

import contextlib
import os
import socket
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn

from homelab_ft.errors import UserError
from homelab_ft.rung import Rung

_DEFERS_SYNC = "_homelab_ft_defers_grad_sync"


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


def build_mesh(env: DistEnv, rung: Rung):
    """A 1-D mesh over all ranks, or for hybrid_shard a 2-D (replicate across nodes, shard within).

    HYBRID_SHARD keeps the per-step all-gathers on the fast links inside a node; only one gradient
    all-reduce per step crosses the (slow, homelab Ethernet) network.
    """
    from torch.distributed.device_mesh import init_device_mesh

    if rung.hybrid_enabled:
        per_node = env.world_size // env.num_nodes
        return init_device_mesh(env.device.type, (env.num_nodes, per_node), mesh_dim_names=("replicate", "shard"))
    return init_device_mesh(env.device.type, (env.world_size,), mesh_dim_names=("shard",))


def transformer_blocks(model: nn.Module) -> list[nn.Module]:
    """The repeated blocks, found by the class names in `_no_split_modules` (also under PEFT).

    transformers lists the block class there for device-map splitting (`LlamaDecoderLayer`,
    `Qwen2DecoderLayer`, `Gemma3DecoderLayer` ...), which is exactly the FSDP wrapping unit, so
    no per-architecture table is needed.
    """
    names: set[str] = set()
    for module in model.modules():
        names.update(getattr(module, "_no_split_modules", None) or ())
    # through the bases: fully_shard turns LlamaDecoderLayer into an FSDPLlamaDecoderLayer subclass
    blocks = [m for m in model.modules() if any(c.__name__ in names for c in type(m).__mro__)]
    if not blocks:
        raise UserError(
            f"{type(model).__name__} declares no `_no_split_modules`, so its transformer blocks are "
            f"unknown; this architecture cannot be sharded with FSDP (use a LoRA/QLoRA recipe on one GPU)"
        )
    return blocks


def parallelize(
    model: nn.Module,
    env: DistEnv,
    *,
    rung: Rung,
    param_dtype: torch.dtype | None = None,
    reduce_dtype: torch.dtype | None = torch.float32,
    activation_checkpointing: bool = False,
) -> nn.Module:
    """Apply activation checkpointing, then FSDP2 to every transformer block, to the model's ends
    (untied embeddings and LM head, `shard_ends`), then to the root.

    full_shard:    parameters gathered before each block and freed after it, in forward and
                   again in backward (reshard_after_forward=True): ~3 x params bytes moved per step.
    shard_grad_op: gathered weights are kept from forward to backward (False): 2 x params bytes
                   moved, more memory.
    hybrid_shard:  full_shard inside each node, replicas across nodes (2-D mesh).
    no_shard:      plain data parallelism (DistributedDataParallel) over the trainable parameters
                   only; see `_replicate` for why not FSDP.

    Gradients are averaged over ranks (FSDP's and DDP's default). The trainer therefore scales each
    rank's loss by world_size / global_trained_tokens so the average is the exact global mean; a
    custom divide factor would need ReduceOp.PREMUL_SUM, which gloo rejects.
    Returns the model to train (the same object for FSDP, a DDP wrapper for no_shard).
    """
    if activation_checkpointing:
        enable_activation_checkpointing(model)
    if not rung.fsdp_enabled:
        return _replicate(model, env, reduce_dtype=reduce_dtype)
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

    mesh = build_mesh(env, rung)
    # pin_memory needs a CUDA context; on CPU-only runs it raises, so pin only when a GPU computes.
    offload = CPUOffloadPolicy(pin_memory=env.device.type == "cuda") if rung.cpu_offload else OffloadPolicy()
    mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    reshard = rung.reshard_after_forward
    blocks = transformer_blocks(model)
    for block in blocks:
        fully_shard(block, mesh=mesh, reshard_after_forward=reshard, mp_policy=mp, offload_policy=offload)
    shard_ends(model, mesh=mesh, mp_policy=mp, offload_policy=offload)
    # The root unit keeps what is left (final norm, a tied embedding = head): needed again first in
    # backward, so freeing it after forward would only re-gather it at once (torchtitan does the same).
    fully_shard(model, mesh=mesh, reshard_after_forward=False, mp_policy=mp, offload_policy=offload)
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    total = sum(p.numel() for p in model.parameters())
    # Deferring the gradient reduce-scatter keeps a full unsharded gradient per rank until the last
    # micro-batch: 4 B/param for a full fine-tune, the very memory FULL_SHARD exists to save. For
    # adapters (typically < 2% trainable) it costs nothing worth keeping.
    defer = not rung.reshard_after_forward or trainable < 0.05 * total
    setattr(model, _DEFERS_SYNC, defer)
    return model


def shard_ends(model: nn.Module, **fsdp) -> None:
    """Untied input embeddings and LM head as FSDP2 units of their own, not in the root unit.

    In the root (reshard_after_forward=False) both stayed gathered from the first forward to the
    end of backward on every rank: 2 x 128,256 x 4,096 x 2 B = 2.1 GB for Llama-3-8B in bf16, 4.2 GB
    for Llama-3-70B. As units of their own (bench/sharded.py measures the per-rank peak):
    - embeddings: gathered for their forward and resharded after it; never gathered in backward
      (`set_unshard_in_backward(False)`: an embedding's backward reads only the token ids, so its
      gradient fills the unsharded gradient without the weight, and is reduce-scattered when
      backward ends). Only for a plain nn.Embedding: a LoRA-wrapped one needs its adapters in backward.
    - LM head: gathered from its forward until its post-backward, which FSDP2 registers on the
      head's input (the final hidden states) and so fires once, right after the loss's backward,
      before the blocks' backward (the chunked loss runs inside that call, see loss.py). Hence
      reshard_after_forward=False: resharding after forward would only re-gather it at once.
    A tied embedding is one Parameter used by both modules, and FSDP2 manages a Parameter in one
    unit: it stays in the root unit, as it must be gathered at both ends of forward and backward.
    """
    from torch.distributed.fsdp import fully_shard

    lm = model.get_base_model() if hasattr(model, "get_base_model") else model
    embed, head = lm.get_input_embeddings(), lm.get_output_embeddings()
    if embed is None or head is None:
        return
    if {id(p) for p in embed.parameters()} & {id(p) for p in head.parameters()}:
        return  # tied: stays in the root unit
    fully_shard(embed, reshard_after_forward=True, **fsdp)
    if isinstance(embed, nn.Embedding):
        embed.set_unshard_in_backward(False)
    fully_shard(head, reshard_after_forward=False, **fsdp)


def _replicate(model: nn.Module, env: DistEnv, *, reduce_dtype: torch.dtype | None = None) -> nn.Module:
    """NO_SHARD: DistributedDataParallel over the trainable parameters only.

    Chosen over FSDP2 with a replicate mesh because DDP never touches the storage of parameters
    it does not reduce: a bitsandbytes 4-bit base (`Params4bit`, uint8 storage with its quant
    state on the side) stays as it is, whereas fully_shard turns every managed parameter into a
    DTensor. Frozen parameters and buffers are excluded from DDP's initial broadcast too (every
    rank loads identical base weights from disk), so the only traffic is one all-reduce of the
    adapter gradients per step: a few MB instead of the model.
    """
    from torch.nn.parallel import DistributedDataParallel as DDP

    frozen = [name for name, p in model.named_parameters() if not p.requires_grad]
    frozen += [name for name, _ in model.named_buffers()]
    DDP._set_params_and_buffers_to_ignore_for_model(model, frozen)
    device_ids = [env.device.index] if env.device.type == "cuda" else None
    wrapped = DDP(model, device_ids=device_ids)
    # DDP all-reduces gradients in their own dtype; `sharding.reduce_dtype: bfloat16` over fp32
    # gradients (PEFT's fp32 adapters) takes torch's bf16 compression hook: half the bytes on the
    # wire, as the planner prices it. Gradients already in bf16 are reduced in bf16 either way.
    # torch 2.13 accepts the hook only with NCCL ("BF16 all reduce communication hook required
    # CUDA 11+ and NCCL 2.10+"), so on gloo gradients stay in their dtype (priced so too).
    if reduce_dtype == torch.bfloat16 and env.backend == "nccl":
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

        wrapped.register_comm_hook(state=None, hook=default_hooks.bf16_compress_hook)
    setattr(wrapped, _DEFERS_SYNC, True)
    return wrapped


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


@contextlib.contextmanager
def accumulation_sync(model: nn.Module, *, last_micro_batch: bool):
    """Around one micro-batch's forward+backward: skip the gradient sync when it can wait.

    Syncs are skipped on all but the last micro-batch for DDP, SHARD_GRAD_OP and adapters
    (see `parallelize` for why FULL_SHARD of a full fine-tune reduce-scatters every micro-batch).
    Numerically the same either way: the sum of reduced gradients equals the reduced sum.
    """
    defer = getattr(model, _DEFERS_SYNC, False) and not last_micro_batch
    if not defer:
        yield
        return
    if hasattr(model, "no_sync"):  # DDP
        with model.no_sync():
            yield
        return
    model.set_requires_gradient_sync(False)
    try:
        yield
    finally:
        model.set_requires_gradient_sync(True)


def reshard(model: nn.Module) -> None:
    """Free the weights a forward left gathered (SHARD_GRAD_OP keeps them for a backward that an
    eval pass never runs). Without it, `model.parameters()` after an eval under shard_grad_op are
    the unsharded tensors, not the ones the optimizer holds, and the next checkpoint's
    `get_optimizer_state_dict` fails with KeyError 0 (measured, torch 2.13)."""
    from torch.distributed.fsdp import FSDPModule

    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()


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
