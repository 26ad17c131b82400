"""GRPO's side of a step (objective: grpo): sample completions, score them, turn rewards into advantages.

`trainer.grpo_step` is the step: when a new batch is due (every `grpo.num_iterations` steps),
`Grpo.roll` draws `train.grad_accum_steps` micro-batches of `train.micro_batch_size` prompts, samples
`grpo.num_generations` completions of each (rollout.py), scores them with every reward function
(rewards.py), and computes each completion's advantage against its group (grpo_loss.py). The step
then runs the clipped policy loss over those micro-batches through the shared skeleton
(`trainer._optimizer_step`), the loss normalised over the whole step by `units` (what each
`loss_type` divides by), and logs `Grpo.stats` beside the loss.

So `train.micro_batch_size` counts prompts: one forward carries micro_batch_size x num_generations
sequences (TRL's `per_device_train_batch_size` counts completions: ours times num_generations).

With `scale_rewards: batch` the std is that of every reward of the step on every rank (TRL's gathered
batch); with `group` a group's completions all sit in one micro-batch of one rank, so no rank needs
another's rewards. Metrics use TRL's names where TRL has one.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from dataclasses import dataclass, field

import torch

from homelab_ft.distributed import comm
from homelab_ft.recipe.objectives import GrpoConfig
from homelab_ft.train import grpo_loss, rewards
from homelab_ft.train.loss import completion_logprobs
from homelab_ft.train.preference import adapters_off
from homelab_ft.train.rollout import Colocated, Rollout, seed_for
from homelab_ft.train.rollout_node import Remote

log = logging.getLogger(__name__)

POLICY_METRICS = ("clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean")
"""grpo_loss.policy_loss's metrics, averaged over the step's micro-batches weighted by their `units`."""


def loss_names(settings: GrpoConfig, *, corrects: bool = False) -> tuple[str, ...]:
    """The per-step sums trainer.grpo_step reduces: the loss first, then the policy's metrics (and
    the importance weights' when `corrects`: Grpo.corrects)."""
    return ("loss", *POLICY_METRICS, *(("kl",) if settings.beta else ()), *(grpo_loss.IS_METRICS if corrects else ()))


def units(settings: GrpoConfig):
    """What one micro-batch counts towards the step's divisor (grpo_loss.loss_normaliser in another
    form): its completion tokens (dapo), its completions x max_completion_length (dr_grpo), or 1
    (grpo and bnpo are means over one micro-batch, averaged over the step's micro-batches, as TRL's)."""
    kind = settings.loss_type

    def count(batch: dict) -> int:
        if kind == "dapo":
            return int(batch["completion_mask"].sum())
        if kind == "dr_grpo":
            return batch["completion_mask"].size(0) * settings.max_completion_length
        return 1

    return count


@dataclass(frozen=True)
class Batch:
    """One micro-batch to train on: its rollout, advantages and (num_iterations > 1) sampling log-probs."""

    rollout: Rollout
    advantages: torch.Tensor
    completion_mask: torch.Tensor
    """The rollout's, with truncated completions left out under grpo.mask_truncated_completions."""
    old_logps: torch.Tensor | None

    @property
    def batch(self) -> dict:
        return {**self.rollout.batch, "completion_mask": self.completion_mask}


