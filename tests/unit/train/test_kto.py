"""KTO (dpo.loss: kto): loss and gradients on a fixed batch equal Ethayarajh et al. 2024, eq. 8 with the
batch KL estimate written out directly in float64; the reference point and the step's metrics."""

from __future__ import annotations

import pytest
import torch

from homelab_ft.recipe.objectives import DpoConfig
from homelab_ft.train import preference

# 5 unpaired rows, desirable and undesirable: completion log-probs under policy and reference, and
# the mismatched completions' (prompt i with another row's completion)
POLICY = torch.tensor([-12.0, -30.5, -7.25, -15.0, -29.0], dtype=torch.float64)
REFERENCE = torch.tensor([-13.5, -29.0, -7.0, -16.25, -27.5], dtype=torch.float64)
DESIRABLE = torch.tensor([True, False, True, False, True])
KL_POLICY = torch.tensor([-40.0, -35.5, -22.0, -51.0, -18.0], dtype=torch.float64)
KL_REFERENCE = torch.tensor([-41.0, -35.0, -23.5, -50.25, -18.5], dtype=torch.float64)


def _direct_kto(policy, reference, desirable, kl_policy, kl_reference, *, beta, lambda_d, lambda_u):
    """Eq. 8: L = E[lambda_y - v(x, y)], r = log pi/pi_ref, z0 = max(0, mean of the mismatched pairs'
    log pi/pi_ref) with no gradient; v = lambda_D sigma(beta (r - z0)) or lambda_U sigma(beta (z0 - r))."""
    z0 = torch.clamp((kl_policy - kl_reference).mean(), min=0).detach()
    out = []
    for i in range(len(policy)):
        r = policy[i] - reference[i]
        if desirable[i]:
            out.append(lambda_d - lambda_d * torch.sigmoid(beta * (r - z0)))
        else:
            out.append(lambda_u - lambda_u * torch.sigmoid(beta * (z0 - r)))
    return torch.stack(out), float(z0)


@pytest.mark.parametrize("cfg", [
    DpoConfig(loss="kto"),
    DpoConfig(loss="kto", beta=0.5, desirable_weight=1.33, undesirable_weight=0.8),
])
def test_loss_and_gradients_equal_the_papers_formula(cfg):
    ours_in = POLICY.clone().requires_grad_()
    ref_in = POLICY.clone().requires_grad_()
    kl = preference.kto_reference_point(float((KL_POLICY - KL_REFERENCE).sum()), len(KL_POLICY))
    losses, stats = preference.kto_losses(ours_in, REFERENCE, DESIRABLE, kl=kl, cfg=cfg)
    expected, z0 = _direct_kto(ref_in, REFERENCE, DESIRABLE, KL_POLICY, KL_REFERENCE, beta=cfg.beta,
                               lambda_d=cfg.desirable_weight, lambda_u=cfg.undesirable_weight)
    assert kl == pytest.approx(z0, abs=1e-12) and z0 > 0
    torch.testing.assert_close(losses, expected, atol=1e-6, rtol=0)
    losses.mean().backward()
    expected.mean().backward()
    torch.testing.assert_close(ours_in.grad, ref_in.grad, atol=1e-6, rtol=0)
    assert cfg.needs_reference and cfg.unpaired and cfg.data_format == "unpaired"
    # the metrics: rewards per desirable / undesirable row (TRL's rewards/chosen, rewards/rejected)
    sums = dict(zip(preference.KTO_SUMS, (stats / 5).tolist(), strict=True))
    metrics = preference.kto_metrics(sums, kl=kl)
    reward = cfg.beta * (POLICY - REFERENCE)
    assert metrics["reward_chosen"] == pytest.approx(float(reward[DESIRABLE].mean()))
    assert metrics["reward_rejected"] == pytest.approx(float(reward[~DESIRABLE].mean()))
    assert metrics["reward_margin"] == pytest.approx(metrics["reward_chosen"] - metrics["reward_rejected"])
    assert metrics["kl"] == kl and set(metrics) | {"loss"} == set(preference.KTO_METRICS)


def test_the_reference_point_is_clamped_at_zero():
    """A negative mean log-ratio (the policy likes the mismatched completions less than the reference
    does) is no KL: z0 = 0, as the paper's max(0, .)."""
    assert preference.kto_reference_point(-3.0, 4) == 0.0
    assert preference.kto_reference_point(2.0, 4) == 0.5


def test_halves_split_an_unpaired_batch_and_trim_padding():
    batch = {"input_ids": torch.arange(16).view(4, 4), "labels": torch.arange(16).view(4, 4),
             "attention_mask": torch.tensor([[1, 1, 0, 0], [1, 0, 0, 0], [1, 1, 1, 1], [1, 1, 1, 0]])}
    first, second = preference.halves(batch)
    assert first["input_ids"].tolist() == [[0, 1], [4, 5]]
    assert second["input_ids"].shape == (2, 4)
