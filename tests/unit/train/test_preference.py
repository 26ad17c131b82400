"""Preference tuning (objective: dpo): the loss against the papers' formulas by hand, sequence
log-probabilities against a per-token gather, the disabled-adapter reference against the base
model, and preference rows through formats, templates and masks with their bad-row errors."""

from __future__ import annotations

import json
import math

import pytest
import torch

from homelab_ft.data import IGNORE_INDEX, collate_pairs, prepare_pairs
from homelab_ft.errors import UserError
from homelab_ft.recipe.config import DataConfig, SourceConfig, recipe_from_dict
from homelab_ft.recipe.objectives import DpoConfig
from homelab_ft.train import preference

# (policy chosen, policy rejected, reference chosen, reference rejected) sequence log-probabilities
PAIRS = [(-12.0, -15.0, -13.0, -14.0), (-30.5, -22.25, -29.0, -25.0), (-4.0, -4.0, -4.0, -4.0)]


def _sigmoid(x: float) -> float:
    return 1 / (1 + math.exp(-x))


def by_hand(pc, pr, rc, rr, *, beta, loss, eps):
    """Rafailov et al. 2023 eq. 7 (with cDPO's label flip) and Azar et al. 2023 eq. 17, in floats."""
    h = (pc - rc) - (pr - rr)
    if loss == "sigmoid":
        return -(1 - eps) * math.log(_sigmoid(beta * h)) - eps * math.log(_sigmoid(-beta * h))
    return (1 - eps) * (h - 1 / (2 * beta)) ** 2 + eps * (-h - 1 / (2 * beta)) ** 2


@pytest.mark.parametrize("loss", ["sigmoid", "ipo"])
@pytest.mark.parametrize("eps", [0.0, 0.1])
@pytest.mark.parametrize("beta", [0.1, 0.5])
def test_loss_equals_the_papers_formula(loss, eps, beta):
    policy = torch.tensor([p[0] for p in PAIRS] + [p[1] for p in PAIRS], dtype=torch.float64)
    reference = torch.tensor([p[2] for p in PAIRS] + [p[3] for p in PAIRS], dtype=torch.float64)
    cfg = DpoConfig(beta=beta, loss=loss, label_smoothing=eps)
    losses, stats = preference.pair_losses(policy, reference, torch.tensor([5, 5, 5, 7, 7, 7]), cfg)
    expected = [by_hand(*p, beta=beta, loss=loss, eps=eps) for p in PAIRS]
    assert losses.tolist() == pytest.approx(expected, rel=1e-12)
    sums = dict(zip(preference.METRICS, stats.tolist(), strict=True))
    assert sums["loss"] == pytest.approx(sum(expected), rel=1e-12)
    rewards = [(beta * (pc - rc), beta * (pr - rr)) for pc, pr, rc, rr in PAIRS]
    assert sums["reward_chosen"] == pytest.approx(sum(c for c, _ in rewards))
    assert sums["reward_margin"] == pytest.approx(sum(c - r for c, r in rewards))
    assert sums["reward_accuracy"] == 1  # only the first pair's chosen reward is higher (the third ties)
    assert sums["logp_rejected"] == pytest.approx(sum(p[1] for p in PAIRS))


def test_start_of_training_loss_is_ln2():
    """Policy = reference: every margin is 0 and the sigmoid loss is ln 2 whatever beta is."""
    logps = torch.tensor([-3.0, -7.0, -5.0, -2.0])
    losses, _ = preference.pair_losses(logps, logps.clone(), torch.tensor([3, 3, 3, 3]), DpoConfig(beta=0.3))
    assert losses.tolist() == pytest.approx([math.log(2)] * 2)


def test_rpo_term_is_the_chosen_nll_per_token():
    policy = torch.tensor([-12.0, -30.0, -15.0, -20.0], dtype=torch.float64)
    reference = torch.tensor([-13.0, -29.0, -14.0, -25.0], dtype=torch.float64)
    tokens = torch.tensor([4, 10, 6, 8])
    plain, _ = preference.pair_losses(policy, reference, tokens, DpoConfig(beta=0.2))
    rpo, _ = preference.pair_losses(policy, reference, tokens, DpoConfig(beta=0.2, sft_weight=0.5))
    assert (rpo - plain).tolist() == pytest.approx([0.5 * 12.0 / 4, 0.5 * 30.0 / 10])


def test_loss_gradient_flows_only_into_the_policy():
    policy = torch.tensor([-2.0, -3.0], requires_grad=True)
    reference = torch.tensor([-2.5, -2.5])
    losses, _ = preference.pair_losses(policy, reference, torch.tensor([1, 1]), DpoConfig(beta=1.0))
    losses.sum().backward()
    # d/dh -log sigmoid(h) = -sigmoid(-h), h = 0.5 - (-0.5) = 1: chosen pushed up, rejected down
    assert policy.grad.tolist() == pytest.approx([-_sigmoid(-1.0), _sigmoid(-1.0)])


