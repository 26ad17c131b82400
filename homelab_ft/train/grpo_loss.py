"""GRPO's arithmetic: advantages from rewards, and the clipped policy loss over completion tokens.

Names and semantics are TRL 1.16's `GRPOTrainer` (`scale_rewards`, `epsilon`, `epsilon_high`,
`beta`, `loss_type`, `importance_sampling_level`), so a recipe moved from TRL trains the same loss:

- GRPO (DeepSeekMath, Shao et al. 2024, arXiv:2402.03300, eq. 3 and 21): the advantage of a
  completion is its reward minus the mean reward of the `num_generations` completions sampled for
  the same prompt, divided by their standard deviation; the loss is PPO's clipped surrogate
  (Schulman et al. 2017, arXiv:1707.06347) averaged over each completion's tokens, then over the
  completions, with the k3 estimator of KL(pi || pi_ref) (Schulman 2020, "Approximating KL
  divergence") added per token with weight `beta`.
- Dr. GRPO (Liu et al. 2025, arXiv:2503.20783, sec. 3.1): dividing by each completion's own length
  and by the group's std biases the update (long wrong answers are penalised less per token;
  questions of very low or high difficulty weigh more): the token sum is divided by a constant,
  completions x `max_completion_length`, and `scale_rewards="none"` drops the std.
- DAPO (Yu et al. 2025, arXiv:2503.14476): "clip-higher" (eq. 10) lets the upper clip bound
  `epsilon_high` exceed the lower `epsilon`, and the loss is token-level (eq. 12): the sum over every
  completion token of the batch divided by their number, so each token weighs the same whatever
  its completion's length. TRL's default `loss_type`.
- "bnpo" (TRL's, batch-normalised): the same token sum divided by this micro-batch's own completion
  tokens, so it varies with the micro-batch size (TRL's docs note it; with one completion per
  micro-batch it is "grpo").
- GSPO (Zheng et al. 2025, arXiv:2507.18071, eq. 7): `importance_sampling_level="sequence"` uses one
  ratio per completion, exp of the mean over its tokens of logp - old_logp, clipped as a whole.

- Truncated importance sampling (Yao et al. 2025, "Your Efficient RL Framework Secretly Brings You
  Off-Policy RL Training", fengyao.notion.site/off-policy-rl; TRL's `vllm_importance_sampling_*`):
  when the completions were sampled by an older policy mu (a rollout node one step behind,
  grpo.max_staleness: 1) the clipped per-token loss is weighted by min(pi_old / mu, C) per token
  (`token_truncate`), or that ratio zeroed above C (`token_mask`), or one ratio per completion,
  exp of its summed log-ratio (`sequence_*`); the KL term is not weighted (TRL's order).

How the losses are normalised over a step decides their gradient: `loss_normaliser` is the one
place that says what each micro-batch's loss is divided by, from the counts of the whole step (all
ranks, all accumulation micro-batches), as `steps.loss_scale` does for SFT.
"""

from __future__ import annotations

import torch

from homelab_ft.recipe.objectives import GRPO_LOSS_TYPES, IS_CORRECTION_MODES, SCALE_REWARDS, GrpoConfig

IS_METRICS = ("sampling/importance_sampling_ratio/mean", "sampling/sampling_logp_difference/mean")
"""policy_loss's metrics when it corrects a stale batch (TRL's names)."""

STD_EPS = 1e-4
"""Added to the reward std before dividing (TRL's constant): a group whose rewards are all equal gets
advantages of 0 instead of 0 / 0."""


