"""A model's tensors in a Hugging Face safetensors folder, found through transformers' own key rules.

A released checkpoint is not named like the model transformers builds from it. transformers 5
renames and converts on load (`transformers/conversion_mapping.py`, applied by
`core_model_loading.convert_and_load_state_dict_in_model`): per-expert MoE tensors
(`experts.3.w1.weight`) are stacked into one 3-D parameter (`experts.gate_up_proj`, Mixtral,
Qwen2/3-MoE, DeepSeek-V3, GLM-4-MoE, PhiMoE, Qwen3-Next, Nemotron-H), prefixes change
(`backbone.*` -> `model.*` for Nemotron-H; `model.language_model.*` -> `model.*` when a Qwen 3.5
multimodal checkpoint trains its text decoder alone), and the base-model prefix is added or dropped.
Reading a tensor by the module's name therefore fails on exactly those models, so nothing here
guesses a name: the plan is made by transformers' own `get_model_conversion_mapping` (the model's
transforms, scoped per sub-model as from_pretrained scopes them) and `rename_source_key` (renames,
then at most one converter, then the base-model prefix), and a converted parameter is produced by
the converter's own `convert` (MergeModulelist, Concatenate, Split ...).

`checkpoint_tensors(model, model_dir)` is the one entry point: sharded loading, the 4-bit fill, the
export merge and the GGUF writer all read through it. It reads one tensor at a time (one parameter's
sources at a time for a converted one: a layer's experts), never the model. A parameter that is a
DTensor shard is read as its shard: a one-to-one tensor through transformers' own shard-on-read
(`DtensorShardOperation` on the safetensors slice, only this rank's rows leave the disk); a converted
one whole, converted, then cut the same way.

The inverse, for export: `CheckpointKeys.sources(name)` are the checkpoint keys a parameter was
made from, which is also what `save_pretrained` writes back for a model loaded from this folder
(it reverses the conversions that matched on load, `revert_weight_conversion`; the test checks it).
"""

from __future__ import annotations

import copy
import functools
import json
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from homelab_ft.errors import UserError

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
PEFT_PREFIX = "base_model.model."


def base_name(name: str) -> str:
    """A PEFT-wrapped model's parameter name -> the name in the unwrapped transformers model
    (`base_model.model.` and `.base_layer` go): the names the plan is keyed by."""
    return name.removeprefix(PEFT_PREFIX).replace(".base_layer.", ".")


def is_adapter(name: str) -> bool:
    return ".lora_" in name


def pretrained_model(model: nn.Module) -> nn.Module:
    """The transformers `PreTrainedModel` inside a PEFT wrapper (or the model itself), as transformers
    knows it: a model FSDP2 has sharded is replaced by a meta-device twin of its own class and config.

    `fully_shard` swaps a module's class for a generated `FSDP<Class>` defined outside
    `transformers.`, which `get_model_conversion_mapping` takes for custom code and skips (measured:
    a sharded Qwen 3.5 lost its `language_model` prefix rule). The twin has the same names, which
    is all the plan needs, and costs a meta build (no memory). So is a model whose experts are
    packed 4-bit stacks (`moe_experts.pack_meta` renames `gate_up_proj` to `gate_up_proj_4bit`):
    the twin has the fused parameters the checkpoint's per-expert keys convert to.
    """
    from torch.distributed.fsdp import FSDPModule

    from homelab_ft.model import moe_experts

    model = model.get_base_model() if hasattr(model, "get_base_model") else model
    if not any(isinstance(m, FSDPModule) or moe_experts.is_packed(m) for m in model.modules()):
        return model
    cls = next(c for c in type(model).__mro__ if not issubclass(c, FSDPModule))
    with torch.device("meta"):
        return cls(model.config)


def checkpoint_files(model_dir: Path) -> dict[str, Path]:
    """Checkpoint key -> the safetensors file holding it (the index, or the single file)."""
    model_dir = Path(model_dir)
    if (model_dir / INDEX).is_file():
        weight_map = json.loads((model_dir / INDEX).read_text())["weight_map"]
        return {key: model_dir / name for key, name in weight_map.items()}
    if not (model_dir / SINGLE).is_file():
        raise UserError(f"{model_dir} has no {SINGLE} (or {INDEX}); the weights are read from safetensors")
    from safetensors import safe_open

    with safe_open(str(model_dir / SINGLE), framework="pt") as fh:
        return dict.fromkeys(fh.keys(), model_dir / SINGLE)


