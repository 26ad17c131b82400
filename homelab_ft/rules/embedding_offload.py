"""`train.embedding_offload`: whether the frozen input embedding table lives in host RAM.

On the adapter rungs the input embedding table is frozen. When it is not tied to the LM head it
need not be on the GPU at all: the token ids are looked up on the host and only the looked-up rows
([batch, seq, hidden], 8 MiB per 2048-token row at hidden 2048 in bf16) cross PCIe, against the
whole table kept on the device (Qwen3-30B-A3B: 151,936 x 2048 x 2 B = 0.58 GiB; Llama-3-8B:
128,256 x 4096 x 2 B = 0.98 GiB). Unsloth's `offload_embedding` does the same.

This module is the one rule: `placed` sets `Rung.embedding_offload` where the ladder builds each rung
(plan/ladder.option_rung), the pricing reads that field (plan/price/params.host_embedding_bytes), and so
does the trainer (train/host_embedding.py keeps the table on the host when the chosen rung says so);
plan/planner.py refuses `true` where the model cannot apply it. Pure, torch-free.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Literal

from homelab_ft.rung import NO_SHARD, Rung, RungError, effective_strategy

AUTO = "auto"
Setting = bool | Literal["auto"]
KEY = "train.embedding_offload"


def error(why: str) -> RungError:
    """The one-line refusal of `true` where it cannot apply."""
    return RungError(f"{KEY}=true: {why}; set {KEY}=auto (on wherever it applies) or false")


def targets_embedding(targets: str | tuple[str, ...] | list[str], *, embedding_name: str) -> bool:
    """`lora.target_modules` puts an adapter on the input embedding module `embedding_name` (its
    full module name, e.g. `model.embed_tokens`): a list entry equal to it or to a dotted suffix
    of it, as PEFT matches list targets (`check_target_module_exists`). `all-linear` wraps
    nn.Linear layers only."""
    names = (targets,) if isinstance(targets, str) else tuple(targets)
    if "all-linear" in names or not embedding_name:
        return False
    return any(embedding_name == t or embedding_name.endswith("." + t) for t in names)


def rung_refusal(rung: Rung) -> str | None:
    """Why the rung cannot keep the table on the host, or None. FSDP2 (also on one GPU to offload to
    the CPU) makes the table a sharded DTensor unit of its own (distributed.parallelize); pipeline
    stages place it on the first stage's GPU (distributed/stages.py). One process and DDP (which
    neither broadcasts nor reduces frozen parameters) keep it where the trainer puts it."""
    return _named_refusal(rung.method, strategy=rung.strategy, cpu_offload=rung.cpu_offload,
                          pipeline_stages=rung.pipeline_stages)


def _named_refusal(method: str, *, strategy: str, cpu_offload: bool, pipeline_stages: int | str) -> str | None:
    if method == "full":
        return "method=full trains the embeddings, which stay on the GPU"
    if cpu_offload or strategy not in (AUTO, NO_SHARD):
        return (f"sharding.strategy={strategy}{' with sharding.cpu_offload' if cpu_offload else ''} shards the "
                "embeddings with FSDP2 (it applies to one process or DDP: sharding.strategy=no_shard)")
    if isinstance(pipeline_stages, int) and pipeline_stages > 1:
        return "a pipeline places the embeddings on its first stage (it applies with sharding.pipeline_stages=1)"
    return None


def model_refusal(*, tied: bool, targeted: bool, device_type: str) -> str | None:
    """Why the model or the device leaves nothing to keep on the host, or None."""
    if tied:
        return "the input embeddings are tied to the LM head, which computes the logits on the GPU"
    if targeted:
        return "lora.target_modules puts an adapter on the input embeddings, which then train on the GPU"
    if device_type != "cuda":
        return f"the run is on {device_type}, with no GPU memory to save"
    return None


def refusal(*, rung: Rung, tied: bool, targeted: bool, device_type: str) -> str | None:
    """The first reason `rung` on this model and device cannot keep the table on the host, or None."""
    return rung_refusal(rung) or model_refusal(tied=tied, targeted=targeted, device_type=device_type)


def decide(setting: Setting, *, rung: Rung, tied: bool, targeted: bool, device_type: str) -> bool:
    """Whether the table lives on the host: `auto` whenever it can (`refusal` is None), `false`
    never, `true` where it can, else RungError naming the reason (one line, exit 2)."""
    if setting is False:
        return False
    why = refusal(rung=rung, tied=tied, targeted=targeted, device_type=device_type)
    if why is not None and setting is True:
        raise error(why)
    return why is None


def placed(rung: Rung, setting: Setting, *, targets, embedding_name: str, tied: bool, device_type: str) -> Rung:
    """`rung` with `embedding_offload` as `decide` rules for this model (its embedding module's name
    and whether it is tied, ModelShape's facts; `targets`: lora.target_modules) and device: the one
    place the choice is made (the ladder, for every rung it prices; `train` for a named rung the
    planner did not choose), so the plan's price and the trainer's model read the same field."""
    targeted = targets_embedding(targets, embedding_name=embedding_name)
    keep = decide(setting, rung=rung, tied=tied, targeted=targeted, device_type=device_type)
    return rung if keep == rung.embedding_offload else replace(rung, embedding_offload=keep)


def check_named(setting: Setting, *, method: str, strategy: str, cpu_offload: bool, world_size: int,
                pipeline_stages: int | str) -> None:
    """`true` beside recipe keys that already rule it out (config.py calls this once per recipe), so
    the refusal names the key instead of the planner finding nothing that fits. A sharding strategy
    named for one process without offload runs unsharded (rung.effective_strategy)."""
    if strategy != AUTO:
        strategy = effective_strategy(strategy, world_size=world_size, cpu_offload=cpu_offload)
    why = _named_refusal(method, strategy=strategy, cpu_offload=cpu_offload, pipeline_stages=pipeline_stages)
    if setting is True and why is not None:
        raise error(why)