def advantages(rewards: torch.Tensor, *, num_generations: int, scale_rewards: str,
               batch_std: torch.Tensor | None = None) -> torch.Tensor:
    """Each completion's advantage from the rewards of a batch of whole groups ([N], N a multiple of
    `num_generations`, the completions of one prompt consecutive, as TRL samples them).

    The group's mean is subtracted; `scale_rewards` then divides by the group's std ("group",
    GRPO), by the std of the whole batch ("batch", which TRL cites from the PPO Lite paper,
    arXiv:2508.08221: a group whose rewards barely differ is not blown up to unit variance), or by
    nothing ("none", Dr. GRPO). A NaN reward (every reward function returned None for the row:
    `rewards.weighted_sum`) is left out of the means and stds and its advantage is 0, TRL's rule.
    Stds are Bessel-corrected (torch.std's). `batch_std`: the "batch" std when the batch is larger
    than `rewards` (every micro-batch of the step on every rank: grpo._batch_std); default theirs.
    """
    if scale_rewards not in SCALE_REWARDS:
        raise ValueError(f"scale_rewards={scale_rewards!r}: one of {SCALE_REWARDS}")
    if rewards.dim() != 1 or rewards.numel() % num_generations:
        raise ValueError(f"{tuple(rewards.shape)} rewards are not whole groups of {num_generations}")
    grouped = rewards.view(-1, num_generations)
    centred = (grouped - torch.nanmean(grouped, dim=1, keepdim=True)).reshape(-1)
    if scale_rewards == "group":
        std = _nanstd(grouped, dim=1).repeat_interleave(num_generations)
    elif scale_rewards == "batch":
        std = (_nanstd(rewards, dim=0) if batch_std is None else batch_std.to(rewards.dtype)).expand_as(rewards)
    else:
        std = None
    out = centred if std is None else centred / (std + STD_EPS)
    return torch.nan_to_num(out, nan=0.0)


def _nanstd(x: torch.Tensor, *, dim: int) -> torch.Tensor:
    """The Bessel-corrected std ignoring NaNs; NaN where fewer than two values remain (TRL's nanstd)."""
    count = (~torch.isnan(x)).sum(dim=dim, keepdim=True)
    var = torch.nanmean((x - torch.nanmean(x, dim=dim, keepdim=True)) ** 2, dim=dim, keepdim=True)
    var = torch.where(count > 1, var * count / (count - 1).clamp(min=1), torch.full_like(var, float("nan")))
    return var.sqrt().squeeze(dim)


def loss_normaliser(loss_type: str, *, num_tokens: int, num_sequences: int, max_completion_length: int,
                    num_micro_batches: int, world_size: int) -> float:
    """What each micro-batch's loss from `policy_loss` is divided by, so that the gradient summed over
    a step's micro-batches and averaged over ranks (DDP, FSDP2) is the loss of the whole step.

    `num_tokens` and `num_sequences` are the completion tokens and completions of the whole step
    (every rank, every micro-batch). "dapo" sums its tokens and divides by every token of the step;
    "dr_grpo" divides its sum by completions x max_completion_length; the ranks' average is undone
    by the world size as in `steps.loss_scale`. "grpo" and "bnpo" are means over one micro-batch's own
    completions or tokens, and TRL averages them over the step's micro-batches: divided by their number.
    """
    if loss_type == "dapo":
        return max(num_tokens, 1) / world_size
    if loss_type == "dr_grpo":
        return max(num_sequences * max_completion_length, 1) / world_size
    if loss_type in ("grpo", "bnpo"):
        return float(num_micro_batches)
    raise ValueError(f"loss_type={loss_type!r}: one of {GRPO_LOSS_TYPES}")


def importance_weights(old_logps: torch.Tensor, sampling_logps: torch.Tensor, mask: torch.Tensor, *, mode: str,
                       cap: float) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Truncated importance weights of completions sampled by mu and trained as pi_old's (module
    docstring): [B, T] per token, [B, 1] per completion for the `sequence_*` modes; no gradient.
    Metrics: the weights' mean over completion tokens (completions), and mean |log pi_old - log mu|."""
    if mode not in IS_CORRECTION_MODES:
        raise ValueError(f"vllm_importance_sampling_mode={mode!r}: one of {IS_CORRECTION_MODES}")
    mask = mask.to(old_logps.dtype)
    delta = (old_logps.detach() - sampling_logps.to(old_logps.dtype)) * mask
    if mode.startswith("sequence"):
        delta_seq = delta.sum(-1, keepdim=True)
        ratio = torch.exp(delta_seq)
    else:
        ratio = torch.exp(delta)
    weights = ratio.clamp(max=cap) if mode.endswith("truncate") else ratio.masked_fill(ratio > cap, 0.0)
    metrics = {IS_METRICS[0]: _masked_mean(weights, mask), IS_METRICS[1]: _masked_mean(delta.abs(), mask)}
    return weights, metrics