@dataclass
class Group:
    """The checkpoint tensors one transformers transform turns into one or more model tensors."""

    first: str
    """The target transformers calls `convert` with (the first the sources were renamed to)."""
    targets: tuple[str, ...]
    sources: list[tuple[str, str]] = field(default_factory=list)
    """(source pattern, checkpoint key), in transformers' order (`dot_natural_key`: expert 10 after 9)."""
    converter: object | None = None
    """The WeightConverter template (copied per use), or None for a one-to-one tensor (renamed or not)."""


class CheckpointKeys:
    """Which checkpoint tensors make each model tensor, planned once from the folder's key list."""

    def __init__(self, model: nn.Module, model_dir: Path):
        self.model = pretrained_model(model)
        self.model_dir = Path(model_dir)
        self.files = checkpoint_files(self.model_dir)
        self.groups, self.used = plan(self.model, self.files)

    def names(self) -> set[str]:
        """Every model tensor (base names) the checkpoint provides."""
        return set(self.groups)

    def sources(self, name: str) -> tuple[str, ...]:
        """The checkpoint keys `name` is made from (what save_pretrained writes back for it)."""
        return tuple(key for _, key in self._group(name).sources)

    def converted(self, name: str) -> bool:
        """Whether `name` is made by a converter (stacked, concatenated, split), not one tensor renamed."""
        return self._group(name).converter is not None

    def unit(self, name: str) -> str:
        """The first target of `name`'s converter: tensors sharing it are converted (and saved) together."""
        return self.groups[name].first if name in self.groups else name

    def as_saved(self, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Model tensors (whole converter units, see `unit`) -> the keys and tensors `save_pretrained`
        writes for a model loaded from this folder: transformers' own `revert_weight_conversion`
        with the transforms that matched this checkpoint, as from_pretrained records them."""
        from transformers.core_model_loading import revert_weight_conversion

        before = self.model.__dict__.get("_weight_conversions")
        self.model._weight_conversions = self.used
        try:
            return revert_weight_conversion(self.model, dict(tensors))
        finally:
            self.model.__dict__.pop("_weight_conversions", None)
            if before is not None:
                self.model._weight_conversions = before

    def tensors(self, names: Iterable[str], *, shards: dict[str, torch.Tensor] | None = None
                ) -> Iterator[tuple[str, torch.Tensor]]:
        """Yield (name, tensor) for each of `names` (base names), as stored on disk (dtype included).

        `shards`: name -> the model's parameter; where that is a DTensor, its local shard is
        yielded instead of the whole tensor. A converter that makes several tensors at once runs
        once; a name asked twice is yielded once.
        """
        shards = shards or {}
        wanted = list(dict.fromkeys(names))
        asked, done = set(wanted), set()
        for name in wanted:
            if name in done:
                continue
            group = self._group(name)
            if group.converter is None:
                done.add(name)
                yield name, self._read_one(group.sources[0][1], name=name, param=shards.get(name))
                continue
            for target, tensor in self._convert(group).items():
                if target in asked and target not in done:
                    done.add(target)
                    yield target, _local(tensor, name=target, param=shards.get(target))
            if name not in done:
                raise AssertionError(f"transformers' converter for {group.sources[0][1]} made no {name}")

    def _group(self, name: str) -> Group:
        if name not in self.groups:
            raise UserError(f"{self.model_dir} has no weight for {name} (transformers' key mapping for "
                            f"{type(self.model).__name__} finds none); is it the checkpoint of this architecture?")
        return self.groups[name]

    def _read_one(self, key: str, *, name: str | None = None, param: torch.Tensor | None = None) -> torch.Tensor:
        """One tensor (or, for a DTensor `param`, this rank's shard of it, read alone) with its own
        `safe_open`: a tensor is a view of the file's mapping, whose touched pages count in RSS
        until it closes (measured in sharded_qlora.py)."""
        from safetensors import safe_open

        with safe_open(str(self.files[key]), framework="pt") as fh:
            op = _shard_op(param)
            if op is None:
                return fh.get_tensor(key)
            part = fh.get_slice(key)
            _check_shape(name, part.get_shape(), param)
            return op.shard_tensor(part).contiguous()

    def _convert(self, group: Group) -> dict[str, torch.Tensor]:
        converter = copy.deepcopy(group.converter)
        for pattern, key in group.sources:
            # a callable is transformers' "sync loading" form: materialize_tensors calls it
            converter.add_tensor(group.first, key, pattern, functools.partial(self._read_one, key))
        out = converter.convert(group.first, model=self.model, config=self.model.config)
        return {name: value[0] if isinstance(value, list) else value for name, value in out.items()}


def plan(model: nn.Module, files: dict[str, Path]) -> tuple[dict[str, Group], list]:
    """Model tensor name -> its Group, by transformers' own renaming of every checkpoint key; and
    the transforms that matched (what from_pretrained keeps as `_weight_conversions` for saving).

    The same steps as `convert_and_load_state_dict_in_model` (transformers 5.24), minus the
    loading: rename each key (`rename_source_key` with the model's transforms and base-model
    prefix), fall back to the key itself when the rename misses but the key is a model name, and
    collect the keys of one converted target in key order. Keys that name nothing in the model
    (a vision tower when the text decoder trains alone) are left out, as from_pretrained leaves
    them unexpected.
    """
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import (
        WeightConverter,
        WeightRenaming,
        dot_natural_key,
        rename_source_key,
    )

    model = pretrained_model(model)
    wanted = {base_name(k): v for k, v in model.state_dict(keep_vars=True).items() if not is_adapter(k)}
    transforms = get_model_conversion_mapping(model)
    renamings = [t for t in transforms if isinstance(t, WeightRenaming)]
    converters = [t for t in transforms if isinstance(t, WeightConverter)]
    by_pattern = {pattern: c for c in converters for pattern in c.source_patterns}
    prefix = model.base_model_prefix
    groups: dict[str, Group] = {}
    for key in sorted(files, key=dot_natural_key):
        target, pattern = rename_source_key(key, renamings, converters, prefix, wanted)
        if target not in wanted and key in wanted:
            target, pattern = rename_source_key(key, [], [], prefix, wanted)
        if target not in wanted:
            continue
        group = groups.get(target)
        if group is None:
            converter = by_pattern[pattern] if pattern is not None else None
            targets = (target,) if converter is None else tuple(
                target.replace(converter.target_patterns[0], t) for t in converter.target_patterns)
            group = Group(first=target, targets=targets, converter=converter)
            for name in targets:
                groups.setdefault(name, group)
        if group.converter is None and group.sources:
            continue  # two keys for one tensor: the first wins, as in from_pretrained
        group.sources.append((pattern if pattern is not None else key, key))
    return groups, [t for t in transforms if t.was_used()]


def _shard_op(param: torch.Tensor | None):
    """transformers' shard-on-read for a DTensor parameter (None for a plain tensor: read it whole)."""
    from torch.distributed.tensor import DTensor

    if not isinstance(param, DTensor):
        return None
    from transformers.distributed.sharding_utils import DtensorShardOperation

    return DtensorShardOperation(param)


def _local(tensor: torch.Tensor, *, name: str, param: torch.Tensor | None) -> torch.Tensor:
    """A whole converted tensor, or this rank's shard of it for a DTensor `param` (the same cut)."""
    op = _shard_op(param)
    if op is None:
        return tensor
    _check_shape(name, tensor.shape, param)
    return op.shard_tensor(tensor).contiguous()


def _check_shape(name: str | None, shape, param: torch.Tensor) -> None:
    """The whole tensor's shape against the parameter's before a shard is cut: a checkpoint row
    more than the config's would otherwise cut a shard of the right size on some ranks."""
    if tuple(shape) != tuple(param.shape):
        raise UserError(f"checkpoint tensor {name} has shape {tuple(shape)} where the model's config wants "
                        f"{tuple(param.shape)}; is config.json the one these weights were saved with?")


def checkpoint_tensors(model: nn.Module, model_dir: Path, *, names: Iterable[str] | None = None,
                       shards: dict[str, torch.Tensor] | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """Each model tensor (by its name in the unwrapped transformers model) read from `model_dir`'s
    safetensors through transformers' key conversion; `names` default: all the checkpoint provides.
    `model` may be on the meta device, wrapped by PEFT, or sharded by FSDP2 (see `CheckpointKeys.tensors`)."""
    keys = CheckpointKeys(model, model_dir)
    yield from keys.tensors(sorted(keys.names()) if names is None else names, shards=shards)


def meta_model(model_dir: Path, *, trust_remote_code: bool = False, images: bool = False) -> nn.Module:
    """The model a run builds from `model_dir`'s config (rules/vision.auto_class: the causal LM, or
    the image-text model of an image run), on the meta device (no memory): what the plan needs when
    no model is at hand (the export merge, the GGUF writer)."""
    from transformers import AutoConfig

    from homelab_ft.rules import vision

    config = AutoConfig.from_pretrained(model_dir, trust_remote_code=trust_remote_code)
    with torch.device("meta"):
        return vision.auto_class(config, images=images).from_config(config, trust_remote_code=trust_remote_code)
