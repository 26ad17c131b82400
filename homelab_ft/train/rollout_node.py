"""GRPO's rollouts on a second machine (`grpo.rollout: node`), version 1: synchronous.

The job is two processes (refusals.rollout_node): rank 0 trains as one process (its `DistEnv` is a
single process's: no DDP, no FSDP2, no training collectives) and the last rank, the rollout rank,
holds the same frozen base (4 bits for QLoRA) with the same adapter structure and generates. Before
each rollout the trainer's engine, `Remote`, sends the adapter tensors when they changed since the
last sync (one buffer per dtype), then the prompts; the rollout rank (`serve`) loads the adapters,
runs exactly what `Colocated.generate` runs (the same seeded sampling and settings) and sends the
output ids back; the trainer builds the `Rollout` with the colocated engine's own `rollout()`. So a
run here samples the completions a one-process colocated run samples. The trainer waits while the
rollout rank generates (staleness 0, no overlap); overlapping them is the next version.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field, replace

import torch

from homelab_ft.distributed import comm
from homelab_ft.distributed.comm import DistEnv
from homelab_ft.distributed.rollout_link import Link, empty_like_flat, flatten, unflatten_into
from homelab_ft.rules import refusals
from homelab_ft.rung import COLOCATED, Rung, RungError
from homelab_ft.store import ranks
from homelab_ft.train.rollout import Colocated, Rollout, end_token_ids

log = logging.getLogger(__name__)


def check(recipe, *, rung: Rung) -> None:
    """refusals.rollout_node, for a caller that did not plan (the planner offers no rung it refuses)."""
    if why := refusals.rollout_node(rung, objective=recipe.objective):
        raise RungError(why)


def trainer_env(env: DistEnv) -> DistEnv:
    """Rank 0's environment for training: one process on this rank's device, no process group."""
    return DistEnv(rank=0, local_rank=0, world_size=1, num_nodes=1, device=env.device, backend=None, is_main=True)


def trainer_rung(rung: Rung) -> Rung:
    """The planned 2-process rung as the one process that trains (no_shard: refusals.rollout_node)."""
    return replace(rung, nodes=1, procs_per_node=1, rollout=COLOCATED)


def adapter_tensors(model) -> list[torch.Tensor]:
    """The trainable parameters (the adapters) in the model's own order, the same on both ranks."""
    return [p for p in model.parameters() if p.requires_grad]


@dataclass
class Remote:
    """The trainer's rollout engine: `Colocated.sample`'s signature, generation on the rollout rank."""

    local: Colocated
    """Pads the prompts and builds the Rollout from the returned ids, as a colocated run does."""
    link: Link
    sent: list[torch.Tensor] | None = None
    """The adapters as the rollout rank holds them (the last sync's buffers)."""
    synced: dict[str, float] = field(default_factory=lambda: {"bytes": 0.0, "seconds": 0.0, "syncs": 0.0})
    """The syncs since `sync_stats` was last asked."""

    def sample(self, model, rows: list[dict], *, seed: int, greedy: bool = False,
               num_generations: int | None = None) -> Rollout:
        """Colocated.sample's completions, generated on the rollout rank."""
        g = self.local.settings.num_generations if num_generations is None else num_generations
        ids, mask = self.local.prompts(rows, g=g)
        ends = end_token_ids(self.local.tokenizer, model)
        out, sync_s = self.link.request(ids, mask, seed=seed, greedy=greedy, adapters=self._changed(model))
        self.synced["seconds"] += sync_s
        return self.local.rollout(out.to(ids.device), prompt_ids=ids, prompt_mask=mask, ends=ends, rows=rows, g=g)

    def _changed(self, model) -> list[torch.Tensor] | None:
        """The adapter buffers when they differ from the last sync's (the first time: always), else None."""
        buffers = flatten(adapter_tensors(model))
        if self.sent is not None and all(torch.equal(a, b) for a, b in zip(buffers, self.sent, strict=True)):
            return None
        self.sent = buffers  # fresh tensors (torch.cat), never written to again
        self.synced["bytes"] += sum(b.numel() * b.element_size() for b in buffers)
        self.synced["syncs"] += 1
        return buffers

    def sync_stats(self) -> dict[str, float]:
        """`rollout/adapter_bytes`, `rollout/syncs` and `rollout/sync_s` since the last call (0 bytes: the
        adapters had not changed since the rollout rank last received them)."""
        out = {f"rollout/{name}": value for name, value in
               (("adapter_bytes", self.synced["bytes"]), ("syncs", self.synced["syncs"]),
                ("sync_s", self.synced["seconds"]))}
        self.synced = {"bytes": 0.0, "seconds": 0.0, "syncs": 0.0}
        return out


def run(recipe, *, env: DistEnv, rung: Rung, inputs, train: Callable):
    """The job's two roles, after comm.setup: the last rank `serve`s until told to stop (returns None);
    rank 0 runs `train(env, rung, link)` as one process (`trainer_env`, `trainer_rung`, the store's
    steps `ranks.alone()`: the rollout rank joins no checkpoint collective) and sends stop however
    training ends. `inputs`: the checked inputs (preflight), with the model folder both ranks read."""
    check(recipe, rung=rung)
    comm.check_job(env, rung)
    link = Link.open(env)
    one = trainer_rung(rung)
    if env.rank == link.server:
        answered = serve(recipe, link=link, rung=one, inputs=inputs, device=env.device)
        log.debug("rollout rank answered %d requests", answered)
        return None
    try:
        with ranks.alone():
            return train(trainer_env(env), one, link)
    finally:
        try:
            link.stop()
        except RuntimeError as err:  # the link itself failed (the rollout rank died): the first error is the story
            log.warning("could not send stop to the rollout rank: %s", str(err).splitlines()[0] if str(err) else err)


def serve(recipe, *, link: Link, rung: Rung, inputs, device: torch.device) -> int:
    """The rollout rank: build the model to generate with (the trainer's rung pieces: build.build_model
    as one process, so the same base, 4-bit or not, and the same adapters), then answer requests until
    the trainer says stop. Returns the number of requests answered."""
    from homelab_ft.model import loading
    from homelab_ft.train import build

    tokenizer = loading.load_tokenizer(recipe.model, inputs.model_dir)
    env = DistEnv(rank=0, local_rank=0, world_size=1, num_nodes=1, device=device, backend=None, is_main=False)
    torch.manual_seed(recipe.train.seed)  # as the trainer draws its adapters; the first sync overwrites them
    model = build.build_model(recipe, model_dir=inputs.model_dir, facts=inputs.facts, rung=rung, env=env)
    engine = Colocated(settings=recipe.grpo, tokenizer=tokenizer, device=device, distributed=False)
    tensors = adapter_tensors(model)
    buffers = empty_like_flat(tensors, device=device)
    ends = end_token_ids(tokenizer, model)
    log.info("rollout rank ready: %d adapter tensors, %d bytes", len(tensors),
             sum(b.numel() * b.element_size() for b in buffers))
    answered = 0
    while (request := link.receive(buffers)) is not None:
        if request.synced:
            unflatten_into(tensors, buffers)
        out = engine.generate(model, request.prompt_ids, request.prompt_mask, ends=ends, seed=request.seed,
                              greedy=request.greedy)
        link.reply(out)
        answered += 1
    return answered