@dataclass
class Grpo:
    """A GRPO run's rollout state: the engine, the rewards, and the batch being trained on."""

    settings: GrpoConfig
    rewards: list[rewards.Reward]
    engine: Colocated | Remote
    seed: int
    chunk_tokens: int | str
    batches: list[Batch] = field(default_factory=list)
    stats: dict[str, float] = field(default_factory=dict)
    """The current batch's rollout metrics (rewards, lengths, generation speed), logged with each step on it."""
    drawn_at: int = 0
    shown: list[dict] = field(default_factory=list)
    """The first group of the current batch as (prompt, completion, reward) rows: what the run writes to samples."""
    prefetched: tuple[int, list[list[dict]]] | None = None
    """(step, prompt micro-batches) sent to the rollout node ahead of that step (`prefetch`)."""

    @property
    def corrects(self) -> bool:
        """Training batches come with their sampling policy's log-probs and the loss weighs them (TIS)."""
        return isinstance(self.engine, Remote) and self.engine.scores

    def prefetch(self, model, prompt_batches: list[list[dict]], *, step: int, env) -> None:
        """Send `step`'s micro-batches to the rollout node now (grpo.max_staleness: 1); `prompts_for`
        hands them to that step's `roll`, which then finds their completions generated."""
        self.engine.prefetch(model, prompt_batches, seeds=[seed_for(self.seed, step=step, micro_batch=i, rank=env.rank)
                                                           for i in range(len(prompt_batches))])
        self.prefetched = (step, prompt_batches)

    def may_prefetch(self, step: int, *, max_steps: int, save_every: int) -> bool:
        """Whether the batch of the step after `step` is fetched ahead while `step` trains: on a stale
        rollout node, when that step samples a new batch and `step` writes no checkpoint (so a resume
        finds nothing in flight; rollout_node's docstring)."""
        return (isinstance(self.engine, Remote) and self.engine.staleness > 0 and step < max_steps
                and not (save_every and step % save_every == 0) and step + 1 - self.drawn_at >= self.settings.num_iterations)

    def prompts_for(self, step: int, draw) -> list[list[dict]]:
        """The prompt micro-batches of `step`: those sent ahead for it, or `draw()`'s."""
        if self.prefetched is not None and self.prefetched[0] == step:
            batches, self.prefetched = self.prefetched[1], None
            return batches
        return draw()

    def state_dict(self, step: int) -> dict | None:
        """What a checkpoint after `step` keeps of this state: the batch when a later step still
        trains on it (grpo.num_iterations > 1, not yet used num_iterations times), so a resume in
        the middle of a batch repeats the uninterrupted run; None otherwise (the next step samples)."""
        if not self.batches or step + 1 - self.drawn_at >= self.settings.num_iterations:
            return None
        return {"drawn_at": self.drawn_at, "stats": self.stats, "shown": self.shown,
                "batches": [{"rollout": {f.name: getattr(b.rollout, f.name) for f in dataclasses.fields(b.rollout)},
                             "advantages": b.advantages, "completion_mask": b.completion_mask, "old_logps": b.old_logps}
                            for b in self.batches]}

    def load_state_dict(self, state: dict | None) -> None:
        """`state_dict`'s batch back (None: the first step of the resume samples a new one)."""
        if state is None:
            return
        self.drawn_at, self.stats, self.shown = state["drawn_at"], state["stats"], state["shown"]
        self.batches = [Batch(rollout=Rollout(**b["rollout"]), advantages=b["advantages"],
                              completion_mask=b["completion_mask"], old_logps=b["old_logps"]) for b in state["batches"]]

    def due(self, step: int) -> bool:
        """A new batch is sampled every num_iterations steps (and on the first step of a run or a resume)."""
        return not self.batches or step - self.drawn_at >= self.settings.num_iterations

    def due_to_show(self, step: int, *, last: bool) -> bool:
        """The first group's (prompt, completion, reward) rows are written every grpo.log_completions_every steps."""
        every = self.settings.log_completions_every
        return bool(every) and (step % every == 0 or last)

    def roll(self, model, prompt_batches: list[list[dict]], *, step: int, env) -> None:
        """Sample, score and weigh the step's micro-batches (module docstring); `batches` and `stats` after."""
        start = time.perf_counter()
        rolled = [self.engine.sample(model, rows, seed=seed_for(self.seed, step=step, micro_batch=i, rank=env.rank))
                  for i, rows in enumerate(prompt_batches)]
        generation_s = time.perf_counter() - start
        tables = [rewards.score(self.rewards, prompts=r.prompts, completions=r.completions,
                                completion_ids=r.completion_ids, columns=r.columns) for r in rolled]
        totals = [torch.tensor([math.nan if v is None else v for v in rewards.weighted_sum(t, self.rewards)],
                               dtype=torch.float64) for t in tables]
        std = _batch_std(torch.cat(totals), env) if self.settings.scale_rewards == "batch" else None
        batches = []
        for rollout, total in zip(rolled, totals, strict=True):
            adv = grpo_loss.advantages(total, num_generations=self.settings.num_generations,
                                       scale_rewards=self.settings.scale_rewards, batch_std=std)
            mask = rollout.completion_mask
            if self.settings.mask_truncated_completions:
                mask = mask * (~rollout.truncated).long().unsqueeze(1)
            batches.append(Batch(rollout=rollout, advantages=adv.float(), completion_mask=mask, old_logps=None))
        if self.settings.num_iterations > 1:  # the sampling policy's log-probs, for the ratios of later iterations
            with torch.no_grad():
                batches = [dataclasses.replace(b, old_logps=completion_logprobs(
                    model, b.batch, device=env.device, chunk_tokens=self.chunk_tokens,
                    temperature=self.settings.temperature).cpu()) for b in batches]
        self.batches, self.drawn_at = batches, step
        self.stats = _rollout_stats(rolled, tables, totals, self.rewards, env=env, generation_s=generation_s,
                                    num_generations=self.settings.num_generations) | self.engine.sync_stats()
        self.shown = [{"prompt": rewards.reward_builtins.text_of(p), "completion": rewards.reward_builtins.text_of(c),
                       "reward": None if math.isnan(r) else r}
                      for p, c, r in zip(rolled[0].prompts, rolled[0].completions, totals[0].tolist(), strict=True)
                      ][: self.settings.num_generations]


