"""Bad input: one-line UserErrors naming file, row and field; `bad_rows: skip` counts instead."""

from __future__ import annotations

import json

import build_recipe
import pytest

from homelab_ft.data import prepare_data
from homelab_ft.errors import UserError
from homelab_ft.recipe.config import DataConfig, SourceConfig

GOOD = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yes"}]}


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dir)


def run(tmp_path, tokenizer, **kw):
    sources = kw.pop("sources", [SourceConfig(path="d.jsonl")])
    cfg = DataConfig(sources=sources, cache_dir=str(tmp_path / "cache"), **kw)
    return prepare_data(cfg, tokenizer, seed=0, base_dir=tmp_path)


def lines(*rows) -> bytes:
    return b"".join((r if isinstance(r, bytes) else json.dumps(r).encode()) + b"\n" for r in rows)


BAD_ROWS = {
    "missing field": (lines(GOOD, {"msgs": []}, GOOD), r"d\.jsonl: row 2: field 'messages' is missing"),
    "wrong type": (lines(GOOD, GOOD, {"messages": "hello"}), r"row 3: field 'messages' must be a non-empty list"),
    "content type": (lines({"messages": [{"role": "user", "content": 5}, GOOD["messages"][1]]}, GOOD),
                     r"row 1: field 'messages\[0\]\.content' is a int, expected a string"),
    "unknown role": (lines(GOOD, {"messages": [{"role": "bot", "content": "x"}]}),
                     r"row 2: field 'messages\[0\]\.role' is an unknown role 'bot'; use one of assistant, system, user"),
    "invalid json": (lines(GOOD, b'{"messages": [', GOOD), r"d\.jsonl: row 2 is not valid JSON"),
    "invalid utf-8": (lines(GOOD, GOOD, b'{"messages": "\xff\xfe"}'), r"d\.jsonl: row 3 is not valid UTF-8"),
    "no assistant": (lines({"messages": [{"role": "user", "content": "x"}]}, GOOD), r"row 1: field 'messages' has no assistant turn"),
}


@pytest.mark.parametrize("case", sorted(BAD_ROWS))
def test_bad_row_fails_with_file_row_and_field(tmp_path, tokenizer, case):
    content, pattern = BAD_ROWS[case]
    (tmp_path / "d.jsonl").write_bytes(content)
    with pytest.raises(UserError, match=pattern) as err:
        run(tmp_path, tokenizer)
    assert "\n" not in str(err.value) and "bad_rows=skip" in str(err.value)


@pytest.mark.parametrize("case", sorted(BAD_ROWS))
def test_bad_row_is_skipped_and_counted(tmp_path, tokenizer, case):
    content, _ = BAD_ROWS[case]
    (tmp_path / "d.jsonl").write_bytes(content)
    report = run(tmp_path, tokenizer, bad_rows="skip").report
    assert report.sources[0].num_rows_skipped == 1
    assert report.num_train_samples == report.sources[0].num_rows_read - 1
    assert "row" in report.sources[0].first_error


def test_whole_file_errors(tmp_path, tokenizer):
    (tmp_path / "d.jsonl").write_text("\n\n")
    with pytest.raises(UserError, match=r"d\.jsonl is empty"):
        run(tmp_path, tokenizer)
    with pytest.raises(UserError, match=r"data\.sources\[0\]: dataset nope\.jsonl does not exist"):
        run(tmp_path, tokenizer, sources=[SourceConfig(path="nope.jsonl")])
    with pytest.raises(UserError, match=r"nobody/nothing: it is neither a local path nor a hub dataset in the local cache"):
        run(tmp_path, tokenizer, sources=[SourceConfig(path="nobody/nothing")])
    (tmp_path / "d.jsonl").write_bytes(lines(GOOD))
    with pytest.raises(UserError, match=r"maps output -> 'answer', but the data has no column 'answer'"):
        run(tmp_path, tokenizer, sources=[SourceConfig(path="d.jsonl", format="alpaca", fields={"output": "answer"})])
    with pytest.raises(UserError, match=r"cannot tell the format from the columns \['foo'\]"):
        (tmp_path / "f.jsonl").write_bytes(lines({"foo": 1}))
        run(tmp_path, tokenizer, sources=[SourceConfig(path="f.jsonl")])


def test_every_sample_over_max_length(tmp_path, tokenizer):
    (tmp_path / "d.jsonl").write_bytes(lines(GOOD, GOOD))
    with pytest.raises(UserError, match=r"every sample is longer than data\.max_length=4 tokens"):
        run(tmp_path, tokenizer, max_length=4, overlong="drop")
    with pytest.raises(UserError, match=r"no sample has a trained token within data\.max_length=4"):
        run(tmp_path, tokenizer, max_length=4)


def test_cli_prints_one_line_and_exits_2(tmp_path, tiny_model_dir, capsys):
    from homelab_ft.cli.main import main

    (tmp_path / "d.jsonl").write_bytes(lines(GOOD, {"messages": [{"role": "bot", "content": "x"}]}))
    recipe = build_recipe.write_recipe(tmp_path / "r.yaml", build_recipe.tiny_run(
        tiny_model_dir, method="auto", rows="d.jsonl", lora=None, data={"max_length": None, "cache_dir": str(tmp_path / "c")},
        train=None, output=None))
    assert main(["data", "inspect", str(recipe)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "row 2: field 'messages[0].role'" in err
