"""Which modules of a Hugging Face model are its decoder blocks: one rule for the planner (which
sizes them, plan/shape/derive.py) and the trainer (which shards, checkpoints and compiles them,
model/blocks.py), so the two cannot count different blocks.

transformers names the block classes in `_no_split_modules` (for device-map splitting:
`LlamaDecoderLayer`, `Qwen2DecoderLayer`, `NemotronHBlock` ...), which is exactly the unit of FSDP2
wrapping, checkpointing and pipeline stages, so no per-architecture table is needed. A few vision
towers name a part of their layer instead (Idefics3's and SmolVLM's `*VisionAttention`, inside each
`*EncoderLayer`: transformers 5.25): what the name keeps whole for a device map is then the layer
that holds it, one item of the tower's list of layers, and that layer is the block, so FSDP2 gathers
a vision layer's MLP with its attention instead of leaving every MLP to the root unit. Torch-free:
it only walks the module objects it is given.
"""

from __future__ import annotations


def decoder_blocks(model) -> list:
    """The outermost modules whose class, or one of its bases, `_no_split_modules` names, in order
    ([] when the model declares none); one that lies inside an item of a list of layers (a module
    named `...layers.3.self_attn`) stands for that item (the module docstring says why). Bases
    count because fully_shard turns LlamaDecoderLayer into an FSDPLlamaDecoderLayer subclass, and
    PEFT wraps without renaming the classes."""
    names: set[str] = set()
    for module in model.modules():
        names.update(getattr(module, "_no_split_modules", None) or ())
    modules = dict(model.named_modules())
    found, inside = [], set()
    for name, module in modules.items():
        if id(module) in inside or not any(c.__name__ in names for c in type(module).__mro__):
            continue
        block = modules[_list_item(name)]
        found.append(block)
        inside.update(id(m) for m in block.modules())
    return found


def _list_item(name: str) -> str:
    """The innermost list item around module `name` (`...layers.3` for `...layers.3.self_attn`), or
    `name` itself when it is one or lies in none."""
    parts = name.split(".")
    items = [i for i, part in enumerate(parts) if part.isdigit()]
    return ".".join(parts[:items[-1] + 1]) if items else name