def progress_fields(metrics: dict) -> dict:
    """The progress bar's extra fields for a GRPO step: the mean reward and the generation's share of the wait."""
    if "reward" not in metrics:
        return {}
    return {"reward": f"{metrics['reward']:.3f}", "gen_s": f"{metrics['generation_s']:.1f}"}


def reference_logps(model, batch: dict, *, device, chunk_tokens, temperature: float) -> torch.Tensor:
    """The reference's log-probs (grpo.beta > 0): the same model with its adapters disabled, in eval
    mode (no second copy; a full fine-tune with beta > 0 is refused: rules/refusals.py)."""
    with torch.no_grad(), adapters_off(model, why="grpo.beta > 0 without adapters has no reference") as peft:
        return completion_logprobs(peft, batch, device=device, chunk_tokens=chunk_tokens, temperature=temperature)


def _batch_std(rewards_: torch.Tensor, env) -> torch.Tensor:
    """The Bessel-corrected std of every scored reward of the step on every rank (NaN: unscored, left out)."""
    seen = ~torch.isnan(rewards_)
    values = rewards_[seen]
    sums = comm.all_reduce_sum_tensor(torch.stack([seen.sum().double(), values.sum(), (values ** 2).sum()]), env).cpu()
    count, total, squares = sums.tolist()
    return torch.tensor(_std(total, squares, count), dtype=torch.float64)


def _rollout_stats(rolled: list[Rollout], tables, totals, funcs, *, env, generation_s: float,
                   num_generations: int) -> dict[str, float]:
    """The step's rollout metrics over every rank (TRL's names): the reward's mean and std and each
    function's, the share of groups whose rewards are all equal (they teach nothing: advantage 0),
    completion lengths and the truncated share, and generation's tokens per second."""
    total = torch.cat(totals)
    lengths = torch.cat([r.completion_mask.sum(dim=1) for r in rolled]).double()
    truncated = torch.cat([r.truncated for r in rolled]).double()
    groups = total.view(-1, num_generations)
    flat = total.nan_to_num(0.0)
    zero_std = ((groups.nan_to_num(0.0).amax(dim=1) - groups.nan_to_num(0.0).amin(dim=1)) == 0).double()
    parts = [torch.tensor(float(total.numel())), (~total.isnan()).sum().double(), flat.sum(), (flat ** 2).sum(),
             zero_std.sum(), torch.tensor(float(groups.size(0))), lengths.sum(), truncated.sum()]
    for k in range(len(funcs)):
        column = torch.tensor([row[k] for table in tables for row in table if row[k] is not None], dtype=torch.float64)
        parts += [torch.tensor(float(column.numel())), column.sum(), (column ** 2).sum()]
    sums = comm.all_reduce_sum_tensor(torch.stack(parts).double(), env).cpu().tolist()
    rows, scored, reward_sum, reward_sq, zero, num_groups, length_sum, truncated_sum = sums[:8]
    stats = {"reward": _mean(reward_sum, scored), "reward_std": _std(reward_sum, reward_sq, scored),
             "frac_reward_zero_std": zero / max(num_groups, 1.0),
             "completions/mean_length": length_sum / max(rows, 1.0),
             "completions/max_length": float(comm.all_reduce_max(int(lengths.max()), env)),
             "completions/clipped_ratio": truncated_sum / max(rows, 1.0)}
    for k, reward in enumerate(funcs):
        count, value_sum, value_sq = sums[8 + 3 * k: 11 + 3 * k]
        stats[f"rewards/{reward.label}/mean"] = _mean(value_sum, count)
        stats[f"rewards/{reward.label}/std"] = _std(value_sum, value_sq, count)
    stats["generation_s"] = float(comm.all_reduce_max(math.ceil(generation_s * 1000), env)) / 1000
    stats["generation_tokens_per_s"] = length_sum / max(stats["generation_s"], 1e-9)
    return stats


