"""The held-out passes: mean loss per trained token (SFT) or per pair (DPO), all ranks together.

Every rank runs the same number of forwards, because sharded forwards are collective (`_eval_batches`);
a pipelined rung's pass runs through its stages' schedule (`evaluate_pipeline`). The loop calls
these every `train.eval_every` steps and after the last one, with a progress bar (`progress`: what
makes one of a given total, the trainer's tqdm; one tick per forward) so a long pass is not silent.
"""

from __future__ import annotations

import torch

from homelab_ft.data import collate, collate_pairs
from homelab_ft.distributed import comm, parallelize
from homelab_ft.distributed.pipeline import Pipeline
from homelab_ft.labels import IGNORE_INDEX
from homelab_ft.recipe.config import Recipe
from homelab_ft.rung import Rung
from homelab_ft.train import preference, steps
from homelab_ft.train.loss import batch_loss_sum


@torch.no_grad()
def evaluate(model, rows, *, env, recipe: Recipe, pad_token_id: int, progress=None, pixels=None) -> float:
    """Mean loss per trained token over the held-out split, all ranks together (`pixels`: image rows'
    batcher, rows.collate).

    Every rank runs the same number of forward passes (sharded forwards are collective); a rank
    with no batch left re-runs its first one and counts nothing from it.
    """
    model.eval()
    loss_sum = torch.zeros((), device=env.device)
    tokens = 0
    for indices, real in _shown(list(_eval_batches(len(rows), recipe=recipe, env=env)), progress):
        mb = collate([rows[i] for i in indices], pad_token_id=pad_token_id, pixels=pixels)
        summed = batch_loss_sum(model, mb, device=env.device, chunk_tokens=recipe.train.loss_chunk_tokens,
                                compiled=recipe.train.compile)
        if real:
            loss_sum += summed
            tokens += steps.trained_tokens(mb["labels"])
    parallelize.reshard(model)
    total_tokens = comm.all_reduce_sum(tokens, env)
    return comm.all_reduce_sum(loss_sum, env) / max(total_tokens, 1)


@torch.no_grad()
def evaluate_pairs(model, rows, *, env, recipe: Recipe, pad_token_id: int, progress=None) -> tuple[float, dict]:
    """Mean DPO loss per held-out pair and the means of the other preference.METRICS (`eval_` keys),
    all ranks together, with evaluate's batch schedule (every rank runs the same forwards); KTO's
    through `evaluate_unpaired`."""
    if recipe.dpo.unpaired:
        return evaluate_unpaired(model, rows, env=env, recipe=recipe, pad_token_id=pad_token_id, progress=progress)
    model.eval()
    sums = torch.zeros(len(preference.METRICS), dtype=torch.float64)
    pairs = 0
    for indices, real in _shown(list(_eval_batches(len(rows), recipe=recipe, env=env)), progress):
        mb = collate_pairs([rows[i] for i in indices], pad_token_id=pad_token_id)
        reference = preference.reference_logps(model, mb, env.device) if recipe.dpo.needs_reference else None
        policy, num_tokens = preference.policy_logps(model, mb, env.device)
        _, stats = preference.pair_losses(policy, reference, num_tokens, recipe.dpo)
        if real:
            sums += stats.cpu()
            pairs += preference.num_pairs(mb)
    parallelize.reshard(model)  # no backward follows: free what FSDP2 left gathered
    means = (comm.all_reduce_sum_tensor(sums, env) / max(comm.all_reduce_sum(pairs, env), 1)).tolist()
    metrics = {f"eval_{k}": v for k, v in zip(preference.METRICS, means, strict=True)}
    return metrics.pop("eval_loss"), metrics


