"""Preference tuning arithmetic (objective: dpo), written once for every rung.

A pair is a prompt x with a chosen answer y_w and a rejected one y_l. The policy pi (the model
being trained) and a frozen reference pi_ref each give a sequence log-probability per answer,
summed over the answer's tokens only (the prompt is the same in both and would cancel). With
h = [log pi(y_w|x) - log pi_ref(y_w|x)] - [log pi(y_l|x) - log pi_ref(y_l|x)]:

    sigmoid (DPO, Rafailov et al. 2023, eq. 7):  -log sigmoid(beta h)
    ipo (Azar et al. 2023, eq. 17):              (h - 1/(2 beta))^2

Two losses need no reference (`DpoConfig.needs_reference`), and take each answer's mean
log-probability per token instead of its sum:

    orpo (Hong et al. 2024, eq. 6-7):    -mean log p(y_w) - beta log sigmoid(log odds(y_w) - log odds(y_l))
    simpo (Meng et al. 2024, eq. 6):     -log sigmoid(beta (mean log p(y_w) - mean log p(y_l)) - gamma)

KTO (Ethayarajh et al. 2024, eq. 8) learns from unpaired rows, a completion y with a label
(desirable or not), against a reference point z0 instead of a second answer. With
r = log pi(y|x) - log pi_ref(y|x):

    kto:  lambda_y - v(x, y),   v = lambda_D sigmoid(beta (r - z0)) if desirable
                                    lambda_U sigmoid(beta (z0 - r)) if undesirable
          z0 = max(0, mean over the step of log pi(y'|x) - log pi_ref(y'|x)), detached

z0 is the paper's KL(pi || pi_ref) estimate, taken on mismatched pairs (x, y'): each prompt with
another row's completion (data/pairs.py fixes y' per row), so that it measures how far the policy
has drifted in general rather than on the completions being pushed. It is a mean over the whole
step on all ranks (`kto_reference_point`), not per micro-batch, so a step's loss is the same
however it is split; the trainer refuses a step of fewer than KTO_MIN_STEP_ROWS rows, whose
estimate would be one or two numbers. No gradient flows through z0 (the paper's and TRL's choice:
it is a baseline, not a target).

Label smoothing eps treats each label as wrong with probability eps and mixes in the loss of the
flipped pair: (1 - eps) L(h) + eps L(-h) (conservative DPO, Mitchell 2023; for IPO this moves the
regression target to (1 - 2 eps)/(2 beta)). IPO uses summed log-probabilities as in its paper (TRL
averages them per token). `dpo.sft_weight` adds RPO's term (Pang et al. 2024, eq. 3): the chosen
answer's negative log-likelihood divided by its token count.

The implicit rewards beta * (log pi - log pi_ref) of the two answers, their margin and the share
of pairs whose chosen reward is the higher ("reward accuracy") are the metrics DPO runs are read
by. The reference costs no second model: for adapters it is the same forward with the adapters
disabled (PEFT's `disable_adapter()`), for full fine-tunes log-probabilities cached by a pre-pass
with the starting weights (see `reference_cache`).

Normalisation: the loss is a mean over pairs. Each micro-batch's summed pair losses are scaled
by world_size / (pairs in the whole step, all ranks), the same rule `steps.loss_scale` applies to
tokens, so 2 ranks give the gradient of 1 process on the whole batch.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F

from homelab_ft.distributed import comm
from homelab_ft.labels import IGNORE_INDEX
from homelab_ft.recipe.objectives import DpoConfig

METRICS = ("loss", "reward_chosen", "reward_rejected", "reward_margin", "reward_accuracy", "logp_chosen", "logp_rejected")
"""Per-pair quantities summed over a step and divided by its pair count (metrics.jsonl keys, with
`loss` the DPO loss including any SFT term)."""
MODEL_INPUTS = ("input_ids", "attention_mask")


def sequence_logps(logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row: the summed log-probability of the labelled tokens, in fp32, and their count.

    Position t's label is predicted by position t-1's logits (the causal shift); IGNORE_INDEX
    labels (prompt, template, padding) add nothing. Written as a cross-entropy per token, which
    never materialises a second [rows, tokens, vocab] tensor of log-probabilities.
    """
    shift_logits = logits[:, :-1].float()
    shift_labels = labels[:, 1:].to(shift_logits.device)
    nll = F.cross_entropy(
        shift_logits.reshape(-1, shift_logits.size(-1)), shift_labels.reshape(-1),
        ignore_index=IGNORE_INDEX, reduction="none",
    ).view(shift_labels.shape)
    return -nll.sum(dim=-1), (shift_labels != IGNORE_INDEX).sum(dim=-1)


