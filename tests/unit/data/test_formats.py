"""Formats, file kinds, mixing, splits, order and the tokenisation cache."""

from __future__ import annotations

import json

import pytest

from homelab_ft.data import IGNORE_INDEX, prepare_data
from homelab_ft.data import sft as data_mod
from homelab_ft.recipe.config import DataConfig, SourceConfig


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dir)


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return str(path)


def chat(i):
    return {"messages": [{"role": "user", "content": f"what is {i}"}, {"role": "assistant", "content": f"answer: {i}"}]}


def trained_text(tokenizer, row) -> list[str]:
    runs, current = [], []
    for tok, lab in zip(row["input_ids"], row["labels"], strict=True):
        if lab != IGNORE_INDEX:
            current.append(tok)
        elif current:
            runs, current = runs + [current], []
    return [tokenizer.decode(r) for r in runs + ([current] if current else [])]


def prepare(tmp_path, tokenizer, sources, **kw):
    kw.setdefault("shuffle", False)
    return prepare_data(DataConfig(sources=sources, cache_dir=str(tmp_path / "cache"), **kw), tokenizer, seed=0, base_dir=tmp_path)


def test_each_format_and_what_it_trains(tmp_path, tokenizer):
    write_jsonl(tmp_path / "chat.jsonl", [chat(1)])
    write_jsonl(tmp_path / "alpaca.jsonl", [{"instruction": "add", "input": "2 2", "output": "four"}])
    write_jsonl(tmp_path / "share.jsonl", [{"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "yes"}]}])
    write_jsonl(tmp_path / "pc.jsonl", [{"prompt": "the capital of france is", "completion": " paris"}])
    write_jsonl(tmp_path / "text.jsonl", [{"text": "the quick brown fox"}])
    expected = {
        "chat.jsonl": (["answer: 1<|im_end|>"], "<|im_start|>user\nwhat is 1<|im_end|>"),
        "alpaca.jsonl": (["four<|im_end|>"], "<|im_start|>user\nadd\n\n2 2<|im_end|>"),
        "share.jsonl": (["yes<|im_end|>"], "<|im_start|>user\nhi<|im_end|>"),
        "pc.jsonl": ([" paris<|im_end|>"], "the capital of france is paris<|im_end|>"),
        "text.jsonl": (None, "the quick brown fox<|im_end|>"),
    }
    for name, (runs, contains) in expected.items():
        prepared = prepare(tmp_path, tokenizer, [SourceConfig(path=name)])
        row = prepared.train[0]
        assert contains in tokenizer.decode(row["input_ids"]), name
        if runs is None:  # raw text: every token but the first is learned
            assert row["labels"][1:] == row["input_ids"][1:]
        else:
            assert trained_text(tokenizer, row) == runs, name
    assert prepare(tmp_path, tokenizer, [SourceConfig(path="pc.jsonl")]).report.sources[0].format == "prompt_completion"


def test_field_mapping_and_system_prompt(tmp_path, tokenizer):
    write_jsonl(tmp_path / "qa.jsonl", [{"question": "two plus two", "answer": "four"}])
    src = SourceConfig(path="qa.jsonl", fields={"instruction": "question", "output": "answer"})
    prepared = prepare(tmp_path, tokenizer, [src], system_prompt="Please respond in the format ANSWER")
    text = tokenizer.decode(prepared.train[0]["input_ids"])
    assert prepared.report.sources[0].format == "alpaca"
    assert text.startswith("<|im_start|>system\nPlease respond in the format ANSWER<|im_end|>")
    write_jsonl(tmp_path / "sys.jsonl", [{"messages": [{"role": "system", "content": "zzz"}] + chat(1)["messages"]}])
    kept = tokenizer.decode(prepare(tmp_path, tokenizer, [SourceConfig(path="sys.jsonl")]).train[0]["input_ids"])
    dropped = tokenizer.decode(prepare(tmp_path, tokenizer, [SourceConfig(path="sys.jsonl")], drop_system_prompt=True).train[0]["input_ids"])
    assert "zzz" in kept and "zzz" not in dropped


def test_file_kinds_folder_glob_and_save_to_disk(tmp_path, tokenizer):
    import datasets

    rows = [{"instruction": f"say {i}", "output": f"answer: {i}"} for i in range(6)]
    (tmp_path / "dir").mkdir()
    (tmp_path / "dir" / "a.json").write_text(json.dumps(rows[:2]))
    datasets.Dataset.from_list(rows[2:4]).to_csv(str(tmp_path / "dir" / "b.csv"), index=False)
    datasets.Dataset.from_list(rows[4:]).to_parquet(str(tmp_path / "dir" / "c.parquet"))
    datasets.DatasetDict({"train": datasets.Dataset.from_list([chat(i) for i in range(3)])}).save_to_disk(str(tmp_path / "saved"))
    assert prepare(tmp_path, tokenizer, [SourceConfig(path="dir")]).report.num_train_samples == 6
    assert prepare(tmp_path, tokenizer, [SourceConfig(path="dir/*.csv")]).report.num_train_samples == 2
    assert prepare(tmp_path, tokenizer, [SourceConfig(path="saved")]).report.num_train_samples == 3


def test_weights_limits_and_eval_split(tmp_path, tokenizer):
    write_jsonl(tmp_path / "a.jsonl", [chat(i) for i in range(10)])
    write_jsonl(tmp_path / "b.jsonl", [chat(100 + i) for i in range(10)])
    report = prepare(tmp_path, tokenizer, [SourceConfig(path="a.jsonl", weight=2.5), SourceConfig(path="b.jsonl", limit=4)]).report
    assert [s.num_samples for s in report.sources] == [25, 4]
    split = prepare(tmp_path, tokenizer, [SourceConfig(path="a.jsonl")], eval_fraction=0.3)
    train_ids = {tuple(r["input_ids"]) for r in split.train}
    eval_ids = {tuple(r["input_ids"]) for r in split.eval}
    assert len(train_ids) == 7 and len(eval_ids) == 3 and not train_ids & eval_ids
    separate = prepare(tmp_path, tokenizer, [SourceConfig(path="a.jsonl")], eval_sources=[SourceConfig(path="b.jsonl")])
    assert separate.report.num_eval_samples == 10 and len(separate.train) == 10


def test_order_is_deterministic_by_seed(tmp_path, tokenizer):
    write_jsonl(tmp_path / "a.jsonl", [chat(i) for i in range(30)])
    cfg = DataConfig(sources=[SourceConfig(path="a.jsonl")], eval_fraction=0.2, cache_dir=str(tmp_path / "c"))

    def order(seed):
        prepared = prepare_data(cfg, tokenizer, seed=seed, base_dir=tmp_path)
        return [r["input_ids"] for r in prepared.train], [r["input_ids"] for r in prepared.eval]

    assert order(1) == order(1)
    assert order(1) != order(2)


def test_second_run_hits_the_tokenisation_cache(tmp_path, tokenizer, monkeypatch):
    write_jsonl(tmp_path / "a.jsonl", [chat(i) for i in range(20)])
    cfg = DataConfig(sources=[SourceConfig(path="a.jsonl")], cache_dir=str(tmp_path / "c"), packing=True)
    first = prepare_data(cfg, tokenizer, seed=0, base_dir=tmp_path)
    assert not first.report.cache_hit

    def refuse(self, batch):
        raise AssertionError("tokenised again despite an identical fingerprint")

    monkeypatch.setattr(data_mod._Encoder, "__call__", refuse)
    second = prepare_data(cfg, tokenizer, seed=0, base_dir=tmp_path)
    assert second.report.cache_hit
    assert second.train.to_dict() == first.train.to_dict()
    monkeypatch.undo()
    changed = DataConfig(sources=cfg.sources, cache_dir=cfg.cache_dir, packing=True, max_length=100)
    assert not prepare_data(changed, tokenizer, seed=0, base_dir=tmp_path).report.cache_hit


def test_overlong_truncate_and_drop_are_counted(tmp_path, tokenizer):
    long = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yes " * 200}]}
    write_jsonl(tmp_path / "a.jsonl", [chat(1), long])
    truncated = prepare(tmp_path, tokenizer, [SourceConfig(path="a.jsonl")], max_length=64)
    assert truncated.report.num_truncated == 1 and max(len(r["input_ids"]) for r in truncated.train) == 64
    dropped = prepare(tmp_path, tokenizer, [SourceConfig(path="a.jsonl")], max_length=64, overlong="drop")
    assert dropped.report.num_dropped_overlong == 1 and dropped.report.num_train_samples == 1


def test_demo_source_resolves_to_the_packaged_file():
    from homelab_ft.data.sources import resolve_files

    (path,) = resolve_files("demo:train", base_dir=None, where="data.sources[0]")
    assert path.parts[-3:] == ("assets", "demo", "train.jsonl")
