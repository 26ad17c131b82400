"""Build a sharded model without a full copy of the weights on every rank.

The order (torchtitan's): build the architecture on the meta device (no memory), apply
activation checkpointing and FSDP2 (`distributed.parallelize`), allocate only this rank's shards
(`to_empty`), then fill them (`build_sharded`, which takes where the weights come from as a typed
source). Two ways to fill them here, and a 4-bit one in sharded_qlora.py:

- `FromSafetensors`: each rank reads only its slices of the model's safetensors, the tensors found
  through transformers' own key conversion (model/checkpoint_keys.py: a released MoE's per-expert
  tensors, Nemotron-H's `backbone.*`, a multimodal checkpoint's `model.language_model.*`); nobody
  holds the whole model (what a 70B model needs), at most one converted parameter whole. Adapter
  weights that the base checkpoint lacks are initialised the PEFT way on CPU, identically on
  every rank, and sliced into the shards.
- `FromRank0`: rank 0 loads the whole model the ordinary way (`from_pretrained`, then LoRA with
  the run's seed) and broadcasts it into the shards (`set_model_state_dict(broadcast_from_rank0)`).
  Host RAM on rank 0 must hold the model once, but the result is bit-identical to a one-process
  run, adapters included, which the parity tests rely on.

`to_empty` also wipes buffers that are not in any state dict (rotary `inv_freq`): they are built
on CPU with real values (only parameters go to meta) and copied back afterwards, otherwise the
logits drift silently. Building under `meta_parameters` also unties tied weights (LM head =
embedding); `tie_weights` ties them again before sharding.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import torch
from torch import nn

from homelab_ft.distributed.comm import DistEnv
from homelab_ft.distributed.parallelize import parallelize
from homelab_ft.errors import UserError
from homelab_ft.model import loading
from homelab_ft.model.blocks import enable_activation_checkpointing
from homelab_ft.model.checkpoint_keys import CheckpointKeys, base_name, is_adapter
from homelab_ft.rung import Rung


@contextlib.contextmanager
def meta_parameters():
    """Create parameters on the meta device and buffers for real (accelerate's init_empty_weights)."""
    from accelerate import init_empty_weights

    with init_empty_weights(include_buffers=False):
        yield


@dataclass(frozen=True)
class FromRank0:
    """Rank 0 loads the whole model the ordinary way and broadcasts it into the shards.

    `load_full` (called on rank 0 only) returns the model with its weights and adapters, e.g.
    `from_pretrained` + `get_peft_model` under the run's seed: the shards then hold exactly what a
    one-process run trains, adapters included.
    """

    load_full: Callable[[], nn.Module]

    def fill(self, model: nn.Module, env: DistEnv) -> None:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

        full = self.load_full().state_dict() if env.rank == 0 else {}
        set_model_state_dict(model, full, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))


@dataclass(frozen=True)
class FromSafetensors:
    """Each rank reads its slices of the base weights from `model_dir`'s HF safetensors
    (`checkpoint_keys.CheckpointKeys`); adapters the base lacks get `loading.initial_adapters(seed=adapter_seed)`."""

    model_dir: Path
    adapter_seed: int = 0

    def fill(self, model: nn.Module, env: DistEnv) -> None:
        _fill_from_hf(model, Path(self.model_dir), seed=self.adapter_seed)


class WeightSource(Protocol):
    """Where a sharded model's weights come from: `fill` writes them into this rank's shards
    (FromRank0, FromSafetensors, sharded_qlora.FromSafetensors4bit)."""

    def fill(self, model: nn.Module, env: DistEnv) -> None: ...


