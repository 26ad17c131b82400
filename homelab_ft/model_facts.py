"""What building the model asks of it, answered once by the planner and handed down.

The builder (train/build.py) has to know a few things about the model before it builds it, or
to size what it builds: whether it has fused MoE experts (a QLoRA base with them takes the meta
build and the per-block 4-bit fill; a pipeline stage does not pack them yet), its vocabulary (the
chunked loss), its blocks (a pipeline's stages), tying and the embedding's name (the embedding
offload rule). The planner already read all of it off the meta model it derives the shape from
(plan/shape/derive.py), so `ModelShape.facts` gives them as this record, cached with the shape, and the
plan hands it to the one-process trainer (preflight.Inputs) and to every torchrun worker
(cluster/handoff.py): before, `build_model` read config.json up to three times and built a meta
skeleton only to ask "is it MoE?". Torch-free and JSON, so plan/, train/ and the handoff share it.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass


@dataclass(frozen=True)
class ModelFacts:
    """The planner's answers to the builder's questions about the model (see the module docstring)."""

    num_blocks: int
    """Decoder blocks (decoder_blocks.py's rule): what a pipeline cuts into stages."""
    vocab_size: int
    """Rows of the text decoder's input embedding: what the chunked loss is sized by."""
    tied_embeddings: bool
    """The LM head's weight is the input embedding's."""
    embedding_name: str
    """Module name of the input embeddings (`model.embed_tokens`): what a `lora.target_modules`
    entry must match to put an adapter on them (embedding_offload.targets_embedding)."""
    fused_experts: tuple[str, ...] = ()
    """The fused MoE expert projections transformers marks, by their names inside a block
    (`mlp.experts.gate_up_proj`); empty for a dense model."""

    @property
    def has_fused_experts(self) -> bool:
        return bool(self.fused_experts)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> ModelFacts:
        return cls(**{**data, "fused_experts": tuple(data["fused_experts"])})
