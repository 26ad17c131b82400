"""A sharded (DCP) checkpoint of a full fine-tune -> a Hugging Face model directory.

The checkpoint holds every rank's shards in DCP's own format (`checkpoint.py` writes
`{"model": ..., "optim": ...}` with `dcp.save`). We read it back one output file at a time: for
each group of tensors that fits in `max_shard_bytes`, DCP assembles the full tensors from
whichever rank files hold their pieces, we write that group as one safetensors file and drop it.
Peak memory is one output file (5 GiB by default, the Hub's usual shard size), never the model,
and no process group is needed, so export runs on any one machine and any number of ranks'
checkpoints.

The files are written in the base checkpoint's own layout, as `save_pretrained` writes a model
loaded from it (a released MoE's per-expert tensors, Nemotron-H's `backbone.*`, an image-text
base's `model.language_model.*`): transformers' reverse conversion, asked through
model/checkpoint_keys.py, so the folder loads with from_pretrained and reads like the base to
llama.cpp's converters. A converter's tensors (a layer's experts) go into one file together.

torch 2.13's `HuggingFaceStorageWriter(save_distributed=True, enable_consolidation=True)` and
`consolidate_safetensors_files` do the same for checkpoints *saved* in HF format; ours are in DCP
format because they also carry the optimizer state for resuming, so we read with DCP's planner.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

from homelab_ft import fsio
from homelab_ft.errors import UserError
from homelab_ft.model import checkpoint_keys
from homelab_ft.rules import vision

MODEL_PREFIX = "model."
"""Keys of the model's entries in the checkpoint's state dict (the optimizer's start `optim.`)."""

_WEIGHT_FILES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")
_INDEX = "model.safetensors.index.json"


def _state_dir(checkpoint_dir: Path) -> Path:
    checkpoint_dir = Path(checkpoint_dir)
    for candidate in (checkpoint_dir / "state", checkpoint_dir):
        if (candidate / ".metadata").is_file():
            return candidate
    raise UserError(f"{checkpoint_dir} is not a sharded checkpoint (no state/.metadata); pass a checkpoints/step_* directory")


def model_tensors(checkpoint_dir: Path) -> dict[str, tuple[torch.Size, torch.dtype]]:
    """HF name -> (shape, dtype) of every model tensor in the checkpoint, from its metadata only."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    from homelab_ft.store.dcp_metadata import SafeFileSystemReader

    metadata = SafeFileSystemReader(str(_state_dir(checkpoint_dir))).read_metadata()
    out = {}
    for key, item in metadata.state_dict_metadata.items():
        if key.startswith(MODEL_PREFIX) and isinstance(item, TensorStorageMetadata):
            out[key.removeprefix(MODEL_PREFIX)] = (item.size, item.properties.dtype)
    return out


def load_weights(checkpoint_dir: Path, model: torch.nn.Module) -> None:
    """The checkpoint's weights read into `model` (its base, loaded from the base config) in place, by
    DCP without a process group: `homelab-ft chat` talks to a full fine-tune without an export."""
    import torch.distributed.checkpoint as dcp

    from homelab_ft.store.dcp_metadata import SafeFileSystemReader

    tensors = model_tensors(checkpoint_dir)
    if any(".lora_" in name for name in tensors):
        raise UserError(f"{checkpoint_dir} is a LoRA checkpoint (adapters only); apply its adapter instead")
    state = model.state_dict()
    unknown = sorted(set(tensors) - set(state))[:3]
    if not tensors or unknown:
        raise UserError(f"the checkpoint's weights do not match the model (unexpected {unknown}); "
                        "use the model it was trained from")
    buffers = {MODEL_PREFIX + name: state[name] for name in tensors}  # the parameters' own storage
    dcp.load(buffers, storage_reader=SafeFileSystemReader(str(_state_dir(checkpoint_dir))), no_dist=True)


def consolidate_to_hf(
    checkpoint_dir: Path,
    base_model_dir: Path,
    out_dir: Path,
    *,
    dtype: torch.dtype | None = None,
    max_shard_bytes: int = 5 * 2**30,
    images: bool = False,
) -> float:
    """Write the checkpoint's weights as HF safetensors plus the base's config and tokenizer.

    `dtype`: the weights' dtype on disk (default: as trained). Returns the largest absolute
    difference between each tensor read back from the written files and the checkpoint's (0.0
    unless a cast to `dtype` rounds), after checking that the names and shapes are exactly those
    the base config's architecture expects (`images`: the image-text model an image run built), so
    the directory loads with `from_pretrained`.
    """
    import torch.distributed.checkpoint as dcp
    from safetensors.torch import save_file

    from homelab_ft.store.dcp_metadata import SafeFileSystemReader

    state_dir = _state_dir(checkpoint_dir)
    tensors = model_tensors(checkpoint_dir)
    if not tensors:
        raise UserError(f"{checkpoint_dir} holds no model weights")
    if any(".lora_" in name for name in tensors):
        raise UserError(f"{checkpoint_dir} is a LoRA checkpoint (adapters only); export it with the adapter merge")
    keys, from_base = _check_against_base(Path(base_model_dir), state_dir, tensors, images=images)
    groups = _group(tensors, dtype=dtype, max_shard_bytes=max_shard_bytes, unit=keys.unit)

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    for stale in out_dir.glob("model*.safetensors"):
        stale.unlink()  # idempotent re-export with another shard count
    (out_dir / _INDEX).unlink(missing_ok=True)
    weight_map, total_bytes, max_diff = {}, 0, 0.0
    for number, names in enumerate(groups, start=1):
        file_name = "model.safetensors" if len(groups) == 1 else f"model-{number:05d}-of-{len(groups):05d}.safetensors"
        buffers = {MODEL_PREFIX + n: torch.empty(tensors[n][0], dtype=tensors[n][1]) for n in names}
        dcp.load(buffers, storage_reader=SafeFileSystemReader(str(state_dir)), no_dist=True)
        base = dict(keys.tensors(from_base)) if number == 1 else {}
        saved = keys.as_saved({**{n: buffers[MODEL_PREFIX + n] for n in names}, **base})
        out = {n: _cast(t, dtype).contiguous() for n, t in saved.items()}
        save_file(out, str(out_dir / file_name), metadata={"format": "pt"})
        fsio.as_folder_files(out_dir / file_name)
        max_diff = max(max_diff, _read_back_diff(out_dir / file_name, saved))
        for n, t in out.items():
            weight_map[n] = file_name
            total_bytes += t.numel() * t.element_size()
        del buffers, out
    if len(groups) > 1:
        index = {"metadata": {"total_size": total_bytes}, "weight_map": dict(sorted(weight_map.items()))}
        (out_dir / _INDEX).write_text(json.dumps(index, indent=2))
    _copy_model_files(Path(base_model_dir), out_dir, dtype=dtype or next(iter(tensors.values()))[1])
    return max_diff


def _check_against_base(base_dir: Path, state_dir: Path, tensors: dict, *, images: bool):
    """The base's key plan and the tensors to take from the base, once the checkpoint's tensors (tied
    targets dropped from `tensors` in place) are what the base's architecture wants."""
    expected, tied, buffers = _architecture(base_dir, images=images)
    _check_tied_equal(state_dir, tensors, tied)
    for target in tied:
        tensors.pop(target, None)  # the same Parameter as its source; from_pretrained re-ties it
    meta = checkpoint_keys.meta_model(base_dir, images=images)
    keys = checkpoint_keys.CheckpointKeys(meta, base_dir)
    # Persistent buffers (Gemma 4's layer_scalar) and a vision tower a full fine-tune froze
    # (rules/vision.py) are not trained, so the checkpoint (trainable tensors) lacks them: they are
    # the base's, read from its files and written with the first file.
    prefixes = vision.vision_prefixes(meta)
    frozen = {n for n in expected if vision.is_vision_module(n, prefixes)}
    from_base = sorted(n for n in buffers | frozen if n not in tensors and n in keys.names())
    _check_architecture(base_dir, expected, {**{n: tensors[n][0] for n in tensors}, **{n: expected[n] for n in from_base}})
    return keys, from_base


