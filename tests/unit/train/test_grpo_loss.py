"""grpo_loss.py against the papers' formulas written out naively (Python loops over completions and
tokens, float64): the loss and its gradient w.r.t. the log-probs for every loss_type, GSPO's
sequence-level ratio and the KL term, on a batch where both clip bounds bite; and the advantages."""

from __future__ import annotations

import math

import pytest
import torch

from homelab_ft.recipe.objectives import GRPO_LOSS_TYPES, SCALE_REWARDS, GrpoConfig
from homelab_ft.train import grpo_loss

TOL = 1e-6
EPS_LOW, EPS_HIGH, MAX_LEN = 0.2, 0.28, 6

# Four completions of up to 6 tokens: one empty (all padding), one of one token.
MASK = torch.tensor([[1, 1, 1, 1, 1, 1],
                     [1, 1, 1, 0, 0, 0],
                     [1, 0, 0, 0, 0, 0],
                     [0, 0, 0, 0, 0, 0]], dtype=torch.float64)
ADVANTAGES = torch.tensor([1.3, -0.7, 0.4, -1.1], dtype=torch.float64)
# logp - old_logp per token: ratios of 0.61 and 0.90 (below 1 - 0.2 only the first), 1.05, 1.35
# and 1.82 (above 1 + 0.28): with advantages of both signs both bounds clip some tokens.
LOG_RATIO = torch.tensor([[-0.5, 0.3, 0.05, 0.6, -0.1, 0.3],
                          [-0.5, 0.6, -0.1, 0.0, 0.0, 0.0],
                          [0.3, 0.0, 0.0, 0.0, 0.0, 0.0],
                          [0.0, 0.0, 0.0, 0.0, 0.0, 0.0]], dtype=torch.float64)


def _batch():
    g = torch.Generator().manual_seed(0)
    logps = -torch.rand(4, 6, generator=g, dtype=torch.float64) * 3 - 0.1
    old = logps - LOG_RATIO
    ref = logps + torch.randn(4, 6, generator=g, dtype=torch.float64) * 0.3
    return logps, old, ref


def _naive(logps, old, ref, *, loss_type, sequence, beta):
    """The papers' objective, one completion and one token at a time."""
    total, tokens = 0.0, 0
    lengths = [int(MASK[i].sum()) for i in range(4)]
    per_seq = []
    for i in range(4):
        a, n = float(ADVANTAGES[i]), lengths[i]
        if sequence:  # GSPO eq. 7: s_i = exp(mean over the completion's tokens of the log-ratio)
            s = torch.exp(sum((logps[i, t] - old[i, t] for t in range(n)), torch.zeros((), dtype=torch.float64))
                          / max(n, 1))
        seq = torch.zeros((), dtype=torch.float64)
        for t in range(n):
            r = s if sequence else torch.exp(logps[i, t] - old[i, t])
            clipped = torch.clamp(r, 1 - EPS_LOW, 1 + EPS_HIGH)
            term = -torch.min(r * a, clipped * a)
            if beta:
                d = ref[i, t] - logps[i, t]
                term = term + beta * (torch.exp(d) - d - 1)
            seq = seq + term
        per_seq.append(seq)
        total = total + seq
        tokens += n
    if loss_type == "grpo":  # GRPO: mean over each completion's tokens, then over completions
        return sum(s / max(n, 1) for s, n in zip(per_seq, lengths, strict=True)) / 4
    if loss_type in ("dapo", "bnpo"):  # DAPO eq. 12: over every token of the batch
        return total / tokens
    return total / (4 * MAX_LEN)  # Dr. GRPO: a constant, completions x max_completion_length


def _ours(logps, old, ref, *, loss_type, sequence, beta):
    settings = GrpoConfig(loss_type=loss_type, epsilon=EPS_LOW, epsilon_high=EPS_HIGH, beta=beta,
                        importance_sampling_level="sequence" if sequence else "token")
    norm = grpo_loss.loss_normaliser(loss_type, num_tokens=int(MASK.sum()), num_sequences=4,
                                     max_completion_length=MAX_LEN, num_micro_batches=1, world_size=1)
    return grpo_loss.policy_loss(logps, old_logps=old, ref_logps=ref if beta else None, mask=MASK,
                                 advantages=ADVANTAGES, settings=settings, normaliser=norm)