@torch.no_grad()
def evaluate_unpaired(model, rows, *, env, recipe: Recipe, pad_token_id: int, progress=None) -> tuple[float, dict]:
    """Mean KTO loss per held-out row and preference.KTO_METRICS (`eval_` keys), all ranks together.

    Per batch the completions and their mismatched completions are scored (policy and reference, a
    half at a time as in training); z0 is the mean over the whole held-out split, as a training step's over the step,
    so the losses are computed once every batch has been scored."""
    model.eval()
    scored, kl_sum, num_rows = [], 0.0, 0
    for indices, real in _shown(list(_eval_batches(len(rows), recipe=recipe, env=env)), progress):
        mb = collate_pairs([rows[i] for i in indices], pad_token_id=pad_token_id)
        reference, reference_kl = preference.kto_reference(model, mb, env.device)
        completions, mismatched = preference.halves(mb)
        policy = preference.policy_logps(model, completions, env.device)[0]
        policy_kl = preference.policy_logps(model, mismatched, env.device)[0]
        if real:
            kl_sum += float((policy_kl.double() - reference_kl.double()).sum())
            num_rows += preference.num_pairs(mb)
            scored.append((policy.double(), reference.double(), mb["label"]))
    parallelize.reshard(model)
    kl = preference.kto_reference_point(comm.all_reduce_sum(kl_sum, env), int(comm.all_reduce_sum(num_rows, env)))
    sums = torch.zeros(len(preference.KTO_SUMS), dtype=torch.float64)
    for policy, reference, desirable in scored:
        sums += preference.kto_losses(policy, reference, desirable, kl=kl, cfg=recipe.dpo)[1].cpu()
    means = dict(zip(preference.KTO_SUMS, comm.all_reduce_sum_tensor(sums, env).tolist(), strict=True))
    metrics = {"loss": means["loss"] / max(means["num_desirable"] + means["num_undesirable"], 1),
               **preference.kto_metrics(means, kl=kl)}
    metrics = {f"eval_{k}": v for k, v in metrics.items()}
    return metrics.pop("eval_loss"), metrics


@torch.no_grad()
def evaluate_pipeline(pipeline: Pipeline, rows, *, env, rung: Rung, recipe: Recipe, pad_token_id: int,
                      progress=None) -> float:
    """`evaluate` through a pipelined rung's stages (Pipeline.forward_only), all ranks together.

    The stages of one pipeline read the same rows, so the batches are dealt to the rung's
    data-parallel replicas, as training rows are. The schedule runs a fixed number of micro-batches
    (train.grad_accum_steps) of train.micro_batch_size rows, the shapes its stages' buffers were
    sized for: a short last batch is filled up with one of its rows and a short last round with
    one of the replica's batches, their labels all IGNORE_INDEX (they run, and count nothing).
    Every replica runs the same number of rounds; the loss is summed on the last stages.
    """
    pipeline.stage_module.model.eval()
    size, per_round = recipe.train.micro_batch_size, recipe.train.grad_accum_steps
    replicas = rung.data_parallel_size
    batches = _batch_rows(len(rows), recipe=recipe)
    mine = batches[env.rank % replicas::replicas]
    most = -(-len(batches) // replicas)  # the batches of the replica dealt the most
    rounds = -(-most // per_round)
    loss_sum = torch.zeros((), device=env.device)
    tokens = 0
    for r in _shown(range(rounds), progress):
        micro_batches = []
        for k in range(r * per_round, (r + 1) * per_round):
            indices, real = (mine[k], len(mine[k])) if k < len(mine) else ((mine or batches)[0], 0)
            mb = collate([rows[i] for i in indices + indices[:1] * (size - len(indices))], pad_token_id=pad_token_id)
            mb["labels"][real:] = IGNORE_INDEX
            tokens += steps.trained_tokens(mb["labels"])
            micro_batches.append(mb)
        loss_sum += pipeline.forward_only(micro_batches, device=env.device)
    total_tokens = comm.all_reduce_sum(tokens if pipeline.last else 0, env)
    return comm.all_reduce_sum(loss_sum, env) / max(total_tokens, 1)


def _batch_rows(num_rows: int, *, recipe: Recipe) -> list[list[int]]:
    """The held-out split cut into micro-batches of row indices, in order, at most train.eval_max_batches."""
    size = recipe.train.micro_batch_size
    batches = [list(range(i, min(i + size, num_rows))) for i in range(0, num_rows, size)]
    if recipe.train.eval_max_batches:
        batches = batches[: recipe.train.eval_max_batches]
    return batches


def _shown(forwards, progress):
    """`forwards` (a list or range) under the bar `progress(total)` makes, one tick after each and
    closed after the last; `progress` None: no bar."""
    if progress is None:
        yield from forwards
        return
    bar = progress(len(forwards))
    try:
        for item in forwards:
            yield item
            bar.update(1)
    finally:
        bar.close()


def _eval_batches(num_rows: int, *, recipe: Recipe, env):
    """(row indices, counts) for this rank's eval forwards. Every rank runs the same number of
    forwards (sharded forwards are collective); a rank with no batch left re-runs one of the
    first ones and counts nothing from it."""
    batches = _batch_rows(num_rows, recipe=recipe)
    for r in range(-(-len(batches) // env.world_size)):
        index = r * env.world_size + env.rank
        real = index < len(batches)
        yield batches[index if real else env.rank % len(batches)], real
