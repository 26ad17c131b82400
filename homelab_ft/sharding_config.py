"""The recipe's `sharding:` section: how a multi-process run spreads the model (FSDP2 or DDP) and
whether it is cut into pipeline stages. Its own module so config.py stays one screenful per
section; the names (strategies, schedules) live once, in rung.py.
"""

from __future__ import annotations

from typing import Literal

from pydantic import ConfigDict
from pydantic.dataclasses import dataclass

from homelab_ft.bounds import PositiveInt
from homelab_ft.recipe_io import attach_field_docs
from homelab_ft.rung import PIPELINE_SCHEDULES, STRATEGIES

# The same strictness as config.py's sections: unknown keys refused, docstrings kept, floats finite.
_STRICT = ConfigDict(extra="forbid", use_attribute_docstrings=True, allow_inf_nan=False)

Strategy = Literal[("auto", *STRATEGIES)]


@dataclass(frozen=True, config=_STRICT)
class ShardingConfig:
    strategy: Strategy = "auto"
    """FSDP2 strategy for multi-process runs; `auto` lets the planner pick."""
    cpu_offload: bool = False
    """Keep sharded parameters, gradients and optimizer state in host RAM (FSDP2 CPUOffloadPolicy)."""
    param_dtype: Literal["auto", "float32", "bfloat16"] = "auto"
    """Dtype of gathered weights during compute; `auto`: the model dtype."""
    reduce_dtype: Literal["float32", "bfloat16"] = "float32"
    """Dtype gradients are reduced in; fp32 keeps small per-rank contributions from rounding away.
    DDP (no_shard) reduces gradients that are already bf16 in bf16 whatever this says, and on
    gloo (CPU) fp32 gradients in fp32 (torch's bf16 hook for DDP needs NCCL)."""
    pipeline_stages: PositiveInt | Literal["auto"] = "auto"
    """Cut the decoder blocks into this many contiguous stages, one per process, run by
    torch.distributed.pipelining (distributed/pipeline.py): the first stage holds the embeddings,
    the last the final norm, the head and the loss. The processes beyond one pipeline replicate it
    (DDP). `auto`: the planner prices pipelines (one stage per node, one per GPU) beside sharding
    and takes one when it is the fastest option that fits and the trainer runs it for this recipe
    (homelab_ft/refusals.py: not with DPO, a held-out split, samples, DoRA, an 8-bit base ...);
    `plan` says why one was not offered. 1: never a pipeline."""
    stage_blocks: tuple[PositiveInt, ...] | None = None
    """Decoder blocks per stage, first to last, summing to the model's blocks (e.g. `[3, 1]`);
    default: as even as possible, earlier stages taking the remainder."""
    pipeline_schedule: Literal[PIPELINE_SCHEDULES] = "1f1b"
    """`1f1b`: each stage alternates one forward and one backward once the pipeline is full, so at
    most `pipeline_stages` micro-batches' activations wait on the first stage; `gpipe`: all
    forwards, then all backwards (every micro-batch's activations at once, same bubble)."""


attach_field_docs(globals())
