"""What a cluster can afford: the largest micro-batch and the longest sequence that fit, for the
option a plan chose and for the next rung of the ladder. Pure: a search over the estimate.

Answering "how far can I go" took six plans by hand (issue 24). Memory grows with the micro-batch
and with the sequence (activations, logits: the planner's property tests pin that it never
shrinks), so the largest value that fits is found by doubling from a known fit and then bisecting:
~2 log2(limit) estimates, a few milliseconds each. The chosen option keeps its method, strategy
and offload, with the savers the recipe leaves `auto` free to turn on; the next rung is priced as
`method: <that rung>` would be (any of its options).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from homelab_ft.plan.inputs import Cluster, PlanRequest
from homelab_ft.plan.ladder import LADDER, Option, choose, evaluate, option_rung, price, saver_levels
from homelab_ft.plan.shape.shapes import ModelShape

MAX_MICRO_BATCH = 4096
"""Beyond this the search stops (and says `>=`): no homelab step wants more rows than that."""
SEQ_STEP = 64
"""Sequences are searched in multiples of this, the granularity anyone sets data.max_length in."""


@dataclass(frozen=True)
class Afford:
    label: str
    """The option (chosen, without its savers: they may change) or the rung (next) the limits are for."""
    micro_batch_size: int
    """The largest micro-batch that fits at the recipe's sequence length; 0: not even one row."""
    seq_len: int
    """The longest sequence (a multiple of SEQ_STEP, or the model's limit) that fits at the recipe's
    micro-batch; 0: not even SEQ_STEP tokens."""
    micro_batch_capped: bool
    """The search stopped at MAX_MICRO_BATCH, which still fits."""
    seq_capped: bool
    """The model's max_position_embeddings still fits."""
    num_generations: int = 0
    """GRPO: the most completions per prompt that fit at the recipe's max_completion_length (2 at
    least: a group of one has no baseline; 0: not even 2); 0 for other objectives."""
    completion_len: int = 0
    """GRPO: the longest completion (a multiple of SEQ_STEP, or what the model's positions leave after
    the prompt) that fits at the recipe's num_generations; 0 when not even SEQ_STEP tokens fit."""

    def text(self, *, request: PlanRequest) -> str:
        """`qlora no_shard: micro_batch <= 21 at max_length 2048; max_length <= 16384 at micro_batch 2`."""
        if not self.micro_batch_size:
            batch = f"no micro_batch fits at max_length {request.data.max_length}"
        else:
            batch = f"micro_batch {'>=' if self.micro_batch_capped else '<='} {self.micro_batch_size} at max_length {request.data.max_length}"
        if not self.seq_len:
            seq = f"no max_length fits at micro_batch {request.train.micro_batch_size}"
        elif self.seq_capped:
            seq = f"max_length {self.seq_len} (the model's limit) fits at micro_batch {request.train.micro_batch_size}"
        else:
            seq = f"max_length <= {self.seq_len} at micro_batch {request.train.micro_batch_size}"
        return f"{self.label}: {batch}; {seq}" + (self._grpo_text(request) if request.objective == "grpo" else "")

    def _grpo_text(self, request: PlanRequest) -> str:
        """`; num_generations <= 24 at max_completion_length 1024; max_completion_length <= 4096 at num_generations 8`."""
        g = request.grpo
        gens = (f"num_generations <= {self.num_generations}" if self.num_generations else "no group of 2 fits") \
            + f" at max_completion_length {g.max_completion_length}"
        length = (f"max_completion_length <= {self.completion_len}" if self.completion_len else "no completion fits") \
            + f" at num_generations {g.num_generations}"
        return f"; {gens}; {length}"


def largest(fits: Callable[[int], bool], *, low: int, high: int, step: int = 1) -> int:
    """The largest value in [low, high] (on multiples of `step` above `low`, or `high` itself) for which
    `fits` holds, assuming it holds for everything below a value that fits; 0 if `low` does not fit."""
    if not fits(low):
        return 0
    good, bad = low, None
    while bad is None:
        probe = min(good * 2, high)
        if probe == good:
            return good
        if fits(probe):
            good = probe
        else:
            bad = probe
    while True:
        mid = (good + bad) // 2 // step * step
        if mid <= good or mid >= bad:
            return good
        if fits(mid):
            good = mid
        else:
            bad = mid


def for_option(shape: ModelShape, option: Option, *, request: PlanRequest, cluster: Cluster) -> Afford:
    """The limits of one option: its method, strategy and offload held, the activation savers the
    recipe leaves `auto` turned on where the larger batch or sequence needs them (as the planner
    would: ladder.saver_levels, cheapest first)."""
    def fits(**change) -> bool:
        req = request.changed(**change)
        stages = option.rung.pipeline_stages
        return any(price(shape, rung=option_rung(option.method, option.strategy, option.cpu_offload, request=req,
                                                 cluster=cluster, savers=level, stages=stages,
                                                 rollout=option.rung.rollout, shape=shape),
                         request=req, cluster=cluster)[1]
                   for level in saver_levels(req, cluster) if not (stages > 1 and level[1]))

    label = (f"{option.method} pipeline {option.rung.pipeline_stages} stages" if option.rung.pipeline_enabled
             else f"{option.method} {option.strategy}{' +offload' if option.cpu_offload else ''}")
    return _limits(label, fits, shape=shape, request=request)


def for_rung(shape: ModelShape, method: str, *, request: PlanRequest, cluster: Cluster) -> Afford:
    """The limits of a rung of the ladder: any of its options, chosen as `method: <that rung>` would."""
    rung_request = request.changed(method=method)

    def fits(**change) -> bool:
        req = rung_request.changed(**change)
        return choose(evaluate(shape, request=req, cluster=cluster), request=req) is not None

    return _limits(method, fits, shape=shape, request=request)


def next_rung(method: str) -> str | None:
    """The rung after `method` on the ladder (qlora -> lora -> full), or None after the last."""
    at = LADDER.index(method)
    return LADDER[at + 1] if at + 1 < len(LADDER) else None


def _limits(label: str, fits: Callable[..., bool], *, shape: ModelShape, request: PlanRequest) -> Afford:
    batch = largest(lambda n: fits(train={"micro_batch_size": n}), low=1, high=MAX_MICRO_BATCH)
    top = shape.max_position_embeddings - request.completion_tokens  # GRPO: the prompt leaves room for the completion
    seq = largest(lambda n: fits(data={"max_length": n}), low=min(SEQ_STEP, top), high=top, step=SEQ_STEP)
    gens = completion = 0
    if request.objective == "grpo":  # how many completions per prompt, and how long, the GPU holds
        gens = largest(lambda n: fits(grpo={"num_generations": n}), low=2, high=MAX_MICRO_BATCH)
        room = shape.max_position_embeddings - request.data.max_length
        completion = largest(lambda n: fits(grpo={"max_completion_length": n}), low=min(SEQ_STEP, room), high=room,
                             step=SEQ_STEP) if room > 0 else 0
    return Afford(label=label, micro_batch_size=batch, seq_len=seq, micro_batch_capped=batch == MAX_MICRO_BATCH,
                  seq_capped=seq == top, num_generations=gens, completion_len=completion)
