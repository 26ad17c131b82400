"""KTO's unpaired rows (format `unpaired`): read by the pairs' data layer with the same bad-row rules,
each with a mismatched completion of another prompt; the label ratio `data inspect` reports; the
recipe-level refusals of a format the loss does not read."""

from __future__ import annotations

import json

import pytest

from homelab_ft.data import IGNORE_INDEX, collate_pairs, prepare_pairs
from homelab_ft.data.pairs import mismatched
from homelab_ft.data.report import desirable_line
from homelab_ft.errors import UserError
from homelab_ft.recipe.config import DataConfig, SourceConfig, recipe_from_dict


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dir)


def row(prompt="the quick brown fox", completion="answer: yes", label=True):
    return {"prompt": prompt, "completion": completion, "label": label}


def write(tmp_path, *rows, name="u.jsonl"):
    (tmp_path / name).write_text("".join(json.dumps(r) + "\n" for r in rows))


def prepare(tmp_path, tokenizer, *, path="u.jsonl", **data):
    """The unpaired rows of `path` as a KTO recipe's data section reads them (no shuffle)."""
    cfg = DataConfig(sources=[SourceConfig(path=path)], cache_dir=str(tmp_path / "cache"), shuffle=False, **data)
    return prepare_pairs(cfg, tokenizer, seed=0, base_dir=tmp_path, unpaired=True)


def test_rows_carry_their_completion_a_mismatched_one_and_the_label(tmp_path, tokenizer):
    write(tmp_path, row(), row(completion="answer: no", label=False), row(prompt="a lazy dog", completion="woof"),
          row(prompt=[{"role": "user", "content": "hi there"}], completion="hello", label=False))
    prepared = prepare(tmp_path, tokenizer)
    assert prepared.report.desirable == (2, 2) and prepared.report.unit == "unpaired row"
    first = prepared.train[0]
    answer = tokenizer.decode([t for t, x in zip(first["answer_input_ids"], first["answer_labels"], strict=True)
                               if x != IGNORE_INDEX])
    kl = tokenizer.decode([t for t, x in zip(first["kl_input_ids"], first["kl_labels"], strict=True) if x != IGNORE_INDEX])
    # row 1's prompt is row 2's too: its mismatched completion is row 3's, the next with another prompt
    assert answer.startswith("answer: yes") and kl.startswith("woof")
    batch = collate_pairs([prepared.train[i] for i in range(4)], pad_token_id=tokenizer.pad_token_id)
    assert batch["input_ids"].shape[0] == 8 and batch["label"].tolist() == [True, False, True, False]


def test_mismatch_skips_rows_of_the_same_prompt_and_wraps_around():
    samples = [{"messages": [m], "answer": [a]} for m, a in (("p", "a0"), ("p", "a1"), ("q", "a2"))]
    assert [s["kl"] for s in mismatched(samples)] == [["a2"], ["a2"], ["a0"]]


@pytest.mark.parametrize(("bad", "field"), [
    ({"label": 1}, "field 'label' is 1 \\(int\\), expected true"),
    ({"label": "yes"}, "field 'label' is 'yes'"),
    ({"label": None}, "field 'label' is missing"),
    ({"completion": "  "}, "field 'completion' is empty"),
])
def test_a_bad_row_fails_naming_file_row_and_field(tmp_path, tokenizer, bad, field):
    write(tmp_path, row(), {**row(), **bad}, row(label=False))
    with pytest.raises(UserError, match=rf"u\.jsonl: row 2: {field}.*data\.bad_rows=skip"):
        prepare(tmp_path, tokenizer)
    report = prepare(tmp_path, tokenizer, bad_rows="skip").report
    assert report.sources[0].num_rows_skipped == 1 and report.num_train_samples == 2


def test_the_format_must_match_the_loss(tmp_path, tokenizer):
    with pytest.raises(UserError, match=r"dpo.loss=kto trains on unpaired rows, but data.sources\[0\].format=preference"):
        recipe_from_dict({"objective": "dpo", "dpo": {"loss": "kto"},
                          "data": {"sources": [{"path": "x.jsonl", "format": "preference"}]}})
    with pytest.raises(UserError, match=r"objective=dpo trains on preference pairs.*format=unpaired.*dpo.loss=kto"):
        recipe_from_dict({"objective": "dpo", "data": {"sources": [{"path": "x.jsonl", "format": "unpaired"}]}})
    with pytest.raises(UserError, match=r"format=unpaired holds rows for preference tuning; set objective: dpo"):
        recipe_from_dict({"data": {"sources": [{"path": "x.jsonl", "format": "unpaired"}]}})
    with pytest.raises(UserError, match=r"dpo.sft_weight is a paired loss's term"):
        recipe_from_dict({"objective": "dpo", "dpo": {"loss": "kto", "sft_weight": 0.1}})
    # auto-detected: pairs under kto, unpaired rows under a paired loss
    write(tmp_path, {"prompt": "x", "chosen": "a", "rejected": "b"}, name="p.jsonl")
    with pytest.raises(UserError, match=r"data.sources\[0\]: dpo.loss=kto trains on unpaired rows, but .*p.jsonl"):
        prepare(tmp_path, tokenizer, path="p.jsonl")
    write(tmp_path, row())
    with pytest.raises(UserError, match=r"objective=dpo trains on preference pairs, but .*u.jsonl.*dpo.loss=kto"):
        prepare_pairs(DataConfig(sources=[SourceConfig(path="u.jsonl")], cache_dir=str(tmp_path / "c")), tokenizer,
                      seed=0, base_dir=tmp_path)


@pytest.mark.parametrize(("counts", "weights", "warned"), [
    ((50, 50), (1.0, 1.0), False),
    ((57, 43), (1.0, 1.0), False),     # 1.33: the band's top
    ((70, 30), (1.0, 1.0), True),
    ((30, 70), (1.0, 1.0), True),
    ((30, 70), (2.5, 1.0), False),     # weighted 1.07
    ((10, 0), (1.0, 1.0), True),
])
def test_the_label_ratio_warns_outside_ktos_band(counts, weights, warned):
    line = desirable_line(*counts, desirable_weight=weights[0], undesirable_weight=weights[1])
    assert line.startswith(f"labels: {counts[0]} desirable : {counts[1]} undesirable")
    assert ("warning" in line) == warned
    if warned and all(counts):
        fix = float(line.rsplit("dpo.desirable_weight=", 1)[1].split()[0])
        assert 1 <= fix * counts[0] / (weights[1] * counts[1]) <= 4 / 3