def build_sharded(
    env: DistEnv,
    *,
    build: Callable[[], nn.Module],
    source: WeightSource,
    rung: Rung,
    param_dtype: torch.dtype | None = None,
    reduce_dtype: torch.dtype | None = torch.float32,
    activation_checkpointing: bool = False,
) -> nn.Module:
    """Build on meta, activation checkpointing, FSDP2 (a rung that does not shard: none, the whole
    model is this rank's), allocate this rank's shards, then fill.

    `build` returns the architecture and its adapters without weights, e.g. `from_config` +
    `get_peft_model`, run under `meta_parameters`; the global generator is put back after it, so
    FromRank0's `load_full` draws the adapters a one-process run draws. `source` fills the shards.
    """
    rng = torch.get_rng_state()
    with meta_parameters():
        model = build()
    torch.set_rng_state(rng)
    tie_weights(model)
    buffers = {name: buf.detach().clone() for name, buf in model.named_buffers()}
    if any(buf.is_meta for buf in buffers.values()):
        raise AssertionError("buffers must be real: build the model under meta_parameters(), not torch.device('meta')")
    if activation_checkpointing:
        enable_activation_checkpointing(model)
    if rung.fsdp_enabled:  # else filled whole, and replicated (if at all) by the caller once filled
        model = parallelize(model, env, rung=rung, param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    model.to_empty(device=torch.device("cpu") if rung.cpu_offload else env.device)
    restore_buffers(model, buffers)
    source.fill(model, env)
    return model


def copy_into_shard(param: torch.Tensor, full: torch.Tensor) -> None:
    """Copy this rank's part of `full` (on any device) into `param` (a DTensor shard, or plain).

    The slice is cut where `full` lies (the host, when read from disk) with the chunking FSDP2
    and DTensor use for `Shard(dim)` (torch.chunk; ranks past the last chunk hold nothing), and
    only the slice moves to the shard's device: no rank ever puts a whole tensor on its GPU, and
    nothing is communicated (every rank read the same `full`).
    """
    from torch.distributed.tensor import DTensor

    with torch.no_grad():
        if not isinstance(param, DTensor):
            param.copy_(full)
            return
        local = full
        for mesh_dim, placement in enumerate(param.placements):
            if placement.is_shard():
                num, index = param.device_mesh.size(mesh_dim), param.device_mesh.get_local_rank(mesh_dim)
                chunks = torch.chunk(local, num, dim=placement.dim)
                local = chunks[index] if index < len(chunks) else local.narrow(placement.dim, 0, 0)
        param.to_local().copy_(local)


def tie_weights(model: nn.Module) -> None:
    """Re-tie shared weights (LM head = input embedding) of a model built under `meta_parameters`.

    accelerate's `init_empty_weights` wraps `register_parameter` so that it stores a *new*
    Parameter moved to meta; transformers ties the head by `setattr(lm_head, "weight",
    embed_tokens.weight)`, which goes through that wrapper, so the two names end up with two
    separate meta tensors (measured with transformers 5.24 / accelerate 1.15). Sharded and loaded
    as such, the head has no weight in the checkpoint (a tied model stores only the embedding), is
    left as `to_empty` garbage, and SmolLM2-135M started at loss ln(49152) = 10.8 instead of 0.6.
    Tying again outside the context makes both names one Parameter, which FSDP2 shards once (both
    modules sit in the root unit, outside every transformer block) and the loader fills once.
    """
    target = model.get_base_model() if hasattr(model, "get_base_model") else model
    if hasattr(target, "tie_weights"):
        target.tie_weights()


def _shared_parameter_names(model: nn.Module) -> list[list[str]]:
    """Every parameter's names, one list per distinct Parameter (a tied one has several)."""
    inner = model.module if hasattr(model, "no_sync") else model
    names: dict[int, list[str]] = {}
    for name, param in inner.named_parameters(remove_duplicate=False):
        names.setdefault(id(param), []).append(name)
    return list(names.values())


def restore_buffers(model: nn.Module, buffers: dict[str, torch.Tensor]) -> None:
    inner = model.module if hasattr(model, "no_sync") else model  # DDP prefixes names with module.
    for name, buf in inner.named_buffers():
        if name in buffers:
            buf.copy_(buffers[name].to(buf.device))


def _fill_from_hf(model: nn.Module, model_dir: Path, *, seed: int) -> None:
    """Each rank reads its slices of the base weights through transformers' key conversion
    (model/checkpoint_keys.py: per-expert tensors stacked, `backbone.*` and
    `model.language_model.*` renamed); adapters get PEFT's init on CPU."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    keys = CheckpointKeys(model, model_dir)
    targets = _fill_targets(model, available=keys.names(), model_dir=model_dir)
    with torch.no_grad():
        for name, tensor in keys.tensors(list(targets), shards=targets):
            _copy_local(targets[name], tensor, name=name)
    adapters = loading.initial_adapters(model, seed=seed)
    if adapters:  # full-size tensors on every rank: each keeps its slice
        set_model_state_dict(model, adapters, options=StateDictOptions(full_state_dict=True, strict=False))


def _fill_targets(model: nn.Module, *, available: set[str], model_dir: Path) -> dict[str, torch.Tensor]:
    """Checkpoint-facing name -> the parameter (or persistent buffer) it fills, each tensor once.

    A tied parameter is read once, under whichever of its names the checkpoint has (a tied model's
    file usually holds only the embedding; some hold both, equal). A base tensor none of whose
    names the checkpoint provides is an error, never left as to_empty's uninitialised memory.
    """
    inner = model.module if hasattr(model, "no_sync") else model
    state = inner.state_dict(keep_vars=True)
    groups = _shared_parameter_names(model)
    grouped = {n for names in groups for n in names}
    groups += [[key] for key in state if key not in grouped]  # persistent buffers
    targets = {}
    for names in groups:
        pairs = [(n, base_name(n)) for n in names if not is_adapter(n) and n in state]
        present = [(n, b) for n, b in pairs if b in available]
        if pairs and not present:
            raise UserError(f"{model_dir} has no weight for {pairs[0][1]} (nor does transformers' key mapping find "
                            "one); is it the checkpoint of this architecture?")
        if present:
            targets[present[0][1]] = state[present[0][0]]
    return targets


def _copy_local(param: torch.Tensor, tensor: torch.Tensor, *, name: str) -> None:
    """Write a tensor read by `CheckpointKeys.tensors` (already this rank's shard for a DTensor) in place."""
    from torch.distributed.tensor import DTensor

    local = param.to_local() if isinstance(param, DTensor) else param
    if tuple(local.shape) != tuple(tensor.shape):
        raise UserError(f"checkpoint tensor {name} has shape {tuple(tensor.shape)} where the model's config wants "
                        f"{tuple(local.shape)}; is config.json the one these weights were saved with?")
    local.copy_(tensor.to(local.dtype))
