"""GRPO's rollouts on a second machine (`grpo.rollout: node`), synchronous or one step ahead.

The job is two processes (refusals.rollout_node): rank 0 trains as one process (its `DistEnv` is a
single process's: no DDP, no FSDP2, no training collectives) and the last rank, the rollout rank,
holds the same frozen base (4 bits for QLoRA) with the same adapter structure and generates. Before
each rollout the trainer's engine, `Remote`, sends the adapter tensors when they changed since the
last sync (one buffer per dtype), then the prompts; the rollout rank (`serve`) loads the adapters,
runs exactly what `Colocated.generate` runs (the same seeded sampling and settings) and sends the
output ids back; the trainer builds the `Rollout` with the colocated engine's own `rollout()`. So a
run with `grpo.max_staleness: 0` samples the completions a one-process colocated run samples, and
the trainer waits while the rollout rank generates.

With `grpo.max_staleness: 1` the trainer sends the next step's prompts (`Remote.prefetch`) right
after this step's batch arrived and before it trains on it: the rollout rank generates them with
the adapters that sampled this step's batch while the trainer trains, and replies with the
completions' log-probs under those adapters (computed by the same chunked head as the trainer's).
The loss weighs each token by its truncated importance ratio between the trainer's policy and that
one step older one (grpo_loss.importance_weights). The batch due after a step that checkpoints is
never fetched ahead: it is generated fresh after the save, so a resume draws what the uninterrupted
run drew (a save on a signal may find a batch in flight: its replies are collected and dropped).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field, replace

import torch

from homelab_ft.distributed import comm
from homelab_ft.distributed.comm import DistEnv
from homelab_ft.distributed.rollout_link import Link, Prompts, Reply, empty_like_flat, flatten, unflatten_into
from homelab_ft.rules import refusals
from homelab_ft.rung import COLOCATED, Rung, RungError
from homelab_ft.store import ranks
from homelab_ft.train.loss import completion_logprobs
from homelab_ft.train.rollout import Colocated, Rollout, completion_layout, end_token_ids, logprob_batch

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
    return replace(rung, nodes=1, procs_per_node=1, rollout=COLOCATED, rollout_staleness=0)


def adapter_tensors(model) -> list[torch.Tensor]:
    """The trainable parameters (the adapters) in the model's own order, the same on both ranks."""
    return [p for p in model.parameters() if p.requires_grad]


@dataclass
class _Ahead:
    """A request sent before its step (Remote.prefetch): its micro-batches and, once collected, the replies."""

    seeds: list[int]
    rows: list[list[dict]]
    prompts: list[tuple[torch.Tensor, torch.Tensor]]
    replies: list[Reply] | None = None