def _read_back_diff(path: Path, originals: dict[str, torch.Tensor]) -> float:
    from safetensors import safe_open

    diff = 0.0
    with safe_open(str(path), framework="pt") as f:
        for name in f.keys():
            written = f.get_tensor(name).float()
            diff = max(diff, float((written - originals[name].float()).abs().max()))
    return diff


def _architecture(base_dir: Path, *, images: bool = False) -> tuple[dict[str, torch.Size], dict[str, str], set[str]]:
    """What the base config's model loads: tensor shapes by name, its tied names (target -> source),
    and which of the names are persistent buffers rather than parameters.

    Built on the meta device (no memory). Tied targets (`lm_head.weight` when
    `tie_word_embeddings`, which Gemma and Qwen2.5-0.5B set, some through the config class's
    default rather than config.json) are not written: from_pretrained re-ties them to the source.
    """
    from accelerate import init_empty_weights
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(base_dir)
    with init_empty_weights():
        model = vision.auto_class(config, images=images).from_config(config)
    tied = model.get_expanded_tied_weights_keys(all_submodels=True)
    expected = {k: v.shape for k, v in model.state_dict().items() if k not in tied}
    parameters = {name for name, _ in model.named_parameters(remove_duplicate=False)}
    return expected, tied, set(expected) - parameters