def _value_and_grad(fn, **kw):
    logps, old, ref = _batch()
    logps.requires_grad_(True)
    out = fn(logps, old, ref, **kw)
    loss = out[0] if isinstance(out, tuple) else out
    (grad,) = torch.autograd.grad(loss, logps)
    return float(loss.detach()), grad, out


@pytest.mark.parametrize("loss_type", GRPO_LOSS_TYPES)
@pytest.mark.parametrize("sequence,beta", [(False, 0.0), (True, 0.0), (False, 0.04), (True, 0.04)])
def test_loss_and_gradient_match_the_papers(loss_type, sequence, beta):
    want, want_grad, _ = _value_and_grad(_naive, loss_type=loss_type, sequence=sequence, beta=beta)
    got, got_grad, (_, metrics) = _value_and_grad(_ours, loss_type=loss_type, sequence=sequence, beta=beta)
    assert abs(got - want) <= TOL, (got, want)
    assert float((got_grad - want_grad).abs().max()) <= TOL
    assert float(want_grad[MASK == 0].abs().max()) == 0.0 and float(want_grad.abs().max()) > 0
    if not sequence:  # the batch really has both bounds clipping
        assert float(metrics["clip_ratio/low_mean"]) > 0 and float(metrics["clip_ratio/high_mean"]) > 0
    assert ("kl" in metrics) == bool(beta)


def test_the_clip_metrics_count_tokens():
    *_, (_, metrics) = _value_and_grad(_ours, loss_type="dapo", sequence=False, beta=0.04)
    # low: ratio 0.61 with A < 0 (row 1, token 0); high: ratios 1.35, 1.35, 1.82 with A > 0 (row 0),
    # 1.35 (row 2). Ten completion tokens.
    assert float(metrics["clip_ratio/low_mean"]) == pytest.approx(1 / 10)
    assert float(metrics["clip_ratio/high_mean"]) == pytest.approx(4 / 10)
    assert float(metrics["clip_ratio/region_mean"]) == pytest.approx(5 / 10)
    logps, _, ref = _batch()
    d = (ref - logps)[MASK == 1]
    assert float(metrics["kl"]) == pytest.approx(float((torch.exp(d) - d - 1).mean()))


def test_without_old_logps_the_ratio_is_one_and_the_gradient_the_policy_gradient():
    logps, _, _ = _batch()
    logps.requires_grad_(True)
    settings = GrpoConfig(loss_type="dapo")
    loss, metrics = grpo_loss.policy_loss(logps, old_logps=None, ref_logps=None, mask=MASK,
                                          advantages=ADVANTAGES, settings=settings, normaliser=10.0)
    (grad,) = torch.autograd.grad(loss, logps)
    assert float(loss) == pytest.approx(-float((ADVANTAGES[:, None] * MASK).sum()) / 10)
    assert torch.allclose(grad, -ADVANTAGES[:, None] * MASK / 10)
    assert float(metrics["clip_ratio/region_mean"]) == 0.0


def test_epsilon_high_defaults_to_epsilon():
    assert GrpoConfig(epsilon=0.3).epsilon_upper == 0.3
    assert GrpoConfig(epsilon=0.2, epsilon_high=0.28).epsilon_upper == 0.28


def test_beta_needs_the_reference():
    logps, old, _ = _batch()
    with pytest.raises(ValueError, match="ref_logps"):
        grpo_loss.policy_loss(logps, old_logps=old, ref_logps=None, mask=MASK, advantages=ADVANTAGES,
                              settings=GrpoConfig(beta=0.1), normaliser=1.0)


def test_the_step_normaliser_makes_micro_batches_and_ranks_one_batch():
    """dapo over two micro-batches on two ranks, each divided by the step's normaliser and the ranks
    averaged (what DDP does), equals the loss of all four completions at once."""
    logps, old, _ = _batch()
    settings = GrpoConfig(loss_type="dapo", epsilon=EPS_LOW, epsilon_high=EPS_HIGH)
    whole, _ = grpo_loss.policy_loss(logps, old_logps=old, ref_logps=None, mask=MASK, advantages=ADVANTAGES,
                                     settings=settings, normaliser=float(MASK.sum()))
    for loss_type, want in (("dapo", whole), ("dr_grpo", whole * MASK.sum() / (4 * MAX_LEN))):
        settings = GrpoConfig(loss_type=loss_type, epsilon=EPS_LOW, epsilon_high=EPS_HIGH)
        norm = grpo_loss.loss_normaliser(loss_type, num_tokens=int(MASK.sum()), num_sequences=4,
                                         max_completion_length=MAX_LEN, num_micro_batches=1, world_size=2)
        ranks = [sum(grpo_loss.policy_loss(logps[i:i + 1], old_logps=old[i:i + 1], ref_logps=None,
                                           mask=MASK[i:i + 1], advantages=ADVANTAGES[i:i + 1],
                                           settings=settings, normaliser=norm)[0] for i in rows)
                 for rows in ((0, 1), (2, 3))]
        assert float(sum(ranks) / 2) == pytest.approx(float(want), abs=TOL)
    assert grpo_loss.loss_normaliser("grpo", num_tokens=10, num_sequences=4, max_completion_length=6,
                                     num_micro_batches=3, world_size=2) == 3.0