def _mean(total: float, count: float) -> float:
    return total / count if count else math.nan


def _std(total: float, squares: float, count: float) -> float:
    if count < 2:
        return math.nan
    return math.sqrt(max(squares - total * total / count, 0.0) / (count - 1))


def held_out_reward(grpo: Grpo, model, rows, *, env, batch_size: int, max_batches: int | None,
                    progress=None) -> dict[str, float]:
    """The mean reward of one greedy completion per held-out prompt (and each function's), over every
    rank: rows are dealt to ranks, each rank runs the same number of generations (FSDP2 needs every
    rank in every forward; a rank short of rows repeats its last one, which counts nothing)."""
    mine = list(range(env.rank, len(rows), env.world_size))
    per_rank = math.ceil(len(rows) / env.world_size)
    batches = math.ceil(per_rank / batch_size)
    if max_batches:
        batches = min(batches, max_batches)
    padded = (mine + [mine[-1] if mine else 0] * per_rank)[:per_rank]
    weights = [1.0] * len(mine) + [0.0] * (per_rank - len(mine))
    funcs = grpo.rewards
    sums = torch.zeros(2 + 2 * len(funcs), dtype=torch.float64)
    bar = progress(batches) if progress is not None else None
    for b in range(batches):
        index = padded[b * batch_size:(b + 1) * batch_size]
        rollout = grpo.engine.sample(model, [rows[i] for i in index], seed=0, greedy=True, num_generations=1)
        table = rewards.score(funcs, prompts=rollout.prompts, completions=rollout.completions,
                              completion_ids=rollout.completion_ids, columns=rollout.columns)
        for weight, values, total in zip(weights[b * batch_size:], table, rewards.weighted_sum(table, funcs), strict=False):
            if weight and total is not None:
                sums[0] += total
                sums[1] += 1
            for k, value in enumerate(values):
                if weight and value is not None:
                    sums[2 + 2 * k] += value
                    sums[3 + 2 * k] += 1
        if bar is not None:
            bar.update(1)
    if bar is not None:
        bar.close()
    sums = comm.all_reduce_sum_tensor(sums, env).cpu().tolist()
    out = {"eval_reward": _mean(sums[0], sums[1]), **grpo.engine.sync_stats()}
    for k, reward in enumerate(funcs):
        out[f"eval_rewards/{reward.label}/mean"] = _mean(sums[2 + 2 * k], sums[3 + 2 * k])
    return out


def for_run(recipe, tokenizer, *, env, base_dir, link=None) -> Grpo:
    """The run's GRPO state: its rewards resolved (preflight resolved them already; files are not run
    twice) and the engine: colocated, or with `link` (grpo.rollout=node) the rollout rank's."""
    from pathlib import Path

    settings = recipe.grpo
    funcs = rewards.resolve_rewards(settings.reward_funcs, weights=settings.reward_weights,
                                    recipe_dir=Path(base_dir) if base_dir is not None else Path.cwd())
    engine = Colocated(settings=settings, tokenizer=tokenizer, device=env.device, distributed=env.distributed)
    if link is not None:
        engine = Remote(local=engine, link=link, staleness=link.staleness)
    return Grpo(settings=settings, rewards=funcs, engine=engine, seed=recipe.train.seed,
                chunk_tokens=recipe.train.loss_chunk_tokens)
