"""Cutting a Hugging Face causal LM into pipeline stages (run by pipeline.py): which blocks each
stage holds, the refusals that come before anything is built, and each stage's own weights.

A stage keeps the model's own module tree and names: the blocks of other stages become
`_Elsewhere` placeholders that pass the hidden states through, the ends another stage holds
become `nn.Identity`. So stage 1's first block is still `model.layers.2`: the weights are read by
their checkpoint names, the stages' checkpoints never collide, and a 2-stage checkpoint loads on
one process. The blocks are found by `model.blocks.transformer_blocks` (transformers'
`_no_split_modules`), the ends by `get_input_embeddings` / `get_output_embeddings` / `get_decoder`:
no family table.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from homelab_ft.errors import UserError
from homelab_ft.model import checkpoint_keys
from homelab_ft.model.blocks import transformer_blocks
from homelab_ft.rules import refusals
from homelab_ft.rung import Rung

SCHEDULE_CLASSES = {"1f1b": "Schedule1F1B", "gpipe": "ScheduleGPipe"}
"""rung.PIPELINE_SCHEDULES -> the class torch.distributed.pipelining names it."""


# --------------------------------------------------------------------------------------------
# the split and its refusals (pure: no process group)


def stage_ranges(num_blocks: int, rung: Rung) -> list[range]:
    """The decoder blocks of each stage, first to last: `rung.stage_blocks`, or as even as
    possible with the remainder on the earlier stages (the last one also holds the head)."""
    counts = list(rung.stage_blocks)
    if not counts:
        base, extra = divmod(num_blocks, rung.pipeline_stages)
        counts = [base + (1 if i < extra else 0) for i in range(rung.pipeline_stages)]
    starts = [sum(counts[:i]) for i in range(len(counts))]
    return [range(start, start + n) for start, n in zip(starts, counts, strict=True)]


def check_recipe(recipe, *, rung: Rung, config: dict, moe_experts: bool) -> None:
    """What a pipeline needs from the recipe and the model (its config.json; `moe_experts`: it has
    fused MoE experts), refused before anything is created: the trainer's rules (refusals.py, the
    ones the planner keeps off its ladder) and what only torch can answer, a schedule this torch has."""
    if not rung.pipeline_enabled:
        return
    num_blocks = (config.get("text_config") or config).get("num_hidden_layers")
    if not isinstance(num_blocks, int):
        raise UserError(f"sharding.pipeline_stages: {recipe.model.path} config.json names no num_hidden_layers, so "
                        "its decoder blocks cannot be split into stages; set sharding.pipeline_stages=1")
    refusals.check(rung, recipe, num_blocks=num_blocks, moe_experts=moe_experts)
    import torch.distributed.pipelining as pipelining

    name = SCHEDULE_CLASSES[rung.pipeline_schedule]
    if not hasattr(pipelining, name):
        raise UserError(f"sharding.pipeline_schedule={rung.pipeline_schedule}: torch {torch.__version__} has no "
                        f"torch.distributed.pipelining.{name}; use another schedule or a newer torch")


# --------------------------------------------------------------------------------------------
# cutting the model


class _Elsewhere(nn.Module):
    """A decoder block another stage runs: passes the hidden states through unchanged.

    It keeps the block's plain attributes (`attention_type`, `layer_idx` ...) which some decoders
    read in their loop. It returns the hidden states as they came: decoders that take a tuple from
    each block (`layer_outputs[0]`) are refused by `keep_stage` instead of fed the wrong tensor."""

    def __init__(self, block: nn.Module):
        super().__init__()
        for key, value in vars(block).items():
            if not key.startswith("_") and not isinstance(value, (nn.Module, torch.Tensor)):
                setattr(self, key, value)

    def forward(self, hidden_states, *args, **kwargs):
        return hidden_states


def causal_lm(model: nn.Module) -> nn.Module:
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def _set_module(root: nn.Module, target: nn.Module, replacement: nn.Module) -> None:
    for name, module in root.named_modules():
        if module is target and name:
            parent_name, _, attr = name.rpartition(".")
            setattr(root.get_submodule(parent_name) if parent_name else root, attr, replacement)
            return
    raise AssertionError(f"{type(target).__name__} is not a submodule")


def keep_stage(model: nn.Module, *, blocks: range, first: bool, last: bool) -> None:
    """Drop, in place, what another stage holds: blocks outside `blocks` become `_Elsewhere`; the
    input embeddings leave every stage but the first; the final norm (the decoder's other
    parameterised children) and the head every stage but the last."""
    import inspect

    lm = causal_lm(model)
    decoder = lm.get_decoder()
    try:  # `hidden_states = layer_outputs[0]`: 59 modeling files of transformers 5.24
        unpacks = "layer_outputs[0]" in inspect.getsource(type(decoder).forward)
    except (OSError, TypeError):  # no source to read (compiled, or built at runtime)
        unpacks = False
    if unpacks:
        raise UserError(f"sharding.pipeline_stages: {type(decoder).__name__}'s blocks return tuples, which the "
                        "pipeline's placeholders for other stages' blocks do not yet mimic; set sharding.pipeline_stages=1")
    all_blocks = transformer_blocks(model)
    holder = next(m for m in model.modules() if isinstance(m, nn.ModuleList) and any(b is all_blocks[0] for b in m))
    for index, block in enumerate(list(holder)):
        if index not in blocks:
            holder[index] = _Elsewhere(block)
    embed, head = lm.get_input_embeddings(), lm.get_output_embeddings()
    if not last:
        for name, child in list(decoder.named_children()):
            if child is not embed and child is not holder and any(True for _ in child.parameters()):
                setattr(decoder, name, nn.Identity())
        _set_module(model, head, nn.Identity())
    if not first:
        _set_module(model, embed, nn.Identity())


def fill_stage(model: nn.Module, *, model_dir: Path, adapters: dict[str, torch.Tensor], tied: dict[str, str]) -> None:
    """Read this stage's tensors (and only them) from the safetensors into `model` (allocated by
    `to_empty`); adapters come from `adapters` (full-model names). `tied` maps a tied head's name
    to the name the file stores it under (the embedding's). Tensors are found through transformers'
    own key conversion (model/checkpoint_keys.py: renamed prefixes, per-expert files)."""
    # Planned on the whole architecture (meta): a stage's own module tree lacks the other stages'
    # parts, and a tied head is read under the embedding's name, which only the first stage holds.
    keys = checkpoint_keys.CheckpointKeys(checkpoint_keys.meta_model(Path(model_dir)), Path(model_dir))
    on_disk = keys.names()
    state = model.state_dict()
    wanted: dict[str, str] = {}
    for key in state:
        if key in adapters:
            continue
        name = checkpoint_keys.base_name(key)
        name = name if name in on_disk else tied.get(name, name)
        if name not in on_disk:
            raise UserError(f"{model_dir} has no weight {name}; is it the checkpoint of this architecture?")
        wanted[key] = name
    tensors = dict(keys.tensors(sorted(set(wanted.values()))))
    with torch.no_grad():
        for key, value in state.items():
            source = adapters[key] if key in adapters else tensors[wanted[key]]
            value.copy_(source.to(value.dtype))


def tied_names(model: nn.Module) -> dict[str, str]:
    """{head weight name: embedding weight name} when the model ties them (one Parameter), else {}."""
    lm = causal_lm(model)
    embed, head = lm.get_input_embeddings(), lm.get_output_embeddings()
    if head is None or embed is None or head.weight is not embed.weight:
        return {}
    names = {id(m): n for n, m in model.named_modules()}
    return {checkpoint_keys.base_name(f"{names[id(head)]}.weight"): checkpoint_keys.base_name(f"{names[id(embed)]}.weight")}