# Advantages ------------------------------------------------------------------------------------------

REWARDS = torch.tensor([1.0, 0.0, 0.0, 1.0, 2.0, 2.0, 2.0, 2.0, 0.5, 1.5, 3.0, 1.0], dtype=torch.float64)


def _std(values):
    m = sum(values) / len(values)
    return math.sqrt(sum((v - m) ** 2 for v in values) / (len(values) - 1))


@pytest.mark.parametrize("scale", SCALE_REWARDS)
def test_advantages_subtract_the_group_mean_and_scale(scale):
    got = grpo_loss.advantages(REWARDS, num_generations=4, scale_rewards=scale).tolist()
    rewards = REWARDS.tolist()
    batch_std = _std(rewards)
    for g in range(3):
        group = rewards[4 * g:4 * g + 4]
        mean = sum(group) / 4
        for k, r in enumerate(group):
            std = {"group": _std(group), "batch": batch_std, "none": None}[scale]
            want = (r - mean) if std is None else (r - mean) / (std + 1e-4)
            assert got[4 * g + k] == pytest.approx(want, abs=1e-12)


def test_a_group_of_equal_rewards_has_zero_advantage():
    got = grpo_loss.advantages(REWARDS, num_generations=4, scale_rewards="group")
    assert got[4:8].tolist() == [0.0] * 4


def test_unscored_rows_are_left_out_and_get_zero():
    rewards = torch.tensor([1.0, float("nan"), 0.0, 2.0])
    got = grpo_loss.advantages(rewards, num_generations=4, scale_rewards="group").tolist()
    std = _std([1.0, 0.0, 2.0])
    assert got == pytest.approx([0.0, 0.0, -1 / (std + 1e-4), 1 / (std + 1e-4)], abs=1e-6)
    one_scored = torch.tensor([float("nan"), 3.0])  # std of one value is undefined: no signal
    assert grpo_loss.advantages(one_scored, num_generations=2, scale_rewards="group").tolist() == [0.0, 0.0]


def test_advantages_need_whole_groups():
    with pytest.raises(ValueError, match="whole groups"):
        grpo_loss.advantages(REWARDS[:10], num_generations=4, scale_rewards="group")
    with pytest.raises(ValueError, match="scale_rewards"):
        grpo_loss.advantages(REWARDS, num_generations=4, scale_rewards="rank")


# The sampling policy's log-probs mu, a step behind `old` (a rollout node with grpo.max_staleness 1):
# old - mu per token gives ratios from 0.27 to 4.5, so a cap of 3 truncates (or masks) some tokens.
STALE = torch.tensor([[0.2, -0.4, 1.5, 0.0, -1.3, 0.7],
                      [1.2, 0.1, -0.2, 0.0, 0.0, 0.0],
                      [-0.6, 0.0, 0.0, 0.0, 0.0, 0.0],
                      [0.0, 0.0, 0.0, 0.0, 0.0, 0.0]], dtype=torch.float64)
CAP = 3.0


def _tis_weight(old, mu, i, t, *, mode):
    """Yao et al.'s truncated importance weight of token t of completion i (or of the whole completion)."""
    n = int(MASK[i].sum())
    if mode.startswith("sequence"):
        w = torch.exp(sum((old[i, k] - mu[i, k] for k in range(n)), torch.zeros((), dtype=torch.float64)))
    else:
        w = torch.exp(old[i, t] - mu[i, t])
    if mode.endswith("truncate"):
        return torch.clamp(w, max=CAP)
    return w if w <= CAP else torch.zeros_like(w)