def policy_loss(logps: torch.Tensor, *, old_logps: torch.Tensor | None, ref_logps: torch.Tensor | None,
                mask: torch.Tensor, advantages: torch.Tensor, settings: GrpoConfig,
                normaliser: float, sampling_logps: torch.Tensor | None = None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The GRPO loss of one micro-batch, and its metrics (TRL's names, detached, means over this
    micro-batch's completion tokens; over its completions for sequence-level ratios).

    `logps`, `old_logps`, `ref_logps` and `mask` are [B, T] over completion positions (the log-probs
    from `loss.completion_logprobs`; `mask` 1 on real completion tokens), `advantages` [B].
    `old_logps` None (num_iterations == 1: the batch was sampled by these very weights) is
    `logps.detach()`: every ratio is 1 and the gradient is the plain policy gradient. `ref_logps` is
    needed when `settings.beta` > 0; `settings` is the recipe's `grpo` section (loss_type, epsilon,
    epsilon_high, beta, importance_sampling_level). `normaliser` comes from `loss_normaliser`: 1 for one
    micro-batch of "grpo"/"bnpo", its completion tokens for "dapo", B x max_completion_length
    for "dr_grpo". `sampling_logps` [B, T]: the log-probs under the policy that sampled the batch when
    it may be older than `old_logps`' (a rollout node one step behind): with
    `settings.vllm_importance_sampling_correction` the clipped loss is weighted by
    `importance_weights`, and its metrics join the others.
    """
    mask = mask.to(logps.dtype)
    old_logps = logps.detach() if old_logps is None else old_logps
    adv = advantages.to(logps.dtype).unsqueeze(1)
    log_ratio = logps - old_logps
    if settings.importance_sampling_level == "sequence":  # GSPO: one ratio per completion, [B, 1]
        log_ratio = ((log_ratio * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).unsqueeze(1)
    ratio = torch.exp(log_ratio)
    low, high = 1 - settings.epsilon, 1 + settings.epsilon_upper
    per_token = -torch.min(ratio * adv, torch.clamp(ratio, low, high) * adv)
    metrics = {}
    if sampling_logps is not None and settings.vllm_importance_sampling_correction:
        weights, is_metrics = importance_weights(old_logps, sampling_logps, mask,
                                                 mode=settings.vllm_importance_sampling_mode,
                                                 cap=settings.vllm_importance_sampling_cap)
        per_token = per_token * weights
        metrics.update(is_metrics)
    if settings.beta != 0.0:
        if ref_logps is None:
            raise ValueError("beta > 0 needs the reference model's log-probs (ref_logps)")
        delta = ref_logps - logps
        kl = torch.exp(delta) - delta - 1  # k3 (Schulman 2020): >= 0, low variance
        per_token = per_token + settings.beta * kl
        metrics["kl"] = _masked_mean(kl.detach(), mask)
    summed = (per_token * mask).sum(-1)  # a [B, 1] sequence-level loss counts once per token, as in TRL
    if settings.loss_type == "grpo":
        loss = (summed / mask.sum(-1).clamp(min=1.0)).mean()
    elif settings.loss_type == "bnpo":
        loss = summed.sum() / mask.sum().clamp(min=1.0)
    else:  # dapo, dr_grpo: the step's normaliser divides the plain sum
        loss = summed.sum()
    with torch.no_grad():
        low_clipped = ((ratio < low) & (adv < 0)).to(logps.dtype)
        high_clipped = ((ratio > high) & (adv > 0)).to(logps.dtype)
        metrics["clip_ratio/low_mean"] = _masked_mean(low_clipped, mask)
        metrics["clip_ratio/high_mean"] = _masked_mean(high_clipped, mask)
        metrics["clip_ratio/region_mean"] = _masked_mean(torch.maximum(low_clipped, high_clipped), mask)
    return loss / normaliser, metrics


def _masked_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    if x.size(1) == 1:  # one value per completion (sequence-level ratios)
        return x.mean()
    return (x * mask).sum() / mask.sum().clamp(min=1.0)