def dpo_loss(margin: torch.Tensor, *, beta: float, loss: str, label_smoothing: float) -> torch.Tensor:
    """Per-pair loss of the log-ratio margin h (see the module docstring)."""
    eps = label_smoothing
    if loss == "sigmoid":
        return -(1 - eps) * F.logsigmoid(beta * margin) - eps * F.logsigmoid(-beta * margin)
    if loss == "ipo":
        target = 1 / (2 * beta)
        return (1 - eps) * (margin - target) ** 2 + eps * (-margin - target) ** 2
    raise ValueError(loss)


def orpo_loss(avg_chosen: torch.Tensor, avg_rejected: torch.Tensor, *, beta: float) -> torch.Tensor:
    """ORPO (Hong et al. 2024, eq. 6-7) per pair from the answers' mean log-probability per token:
    the chosen answer's NLL (L_SFT) plus beta (the paper's lambda) times L_OR = -log sigmoid(log
    odds(chosen) - log odds(rejected)), odds(y) = P(y) / (1 - P(y)) with P(y) = exp(mean log p)."""
    def log_odds(avg):
        return avg - torch.log1p(-torch.exp(avg))

    return -avg_chosen - beta * F.logsigmoid(log_odds(avg_chosen) - log_odds(avg_rejected))


def simpo_loss(avg_chosen: torch.Tensor, avg_rejected: torch.Tensor, *, beta: float, gamma: float,
               label_smoothing: float) -> torch.Tensor:
    """SimPO (Meng et al. 2024, eq. 6) per pair: -log sigmoid(beta/|y_w| log pi(y_w|x) - beta/|y_l|
    log pi(y_l|x) - gamma), the length-normalised margin with no reference; label smoothing mixes in
    the flipped pair as for DPO (TRL's CPOTrainer does the same)."""
    margin = beta * (avg_chosen - avg_rejected) - gamma
    return -(1 - label_smoothing) * F.logsigmoid(margin) - label_smoothing * F.logsigmoid(-margin)


