"""ORPO and SimPO (dpo.loss: orpo | simpo): loss and gradients on a fixed batch equal the papers'
formulas written out directly, and no reference is asked for."""

from __future__ import annotations

import math

import pytest
import torch

from homelab_ft.recipe.objectives import DpoConfig
from homelab_ft.train import preference

# 3 pairs: summed log-probs of the chosen rows, then the rejected ones, and their token counts
POLICY = torch.tensor([-12.0, -30.5, -7.25, -15.0, -29.0, -20.0], dtype=torch.float64)
TOKENS = torch.tensor([6, 10, 5, 5, 12, 8])


def _direct_orpo(logps, tokens, beta):
    """Hong et al. 2024, eq. 4, 6, 7: P(y|x) = exp(mean log p); L = L_SFT + lambda * L_OR."""
    out = []
    for i in range(3):
        lw, ll = logps[i] / tokens[i], logps[i + 3] / tokens[i + 3]
        odds_w = torch.exp(lw) / (1 - torch.exp(lw))
        odds_l = torch.exp(ll) / (1 - torch.exp(ll))
        l_or = -torch.log(torch.sigmoid(torch.log(odds_w / odds_l)))
        out.append(-lw + beta * l_or)
    return torch.stack(out)


def _direct_simpo(logps, tokens, beta, gamma):
    """Meng et al. 2024, eq. 6: -log sigmoid(beta/|y_w| log pi(y_w|x) - beta/|y_l| log pi(y_l|x) - gamma)."""
    return torch.stack([-torch.log(torch.sigmoid(beta / tokens[i] * logps[i] - beta / tokens[i + 3] * logps[i + 3] - gamma))
                        for i in range(3)])


@pytest.mark.parametrize(("cfg", "direct"), [
    (DpoConfig(loss="orpo", beta=0.1), lambda p, t: _direct_orpo(p, t, 0.1)),
    (DpoConfig(loss="orpo", beta=0.7), lambda p, t: _direct_orpo(p, t, 0.7)),
    (DpoConfig(loss="simpo", beta=2.0, simpo_gamma=1.0), lambda p, t: _direct_simpo(p, t, 2.0, 1.0)),
    (DpoConfig(loss="simpo", beta=2.5, simpo_gamma=0.5), lambda p, t: _direct_simpo(p, t, 2.5, 0.5)),
])
def test_loss_and_gradients_equal_the_papers_formula(cfg, direct):
    ours_in = POLICY.clone().requires_grad_()
    ref_in = POLICY.clone().requires_grad_()
    losses, stats = preference.pair_losses(ours_in, None, TOKENS, cfg)
    expected = direct(ref_in, TOKENS.double())
    torch.testing.assert_close(losses, expected, atol=1e-6, rtol=0)
    losses.sum().backward()
    expected.sum().backward()
    torch.testing.assert_close(ours_in.grad, ref_in.grad, atol=1e-6, rtol=0)
    assert not cfg.needs_reference
    # the rewards reported: beta x mean log-prob per token (TRL's ORPO/CPO), the accuracy their order
    avg = POLICY / TOKENS
    names = dict(zip(preference.METRICS, stats.tolist(), strict=True))
    assert names["reward_chosen"] == pytest.approx(cfg.beta * float(avg[:3].sum()))
    assert names["reward_accuracy"] == float((avg[:3] > avg[3:]).sum())


def test_simpo_label_smoothing_mixes_in_the_flipped_pair():
    cfg = DpoConfig(loss="simpo", beta=2.0, simpo_gamma=0.5, label_smoothing=0.2)
    losses, _ = preference.pair_losses(POLICY, None, TOKENS, cfg)
    avg = POLICY / TOKENS
    margin = 2.0 * (avg[:3] - avg[3:]) - 0.5
    expected = [-(0.8 * math.log(1 / (1 + math.exp(-m))) + 0.2 * math.log(1 / (1 + math.exp(m)))) for m in margin.tolist()]
    assert losses.tolist() == pytest.approx(expected, abs=1e-9)


def test_the_reference_losses_still_need_one():
    assert DpoConfig().needs_reference and DpoConfig(loss="ipo").needs_reference
