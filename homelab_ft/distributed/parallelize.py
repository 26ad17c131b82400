"""The one function that parallelizes a model: a device mesh, FSDP2 per block and for the ends,
or DDP for adapters.

The engine is PyTorch's own FSDP2 (`fully_shard`) and, for adapter-only data parallelism,
`DistributedDataParallel`; no sharding scheme is written by hand here.
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn

from homelab_ft.distributed.comm import DistEnv
from homelab_ft.model.blocks import transformer_blocks
from homelab_ft.rung import DEFER_SYNC_TRAINABLE_FRACTION, Rung

_DEFERS_SYNC = "_homelab_ft_defers_grad_sync"


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


def parallelize(
    model: nn.Module,
    env: DistEnv,
    *,
    rung: Rung,
    param_dtype: torch.dtype | None = None,
    reduce_dtype: torch.dtype | None = torch.float32,
) -> nn.Module:
    """FSDP2 to every transformer block, to the model's ends (untied embeddings and LM head,
    `shard_ends`), then to the root; activation checkpointing is on already (torchtitan's order:
    checkpoint wrapping first, so FSDP2's per-block hooks see the recomputed forward).

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
    # micro-batch: worth it only for adapters (rung.DEFER_SYNC_TRAINABLE_FRACTION says why).
    defer = not rung.reshard_after_forward or trainable < DEFER_SYNC_TRAINABLE_FRACTION * total
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