def test_sequence_logps_equal_a_per_token_gather_with_the_prompt_masked():
    torch.manual_seed(0)
    vocab, lengths, prompts = 11, [7, 4], [3, 2]
    width = max(lengths)
    logits = torch.randn(2, width, vocab)
    ids = torch.randint(0, vocab, (2, width))
    labels = torch.full((2, width), IGNORE_INDEX)
    for b, (n, p) in enumerate(zip(lengths, prompts, strict=True)):
        labels[b, p:n] = ids[b, p:n]  # the answer's tokens; prompt and padding masked
    got, counts = preference.sequence_logps(logits, labels)
    for b, (n, p) in enumerate(zip(lengths, prompts, strict=True)):
        row = logits[b, :n].log_softmax(-1)  # the unpadded row alone
        expected = sum(float(row[t - 1, ids[b, t]]) for t in range(p, n))
        assert float(got[b]) == pytest.approx(expected, abs=1e-5)
        assert int(counts[b]) == n - p


def test_disabled_adapter_reference_equals_the_base_model(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    from homelab_ft.model import loading
    from homelab_ft.recipe.config import LoraConfig

    torch.manual_seed(0)
    policy = loading.attach_lora(AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32),
                                  LoraConfig(r=4, dropout=0.1))
    with torch.no_grad():
        for name, p in policy.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.5)  # adapters that change the model, as after training
    policy.train()
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    ids = torch.randint(3, 200, (4, 9), generator=torch.Generator().manual_seed(1))
    labels = ids.clone()
    labels[:, :4] = IGNORE_INDEX
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": labels}
    reference = preference.reference_logps(policy, batch, torch.device("cpu"))
    with torch.no_grad():
        expected = preference.sequence_logps(base(input_ids=ids).logits, labels)[0]
        adapted = preference.sequence_logps(policy(input_ids=ids).logits, labels)[0]
    assert (reference - expected).abs().max() <= 1e-5
    assert (adapted - expected).abs().max() > 1e-2  # the adapters are on again afterwards
    assert policy.training and not reference.requires_grad


# --------------------------------------------------------------------------------------------
# data


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dir)


def pair(prompt="the quick brown fox", chosen="answer: yes", rejected="answer: no"):
    return {"prompt": prompt, "chosen": chosen, "rejected": rejected}


def write(tmp_path, *rows, name="p.jsonl"):
    (tmp_path / name).write_text("".join(json.dumps(r) + "\n" for r in rows))


def prepare(tmp_path, tokenizer, **kw):
    sources = kw.pop("sources", [SourceConfig(path="p.jsonl")])
    cfg = DataConfig(sources=sources, cache_dir=str(tmp_path / "cache"), shuffle=False, **kw)
    return prepare_pairs(cfg, tokenizer, seed=0, base_dir=tmp_path)


def test_pairs_share_the_prompt_and_label_only_the_answers(tmp_path, tokenizer):
    write(tmp_path, pair(), pair(prompt="paris capital", chosen="the capital", rejected="dog"))
    prepared = prepare(tmp_path, tokenizer)
    row = prepared.train[0]
    chosen, rejected = row["chosen_input_ids"], row["rejected_input_ids"]
    start = next(i for i, x in enumerate(row["chosen_labels"]) if x != IGNORE_INDEX)
    assert chosen[:start] == rejected[:start]  # the same rendered prompt
    assert start == next(i for i, x in enumerate(row["rejected_labels"]) if x != IGNORE_INDEX)
    answer = tokenizer.decode([t for t, x in zip(chosen, row["chosen_labels"], strict=True) if x != IGNORE_INDEX])
    assert answer == "answer: yes<|im_end|>"  # the answer and its end-of-turn marker, nothing else
    assert prepared.report.pairs and prepared.report.num_train_samples == 2
    batch = collate_pairs([prepared.train[0], prepared.train[1]], pad_token_id=tokenizer.pad_token_id)
    assert batch["input_ids"].shape[0] == 4
    assert batch["input_ids"][1, : len(prepared.train[1]["chosen_input_ids"])].tolist() == prepared.train[1]["chosen_input_ids"]
    assert batch["input_ids"][2, : len(rejected)].tolist() == rejected  # rejected rows follow the chosen ones


def test_hub_layouts_give_the_same_tokens(tmp_path, tokenizer):
    """UltraFeedback-binarized (chosen/rejected as whole conversations), TRL's conversational layout
    (prompt as turns, answers as assistant turns) and plain strings are the same pair."""
    user = {"role": "user", "content": "the quick brown fox"}
    layouts = {
        "plain": pair(),
        "ultrafeedback": {"prompt": "ignored when the conversations carry it",
                          "chosen": [user, {"role": "assistant", "content": "answer: yes"}],
                          "rejected": [user, {"role": "assistant", "content": "answer: no"}]},
        "conversational": {"prompt": [user], "chosen": [{"role": "assistant", "content": "answer: yes"}],
                           "rejected": [{"role": "assistant", "content": "answer: no"}]},
        "messages": {"messages": [user], "chosen": "answer: yes", "rejected": "answer: no"},
    }
    rows = {}
    for name, row in layouts.items():
        write(tmp_path, row, name=f"{name}.jsonl")
        rows[name] = prepare(tmp_path, tokenizer, sources=[SourceConfig(path=f"{name}.jsonl")]).train[0]
    for name in layouts:
        assert rows[name] == rows["plain"], name