def pair_losses(policy: torch.Tensor, reference: torch.Tensor | None, num_tokens: torch.Tensor, cfg: DpoConfig
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """Losses of B pairs from 2B sequence log-probabilities (chosen rows first, then rejected);
    `reference` is None for the reference-free losses (orpo, simpo: `cfg.needs_reference`).

    Returns the per-pair loss (with grad) and a detached [len(METRICS)] vector of per-pair sums. The
    rewards are beta x (policy - reference) for DPO and IPO, and beta x the mean log-probability per
    token for ORPO and SimPO (TRL's ORPO and CPO trainers report the same).
    """
    num_pairs = policy.shape[0] // 2
    chosen, rejected = policy[:num_pairs], policy[num_pairs:]
    if cfg.needs_reference:
        reference = reference.to(policy.device, policy.dtype)
        ratio_chosen = chosen - reference[:num_pairs]
        ratio_rejected = rejected - reference[num_pairs:]
        losses = dpo_loss(ratio_chosen - ratio_rejected, beta=cfg.beta, loss=cfg.loss,
                          label_smoothing=cfg.label_smoothing)
    else:
        average = policy / num_tokens.clamp(min=1).to(policy.device, policy.dtype)
        ratio_chosen, ratio_rejected = average[:num_pairs], average[num_pairs:]
        losses = (orpo_loss(ratio_chosen, ratio_rejected, beta=cfg.beta) if cfg.loss == "orpo" else
                  simpo_loss(ratio_chosen, ratio_rejected, beta=cfg.beta, gamma=cfg.simpo_gamma,
                             label_smoothing=cfg.label_smoothing))
    if cfg.sft_weight:
        losses = losses + cfg.sft_weight * (-chosen / num_tokens[:num_pairs].clamp(min=1).to(chosen.dtype))
    with torch.no_grad():
        reward_chosen = cfg.beta * ratio_chosen
        reward_rejected = cfg.beta * ratio_rejected
        stats = torch.stack([
            losses.sum(), reward_chosen.sum(), reward_rejected.sum(), (reward_chosen - reward_rejected).sum(),
            (reward_chosen > reward_rejected).float().sum(), chosen.sum(), rejected.sum(),
        ]).double()
    return losses, stats


KTO_SUMS = ("loss", "reward_chosen", "reward_rejected", "num_desirable", "num_undesirable", "logp_chosen",
            "logp_rejected")
"""What a KTO step sums per micro-batch: the loss, and per label the rewards, row counts and
log-probabilities (`kto_metrics` turns the step's totals into means per desirable/undesirable row)."""
KTO_METRICS = ("loss", "reward_chosen", "reward_rejected", "reward_margin", "kl", "logp_chosen", "logp_rejected")
"""A KTO step's metrics.jsonl keys: chosen = desirable rows, rejected = undesirable (TRL's KTO names)."""


def kto_losses(policy: torch.Tensor, reference: torch.Tensor, desirable: torch.Tensor, *, kl: float,
               cfg: DpoConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """KTO (Ethayarajh et al. 2024, eq. 8) per row from its completion's sequence log-probabilities under
    the policy and the reference, its label (`desirable`, bool) and the step's reference point z0
    (`kl`, see `kto_reference_point`). Returns the losses (with grad) and a detached [len(KTO_SUMS)]
    vector; the rewards are beta x (policy - reference), as for DPO."""
    reference = reference.to(policy.device, policy.dtype)
    desirable = desirable.to(policy.device, torch.bool)
    ratio = policy - reference
    value = torch.where(desirable, cfg.desirable_weight * torch.sigmoid(cfg.beta * (ratio - kl)),
                        cfg.undesirable_weight * torch.sigmoid(cfg.beta * (kl - ratio)))
    # the weights in the policy's dtype: torch.where of two Python floats would make them float32
    losses = torch.where(desirable, policy.new_tensor(cfg.desirable_weight), policy.new_tensor(cfg.undesirable_weight)) - value
    with torch.no_grad():
        reward = cfg.beta * ratio.detach()
        wanted = desirable.to(reward.dtype)
        stats = torch.stack([
            losses.sum(), (reward * wanted).sum(), (reward * (1 - wanted)).sum(), wanted.sum(), (1 - wanted).sum(),
            (policy.detach() * wanted).sum(), (policy.detach() * (1 - wanted)).sum(),
        ]).double()
    return losses, stats


def kto_reference_point(kl_sum: float, num_rows: int) -> float:
    """z0 = max(0, mean log-ratio over the step's mismatched pairs): `kl_sum` and `num_rows` are the
    step's totals over every rank (the paper clamps at 0: a KL is never negative, its estimate can be)."""
    return max(0.0, kl_sum / max(num_rows, 1))


def kto_metrics(means: dict, *, kl: float) -> dict:
    """KTO_METRICS from the step's KTO_SUMS totals (any common divisor): the rewards and log-probabilities
    per desirable and per undesirable row, their margin, and z0 as `kl`."""
    def per(name: str, count: str) -> float:
        return means[name] / means[count] if means[count] else 0.0

    chosen, rejected = per("reward_chosen", "num_desirable"), per("reward_rejected", "num_undesirable")
    return {"reward_chosen": chosen, "reward_rejected": rejected, "reward_margin": chosen - rejected, "kl": kl,
            "logp_chosen": per("logp_chosen", "num_desirable"), "logp_rejected": per("logp_rejected", "num_undesirable")}


def halves(batch: dict) -> tuple[dict, dict]:
    """An unpaired micro-batch (collate_pairs: B completions, then their B mismatched completions) as
    two batches of B rows, each cut to its own longest row (padding is on the right)."""
    rows = batch["input_ids"].shape[0] // 2
    out = []
    for part in (slice(0, rows), slice(rows, 2 * rows)):
        width = int(batch["attention_mask"][part].sum(dim=1).max())
        out.append({k: batch[k][part, :width] for k in ("input_ids", "labels", "attention_mask")})
    return out[0], out[1]


@torch.no_grad()
def kto_pre_pass(model, micro_batches: list[dict], *, env) -> tuple[list[torch.Tensor], float]:
    """What a KTO step knows before its first backward: each micro-batch's reference log-probabilities
    of its completions, and z0 (`kto_reference_point`) over the step's mismatched completions on all
    ranks (the policy's without grad, and the reference's), all-reduced as the loss's divisor is."""
    references, kl_sum = [], 0.0
    for mb in micro_batches:
        reference, reference_kl = kto_reference(model, mb, env.device)
        kl_sum += float((kl_policy_logps(model, mb, env.device).double() - reference_kl.double()).sum())
        references.append(reference)
    num_rows = comm.all_reduce_sum(sum(num_pairs(mb) for mb in micro_batches), env)
    return references, kto_reference_point(comm.all_reduce_sum(kl_sum, env), int(num_rows))


@torch.no_grad()
def kto_reference(model, batch: dict, device) -> tuple[torch.Tensor, torch.Tensor]:
    """The reference's log-probabilities of an unpaired micro-batch's completions and of its mismatched
    completions: cached ones (full fine-tunes), else two forwards with the adapters disabled, one per
    half, so that none holds more logits than the trained forward (what the planner prices)."""
    if "reference_logps" in batch:
        both = batch["reference_logps"].to(device)
        return both[: num_pairs(batch)], both[num_pairs(batch):]
    first, second = halves(batch)
    return reference_logps(model, first, device), reference_logps(model, second, device)


@torch.no_grad()
def kl_policy_logps(model, batch: dict, device) -> torch.Tensor:
    """The policy's log-probabilities of the mismatched completions (the second half of an unpaired
    micro-batch), without grad: z0 is detached, so this forward keeps no activations. In eval mode, as
    the reference's: an estimate with dropout would differ between a step after a held-out pass and
    one without. Under DDP the inner module is called (no reduction to prepare for a backward that
    never comes)."""
    inner = getattr(model, "module", model)
    mismatched = halves(batch)[1]
    was_training = inner.training
    inner.eval()
    try:
        logits = inner(**model_inputs(mismatched, device), use_cache=False).logits
    finally:
        inner.train(was_training)
    return sequence_logps(logits, mismatched["labels"])[0]


def num_pairs(batch: dict) -> int:
    return batch["input_ids"].shape[0] // 2


def model_inputs(batch: dict, device) -> dict:
    return {k: batch[k].to(device) for k in MODEL_INPUTS if k in batch}


def policy_logps(model, batch: dict, device) -> tuple[torch.Tensor, torch.Tensor]:
    """One forward of the concatenated chosen + rejected rows; their log-probabilities and token counts."""
    logits = model(**model_inputs(batch, device), use_cache=False).logits
    return sequence_logps(logits, batch["labels"])


def peft_model(model):
    """The PeftModel inside a training wrapper (DDP keeps it in `.module`; FSDP2 shards in place),
    or None for a model without adapters."""
    from peft import PeftModel

    inner = getattr(model, "module", model)
    return inner if isinstance(inner, PeftModel) else None


@torch.no_grad()
def reference_logps(model, batch: dict, device) -> torch.Tensor:
    """The reference's sequence log-probabilities for a batch: cached ones when the batch carries
    them (full fine-tunes), else the same model with its adapters disabled.

    Run in eval mode so that no dropout touches the reference (LoRA's dropout sits on the disabled
    adapter path anyway; some bases have attention or residual dropout of their own). Under DDP
    the inner PeftModel is called directly: a no-grad forward needs none of DDP's bookkeeping.
    Under FSDP2 the sharded PeftModel is called as it is; its hooks gather the blocks as usual.
    """
    if "reference_logps" in batch:
        return batch["reference_logps"].to(device)
    with adapters_off(model, why="objective dpo without adapters needs cached reference log-probabilities") as peft:
        logits = peft(**model_inputs(batch, device), use_cache=False).logits
    return sequence_logps(logits, batch["labels"])[0]


@contextlib.contextmanager
def adapters_off(model, *, why: str):
    """The reference model of LoRA and QLoRA: the PeftModel inside `model` with its adapters disabled,
    in eval mode (no dropout on the reference), its mode restored after. `why`: the error for a model
    without adapters, which has no such reference (callers refuse that before the run)."""
    peft = peft_model(model)
    if peft is None:
        raise RuntimeError(why)
    was_training = peft.training
    peft.eval()
    try:
        with peft.disable_adapter():
            yield peft
    finally:
        peft.train(was_training)


def progress_fields(metrics: dict) -> dict:
    """The progress bar's extra fields for a DPO step: reward accuracy (not KTO's: its rows are unpaired)
    and margin (empty for SFT)."""
    if "reward_margin" not in metrics:
        return {}
    shown = {"acc": f"{metrics['reward_accuracy']:.2f}"} if "reward_accuracy" in metrics else {"kl": f"{metrics['kl']:.3f}"}
    return {**shown, "margin": f"{metrics['reward_margin']:.3f}"}
