"""The model's shape, the planner's one view of a model: `model_shape(config)`.

What it holds (shape_types.py): parameters per decoder-block kind, the `nn.Linear` layers QLoRA
quantizes and LoRA's `all-linear` wraps, stacked MoE experts, embeddings and head, and the
activation bytes each block kind keeps for backward. Nothing is written per family: derive.py reads
it from the model transformers builds from the config on the meta device (so any causal LM the
installed transformers builds is planned), and shape_cache.py keeps it as JSON, so planning a model
seen before imports no torch.
"""

from __future__ import annotations

from homelab_ft.plan.shape import cache as shape_cache
from homelab_ft.plan.shape.types import BlockShape, Linear, ModelShape

__all__ = ["BlockShape", "Linear", "ModelShape", "model_shape"]


def model_shape(config: dict, *, attn_implementation: str = "sdpa", model_path: str | None = None,
                trust_remote_code: bool = False, images: bool = False) -> ModelShape:
    """The shape of the model a text run (or with `images`, an image run: data.images) of `config` (a
    config.json dict) builds: from the cache when it was derived before with this transformers, else
    derived (imports torch) and cached."""
    return shape_cache.cached_shape(config, attn_implementation=attn_implementation, model_path=model_path,
                                    trust_remote_code=trust_remote_code, images=images)