def _check_tied_equal(state_dir: Path, tensors: dict, tied: dict[str, str]) -> None:
    """A checkpoint that holds both names of a tied weight must hold one tensor under both.

    The trainer shards a tied weight as one Parameter, so DCP writes the same values twice. A
    checkpoint where they differ was trained untied (homelab-ft before the re-tie in
    sharded_loading.tie_weights left the head uninitialised): exporting only the embedding would
    silently drop what the head learnt. Costs reading the embedding twice, once per export.
    """
    import torch.distributed.checkpoint as dcp

    from homelab_ft.store.dcp_metadata import SafeFileSystemReader

    for target, source in tied.items():
        if target not in tensors or source not in tensors:
            continue
        pair = {MODEL_PREFIX + n: torch.empty(tensors[n][0], dtype=tensors[n][1]) for n in (target, source)}
        dcp.load(pair, storage_reader=SafeFileSystemReader(str(state_dir)), no_dist=True)
        if not torch.equal(pair[MODEL_PREFIX + target], pair[MODEL_PREFIX + source]):
            raise UserError(
                f"{state_dir} holds different {target} and {source}, but the model's config ties "
                f"them; this checkpoint was trained with the tie broken and cannot be exported as this "
                f"architecture; train again with this homelab-ft version"
            )


def _check_architecture(base_dir: Path, expected: dict[str, torch.Size], shapes: dict[str, torch.Size]) -> None:
    """The base config's model must want exactly the checkpoint's tensors."""
    if expected != dict(shapes):
        missing = sorted(set(expected) - set(shapes))[:3]
        extra = sorted(set(shapes) - set(expected))[:3]
        raise UserError(
            f"the checkpoint's weights do not match the architecture in {base_dir}/config.json "
            f"(missing {missing}, unexpected {extra}); export it against the model it was trained from"
        )


def _cast(tensor: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
    return tensor if dtype is None or not tensor.is_floating_point() else tensor.to(dtype)


def _group(tensors: dict, *, dtype, max_shard_bytes: int, unit=lambda name: name) -> list[list[str]]:
    """Tensors in checkpoint order, cut into files of at most `max_shard_bytes` (one tensor may
    exceed it); the tensors of one `unit` (a converter's targets, saved from one another) stay together."""
    units: dict[str, list[str]] = {}
    for name in tensors:
        units.setdefault(unit(name), []).append(name)
    groups: list[list[str]] = [[]]
    size = 0
    for names in units.values():
        nbytes = 0
        for name in names:
            shape, stored = tensors[name]
            nbytes += shape.numel() * (dtype if dtype is not None and stored.is_floating_point else stored).itemsize
        if groups[-1] and size + nbytes > max_shard_bytes:
            groups.append([])
            size = 0
        groups[-1].extend(names)
        size += nbytes
    return groups


def _copy_model_files(base_dir: Path, out_dir: Path, *, dtype: torch.dtype) -> None:
    """Config, generation config, tokenizer and chat template from the base; weights excluded."""
    for path in base_dir.iterdir():
        if path.is_file() and not path.name.endswith(_WEIGHT_FILES) and path.name != _INDEX:
            shutil.copyfile(path, out_dir / path.name)  # a new file: the mode of its folder, not the base's
    config_path = out_dir / "config.json"
    config = json.loads(config_path.read_text())
    config["dtype"] = str(dtype).removeprefix("torch.")
    config.pop("torch_dtype", None)
    config_path.write_text(json.dumps(config, indent=2) + "\n")