BAD_PAIRS = {
    "missing rejected": ({"prompt": "fox", "chosen": "yes"}, r"p\.jsonl: row 2: field 'rejected' is missing"),
    "missing chosen": ({"prompt": "fox", "rejected": "no", "chosen": None}, r"row 2: field 'chosen' is missing"),
    "identical": (pair(chosen="same", rejected="same"), r"row 2: field 'rejected' is identical to 'chosen'"),
    "no prompt": ({"chosen": "yes", "rejected": "no"}, r"row 2: field 'prompt' is missing"),
    # issue 23 point 5: an empty or whitespace-only text trained before (a pair with nothing to say)
    "empty prompt": (pair(prompt=""), r"row 2: field 'prompt' is empty"),
    "blank prompt": (pair(prompt=" \n\t"), r"row 2: field 'prompt' is empty"),
    "empty chosen": (pair(chosen=""), r"row 2: field 'chosen' is empty"),
    "blank rejected": (pair(rejected="   "), r"row 2: field 'rejected' is empty"),
    "blank prompt turn": ({"prompt": [{"role": "user", "content": " "}], "chosen": "yes", "rejected": "no"},
                          r"row 2: field 'prompt\[0\]\.content' is empty"),
    "blank messages turn": ({"messages": [{"role": "user", "content": ""}], "chosen": "yes", "rejected": "no"},
                            r"row 2: field 'messages\[0\]\.content' is empty"),
    "blank chosen turn": ({"prompt": "fox", "chosen": [{"role": "assistant", "content": "\n"}], "rejected": "no"},
                          r"row 2: field 'chosen\[0\]\.content' is empty"),
    "blank conversation answer": ({"chosen": [{"role": "user", "content": "fox"}, {"role": "assistant", "content": "yes"}],
                                   "rejected": [{"role": "user", "content": "fox"}, {"role": "assistant", "content": " "}]},
                                  r"row 2: field 'rejected\[1\]\.content' is empty"),
}


@pytest.mark.parametrize("case", sorted(BAD_PAIRS))
def test_bad_pair_fails_naming_file_row_and_field(tmp_path, tokenizer, case):
    bad, pattern = BAD_PAIRS[case]
    write(tmp_path, pair(), bad, pair())
    with pytest.raises(UserError, match=pattern) as err:
        prepare(tmp_path, tokenizer)
    assert "\n" not in str(err.value) and "bad_rows=skip" in str(err.value)
    report = prepare(tmp_path, tokenizer, bad_rows="skip").report
    assert report.sources[0].num_rows_skipped == 1 and report.num_train_samples == 2


def test_prompt_without_room_for_the_answer(tmp_path, tokenizer):
    write(tmp_path, pair(), pair(prompt="the quick brown fox jumps over the lazy dog " * 8), pair())
    with pytest.raises(UserError, match=r"p\.jsonl: row 2: the prompt takes \d+ tokens and leaves no room .*data\.max_length=90.*data\.bad_rows=skip"):
        prepare(tmp_path, tokenizer, max_length=90)
    report = prepare(tmp_path, tokenizer, max_length=90, bad_rows="skip").report
    assert report.num_dropped_no_target == 1 and report.num_train_samples == 2


def test_objective_and_format_must_agree(tmp_path, tokenizer):
    base = {"data": {"sources": [{"path": "x.jsonl", "format": "chat"}]}}
    with pytest.raises(UserError, match=r"objective=dpo trains on preference pairs, but data.sources\[0\].format=chat"):
        recipe_from_dict({**base, "objective": "dpo"})
    with pytest.raises(UserError, match="packing"):
        recipe_from_dict({"objective": "dpo", "data": {"packing": True}})
    with pytest.raises(UserError, match="set objective: dpo"):
        recipe_from_dict({"data": {"sources": [{"path": "x.jsonl", "format": "preference"}]}})
    with pytest.raises(UserError, match=r"dpo.beta"):
        recipe_from_dict({"objective": "dpo", "dpo": {"beta": 0}})
    # auto-detected: chat rows under dpo, pairs under sft
    write(tmp_path, {"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}]}, name="c.jsonl")
    with pytest.raises(UserError, match=r"data.sources\[0\]: objective=dpo .* has no chosen and rejected"):
        prepare(tmp_path, tokenizer, sources=[SourceConfig(path="c.jsonl")])
    from homelab_ft.data import prepare_data

    write(tmp_path, pair())
    with pytest.raises(UserError, match="holds preference pairs .* set objective: dpo"):
        prepare_data(DataConfig(sources=[SourceConfig(path="p.jsonl")], cache_dir=str(tmp_path / "c")), tokenizer,
                     seed=0, base_dir=tmp_path)