def _naive_tis(logps, old, ref, *, loss_type, beta, mode):
    """DAPO's / GRPO's clipped loss with each token's term weighted by its truncated importance
    weight before the KL is added (TRL's order), one completion and one token at a time."""
    mu = old - STALE
    per_seq, lengths = [], [int(MASK[i].sum()) for i in range(4)]
    for i in range(4):
        a, seq = float(ADVANTAGES[i]), torch.zeros((), dtype=torch.float64)
        for t in range(lengths[i]):
            r = torch.exp(logps[i, t] - old[i, t])
            term = -torch.min(r * a, torch.clamp(r, 1 - EPS_LOW, 1 + EPS_HIGH) * a) * _tis_weight(old, mu, i, t, mode=mode)
            if beta:
                d = ref[i, t] - logps[i, t]
                term = term + beta * (torch.exp(d) - d - 1)
            seq = seq + term
        per_seq.append(seq)
    if loss_type == "grpo":
        return sum(s / max(n, 1) for s, n in zip(per_seq, lengths, strict=True)) / 4
    return sum(per_seq) / sum(lengths)


def _ours_tis(logps, old, ref, *, loss_type, beta, mode, correct=True, mu=None):
    settings = GrpoConfig(loss_type=loss_type, epsilon=EPS_LOW, epsilon_high=EPS_HIGH, beta=beta, max_staleness=1,
                          rollout="node", vllm_importance_sampling_mode=mode, vllm_importance_sampling_cap=CAP,
                          vllm_importance_sampling_correction=correct)
    norm = grpo_loss.loss_normaliser(loss_type, num_tokens=int(MASK.sum()), num_sequences=4,
                                     max_completion_length=MAX_LEN, num_micro_batches=1, world_size=1)
    return grpo_loss.policy_loss(logps, old_logps=old, ref_logps=ref if beta else None, mask=MASK,
                                 advantages=ADVANTAGES, settings=settings, normaliser=norm,
                                 sampling_logps=old - STALE if mu is None else mu(old))


@pytest.mark.parametrize("mode", ["token_truncate", "token_mask", "sequence_truncate", "sequence_mask"])
@pytest.mark.parametrize("loss_type,beta", [("dapo", 0.0), ("grpo", 0.04)])
def test_truncated_importance_sampling_matches_the_paper(mode, loss_type, beta):
    want, want_grad, _ = _value_and_grad(_naive_tis, loss_type=loss_type, beta=beta, mode=mode)
    got, got_grad, (_, metrics) = _value_and_grad(_ours_tis, loss_type=loss_type, beta=beta, mode=mode)
    assert abs(got - want) <= TOL, (got, want)
    assert float((got_grad - want_grad).abs().max()) <= TOL
    _, old, _ = _batch()
    mu = old - STALE
    if mode.startswith("token"):  # the batch has tokens on both sides of the cap
        ratios = torch.exp(STALE)[MASK.bool()]
        assert bool((ratios > CAP).any()) and bool((ratios < 1).any())
        weights = [float(_tis_weight(old, mu, i, t, mode=mode)) for i in range(4) for t in range(int(MASK[i].sum()))]
        assert float(metrics["sampling/importance_sampling_ratio/mean"]) == pytest.approx(sum(weights) / len(weights))
    assert float(metrics["sampling/sampling_logp_difference/mean"]) == pytest.approx(
        float(STALE.abs()[MASK.bool()].mean()))


def test_a_fresh_batch_or_the_correction_off_leaves_the_loss_as_it_was():
    plain, plain_grad, _ = _value_and_grad(_ours, loss_type="dapo", sequence=False, beta=0.0)
    fresh, fresh_grad, (_, metrics) = _value_and_grad(_ours_tis, loss_type="dapo", beta=0.0, mode="token_truncate",
                                                      mu=lambda old: old.clone())
    off, off_grad, (_, off_metrics) = _value_and_grad(_ours_tis, loss_type="dapo", beta=0.0, mode="token_truncate",
                                                      correct=False)
    assert fresh == pytest.approx(plain, abs=1e-12) and off == pytest.approx(plain, abs=1e-12)
    assert torch.allclose(fresh_grad, plain_grad, atol=1e-12) and torch.allclose(off_grad, plain_grad, atol=1e-12)
    assert float(metrics["sampling/importance_sampling_ratio/mean"]) == 1.0
    assert "sampling/importance_sampling_ratio/mean" not in off_metrics