@dataclass
class Remote:
    """The trainer's rollout engine: `Colocated.sample`'s signature, generation on the rollout rank."""

    local: Colocated
    """Pads the prompts and builds the Rollout from the returned ids, as a colocated run does."""
    link: Link
    staleness: int = 0
    """grpo.max_staleness as the rung has it: 1 lets `prefetch` send the next step's batch early."""
    sent: list[torch.Tensor] | None = None
    """The adapters as the rollout rank holds them (the last sync's buffers)."""
    synced: dict[str, float] = field(default_factory=lambda: {"bytes": 0.0, "seconds": 0.0, "syncs": 0.0})
    """The syncs since `sync_stats` was last asked."""
    ahead: _Ahead | None = None

    @property
    def scores(self) -> bool:
        """Training rollouts come with the sampling policy's log-probs (a possibly stale batch, corrected)."""
        return self.staleness > 0 and self.local.settings.vllm_importance_sampling_correction

    def prefetch(self, model, prompt_batches: list[list[dict]], *, seeds: list[int]) -> None:
        """Send a later step's micro-batches now, with the adapters as they are (module docstring);
        `sample` with the same rows and seed takes its completions."""
        laid = [self.local.prompts(rows, g=self.local.settings.num_generations) for rows in prompt_batches]
        self._free()
        self.synced["seconds"] += self.link.send(
            [Prompts(seed=seed, ids=ids, mask=mask) for seed, (ids, mask) in zip(seeds, laid, strict=True)],
            greedy=False, adapters=self._changed(model), logps=self.scores)
        self.ahead = _Ahead(seeds=list(seeds), rows=prompt_batches, prompts=laid)

    def sample(self, model, rows: list[dict], *, seed: int, greedy: bool = False,
               num_generations: int | None = None) -> Rollout:
        """Colocated.sample's completions, generated on the rollout rank (fetched ahead, or now)."""
        g = self.local.settings.num_generations if num_generations is None else num_generations
        ends = end_token_ids(self.local.tokenizer, model)
        if (found := self._ahead_for(rows, seed=seed, greedy=greedy, g=g)) is not None:
            (ids, mask), reply = found
        else:
            self._free()
            ids, mask = self.local.prompts(rows, g=g)
            if self.scores and not greedy:
                self.synced["seconds"] += self.link.send([Prompts(seed=seed, ids=ids, mask=mask)], greedy=False,
                                                         adapters=self._changed(model), logps=True)
                reply = self.link.collect()[0]
            else:
                out, sync_s = self.link.request(ids, mask, seed=seed, greedy=greedy, adapters=self._changed(model))
                self.synced["seconds"] += sync_s
                reply = Reply(ids=out, logps=None)
        rollout = self.local.rollout(reply.ids.to(ids.device), prompt_ids=ids, prompt_mask=mask, ends=ends, rows=rows, g=g)
        return rollout if reply.logps is None else replace(rollout, sampling_logps=reply.logps.cpu())

    def _ahead_for(self, rows, *, seed: int, greedy: bool, g: int):
        """The prompts and reply of a fetched-ahead micro-batch with these rows and seed, or None."""
        ahead = self.ahead
        if ahead is None or greedy or g != self.local.settings.num_generations or seed not in ahead.seeds:
            return None
        i = ahead.seeds.index(seed)
        if ahead.rows[i] != rows:
            return None
        if ahead.replies is None:
            ahead.replies = self.link.collect()
        found = ahead.prompts[i], ahead.replies[i]
        ahead.seeds[i] = -1  # taken
        if all(s == -1 for s in ahead.seeds):
            self.ahead = None
        return found

    def _free(self) -> None:
        """Collect a request in flight before sending another (rollout_link: one at a time); its
        replies stay for the `sample` calls they answer."""
        if self.ahead is not None and self.ahead.replies is None:
            self.ahead.replies = self.link.collect()

    def _changed(self, model) -> list[torch.Tensor] | None:
        """The adapter buffers when they differ from the last sync's (the first time: always), else None."""
        buffers = flatten([t.to(self.link.synced_dtype(t.dtype)) for t in adapter_tensors(model)])
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
    from homelab_ft.train.build import dtypes_for

    one = trainer_rung(rung)
    link = Link.open(env, staleness=rung.rollout_staleness,
                     compute_dtype=dtypes_for(recipe, rung=one, device=env.device).compute)
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


def held_adapters(model, link: Link, *, device) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """The rollout rank's adapter tensors, cast to the dtype they cross the link in (it never trains:
    rules/adapter_sync.py), and the receive buffers the trainer's `Remote._changed` buffers fill."""
    tensors = adapter_tensors(model)
    with torch.no_grad():
        for t in tensors:
            t.data = t.data.to(link.synced_dtype(t.dtype))
    return tensors, empty_like_flat(tensors, device=device)


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
    tensors, buffers = held_adapters(model, link, device=device)
    ends = end_token_ids(tokenizer, model)
    log.info("rollout rank ready: %d adapter tensors, %d bytes", len(tensors),
             sum(b.numel() * b.element_size() for b in buffers))
    answered = 0
    while (request := link.receive(buffers)) is not None:
        if request.synced:
            unflatten_into(tensors, buffers)
        for b in request.batches:
            out = engine.generate(model, b.ids, b.mask, ends=ends, seed=b.seed, greedy=request.greedy)
            link.reply(out, _sampling_logps(recipe, model, out, b, ends=ends, device=device) if request.logps else None)
        answered += 1
    return answered


def _sampling_logps(recipe, model, out: torch.Tensor, prompts: Prompts, *, ends, device) -> torch.Tensor:
    """The log-probs of the completions in `out` under the weights that sampled them: the trainer's
    function (loss.completion_logprobs, chunked head, the recipe's temperature) on the trainer's layout."""
    ids, attention, completion_mask, _ = completion_layout(out, prompt_ids=prompts.ids, prompt_mask=prompts.mask, ends=ends)
    with torch.no_grad():
        return completion_logprobs(model, logprob_batch(ids, attention, completion_mask), device=device,
                                   chunk_tokens=recipe.train.loss_chunk_tokens, temperature=recipe.grpo.temperature)
