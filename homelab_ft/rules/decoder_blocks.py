"""Which modules of a Hugging Face model are its decoder blocks: one rule for the planner (which
sizes them, plan/shape/derive.py) and the trainer (which shards, checkpoints and compiles them,
model/blocks.py), so the two cannot count different blocks.

transformers names the block classes in `_no_split_modules` (for device-map splitting:
`LlamaDecoderLayer`, `Qwen2DecoderLayer`, `NemotronHBlock` ...), which is exactly the unit of FSDP2
wrapping, checkpointing and pipeline stages, so no per-architecture table is needed. Torch-free:
it only walks the module objects it is given.
"""

from __future__ import annotations


def decoder_blocks(model) -> list:
    """The outermost modules whose class, or one of its bases, `_no_split_modules` names, in order
    ([] when the model declares none). Bases count because fully_shard turns LlamaDecoderLayer into
    an FSDPLlamaDecoderLayer subclass, and PEFT wraps without renaming the classes."""
    names: set[str] = set()
    for module in model.modules():
        names.update(getattr(module, "_no_split_modules", None) or ())
    found, inside = [], set()
    for module in model.modules():
        if id(module) in inside:
            continue
        if any(c.__name__ in names for c in type(module).__mro__):
            found.append(module)
            inside.update(id(m) for m in module.modules())
    return found
