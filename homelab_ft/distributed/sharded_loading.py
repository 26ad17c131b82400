"""Build a sharded model without a full copy of the weights on every rank.

The order (torchtitan's): build the architecture on the meta device (no memory), apply
activation checkpointing and FSDP2 (`distributed.parallelize`), allocate only this rank's shards
(`to_empty`), then fill them. Two ways to fill them:

- `from_hf`: each rank reads only its slices of the model's safetensors through DCP's
  `HuggingFaceStorageReader`; nobody holds the whole model (what a 70B model needs). Adapter
  weights that the base checkpoint lacks are initialised the PEFT way on CPU, identically on
  every rank, and sliced into the shards.
- `from_rank0`: rank 0 loads the whole model the ordinary way (`from_pretrained`, then LoRA with
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
from pathlib import Path

import torch
from torch import nn

from homelab_ft.distributed.comm import DistEnv
from homelab_ft.distributed.parallelize import parallelize
from homelab_ft.errors import UserError


@contextlib.contextmanager
def meta_parameters():
    """Create parameters on the meta device and buffers for real (accelerate's init_empty_weights)."""
    from accelerate import init_empty_weights

    with init_empty_weights(include_buffers=False):
        yield


def build_sharded(
    env: DistEnv,
    *,
    build: Callable[[], nn.Module],
    load_full: Callable[[], nn.Module] | None = None,
    model_dir: Path | None = None,
    adapter_seed: int = 0,
    **parallel,
) -> nn.Module:
    """Build with `build()` on meta, `parallelize(**parallel)`, then load the weights.

    `build` returns the architecture (and adapters) without weights, e.g. `from_config` +
    `get_peft_model`. Exactly one of `load_full` (rank-0 broadcast; called on rank 0 only) and
    `model_dir` (per-rank reads of HF safetensors) says where the weights come from.
    """
    if (load_full is None) == (model_dir is None):
        raise ValueError("pass exactly one of load_full and model_dir")
    rng = torch.get_rng_state()  # building must not shift the seed that rank 0's load_full uses
    with meta_parameters():
        model = build()
    torch.set_rng_state(rng)
    tie_weights(model)
    buffers = {name: buf.detach().clone() for name, buf in model.named_buffers()}
    if any(buf.is_meta for buf in buffers.values()):
        raise AssertionError("buffers must be real: build the model under meta_parameters(), not torch.device('meta')")
    model = parallelize(model, env, **parallel)
    device = torch.device("cpu") if parallel["rung"].cpu_offload else env.device
    model.to_empty(device=device)
    _restore_buffers(model, buffers)
    if load_full is not None:
        _fill_from_rank0(model, env, load_full)
    else:
        _fill_from_hf(model, Path(model_dir), seed=adapter_seed)
    return model


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


def _restore_buffers(model: nn.Module, buffers: dict[str, torch.Tensor]) -> None:
    inner = model.module if hasattr(model, "no_sync") else model  # DDP prefixes names with module.
    for name, buf in inner.named_buffers():
        if name in buffers:
            buf.copy_(buffers[name].to(buf.device))


def _fill_from_rank0(model: nn.Module, env: DistEnv, load_full: Callable[[], nn.Module]) -> None:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    full = {}
    if env.rank == 0:
        full = load_full().state_dict()
    options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
    set_model_state_dict(model, full, options=options)


def _fill_from_hf(model: nn.Module, model_dir: Path, *, seed: int) -> None:
    """Each rank reads its slices of the base weights; adapters get PEFT's init on CPU."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import HuggingFaceStorageReader
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        set_model_state_dict,
    )

    reader = HuggingFaceStorageReader(str(model_dir))
    on_disk = set(reader.read_metadata().state_dict_metadata)
    state = get_model_state_dict(model)
    # A tied parameter is read once, under whichever of its names the file has (a tied model's
    # file usually holds only `model.embed_tokens.weight`; some hold both, equal). A parameter
    # none of whose names is on disk is an error, never left as to_empty's uninitialised memory.
    groups = [[n for n in names if n in state] for names in _shared_parameter_names(model)]
    grouped = {n for names in groups for n in names}
    groups += [[key] for key in state if key not in grouped]  # persistent buffers
    wanted, source = {}, {}
    for names in filter(None, groups):
        present = [n for n in names if hf_name(n) in on_disk]
        if present:
            wanted[hf_name(present[0])] = state[present[0]]
            source[present[0]] = hf_name(present[0])
        elif not all(_is_adapter(n) for n in names):
            raise UserError(f"{model_dir} has no weight {hf_name(names[0])}; is it the checkpoint of this architecture?")
    dcp.load(wanted, storage_reader=HuggingFaceStorageReader(str(model_dir)))
    loaded = {key: wanted[hf_key] for key, hf_key in source.items()}
    set_model_state_dict(model, loaded, options=StateDictOptions(strict=False))
    adapters = _adapter_init(model, seed=seed)
    if adapters:  # full-size tensors on every rank: each keeps its slice
        set_model_state_dict(model, adapters, options=StateDictOptions(full_state_dict=True, strict=False))


def hf_name(key: str) -> str:
    """A PEFT parameter name -> the base checkpoint's name (`base_model.model.` and `.base_layer`)."""
    return key.removeprefix("base_model.model.").replace(".base_layer.", ".")


def _is_adapter(key: str) -> bool:
    return ".lora_" in key


def _adapter_init(model: nn.Module, *, seed: int) -> dict[str, torch.Tensor]:
    """Full-size adapter tensors from PEFT's own `reset_lora_parameters`, the same on every rank.

    A sharded parameter cannot be initialised in place reproducibly (each rank would draw the
    same random numbers for its own slice, repeating rows). Instead every rank builds each
    adapter at full size on CPU from one seed and `set_model_state_dict` keeps its slice.
    The adapters are small (r x hidden per layer), so this costs megabytes.
    """
    import copy

    out: dict[str, torch.Tensor] = {}
    generator_state = torch.get_rng_state()
    torch.manual_seed(seed)
    for name, module in model.named_modules():
        if not hasattr(module, "reset_lora_parameters") or not hasattr(module, "lora_A"):
            continue
        for adapter in list(module.lora_A.keys()):
            if getattr(module, "use_dora", {}).get(adapter, False):
                raise UserError("lora.use_dora needs the base weights to initialise; it is not supported "
                                "with per-rank sharded loading; set lora.use_dora=false")
            originals = {part: getattr(module, part)[adapter] for part in ("lora_A", "lora_B")}
            for part, layer in originals.items():
                # A CPU twin with full-size parameters (a DTensor's .shape is the global shape).
                twin = copy.copy(layer)
                twin._parameters = {
                    k: nn.Parameter(torch.empty(p.shape, dtype=p.dtype)) for k, p in layer._parameters.items() if p is not None
                }
                getattr(module, part)[adapter] = twin
            try:
                module.reset_lora_parameters(adapter, True)
                prefix = f"{name}." if name else ""
                for part in originals:
                    for pname, param in getattr(module, part)[adapter]._parameters.items():
                        out[f"{prefix}{part}.{adapter}.{pname}"] = param.detach()
            finally:
                for part, layer in originals.items():
                    getattr(module, part)[adapter] = layer
    torch.set_rng_state(generator_state)
    return out
