"""The shared token-row rules (data/rows.py): kept rows and their counts for samples and pairs,
the fit to max_length, the empty-data message, the cache file per kind, and a front door
that imports no torch."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import datasets
import pytest

from homelab_ft.data import IGNORE_INDEX, pairs, rows, sft
from homelab_ft.data.rows import BAD_IMAGE, BAD_TEMPLATE, CUT_IMAGE, NO_TARGET, OK, TOO_LONG, TRUNCATED
from homelab_ft.recipe.config import DataConfig, SourceConfig

X = IGNORE_INDEX


def test_kept_samples_counts_every_status_and_keeps_ok_and_truncated():
    ds = datasets.Dataset.from_dict({
        "origin": ["a", "b", "c", "d", "e"],
        "input_ids": [[1, 2, 3], [4, 5], [], [], [6]],
        "labels": [[X, 2, 3], [X, 5], [], [], [6]],
        "status": [OK, TRUNCATED, TOO_LONG, NO_TARGET, OK],
    })
    got = rows.kept(ds, kind=sft.SAMPLE_ROWS)
    assert got.counts == {OK: 2, TRUNCATED: 1, TOO_LONG: 1, NO_TARGET: 1, BAD_TEMPLATE: 0, BAD_IMAGE: 0, CUT_IMAGE: 0}
    assert got.lengths.tolist() == [3, 2, 1] and got.lengths.dtype == "int64"
    assert got.num_trained_tokens == 4
    assert got.rows.column_names == ["input_ids", "labels"]
    assert got.rows["input_ids"] == [[1, 2, 3], [4, 5], [6]]


def test_kept_pairs_lists_all_chosen_lengths_then_all_rejected():
    ds = datasets.Dataset.from_dict({
        "origin": ["a", "b", "c"],
        "chosen_input_ids": [[1, 2], [], [3, 4, 5]], "chosen_labels": [[X, 2], [], [X, 4, 5]],
        "rejected_input_ids": [[1, 7, 8, 9], [], [3]], "rejected_labels": [[X, 7, 8, 9], [], [3]],
        "status": [OK, BAD_TEMPLATE, TRUNCATED],
    })
    got = rows.kept(ds, kind=pairs.PAIR_ROWS)
    assert got.lengths.tolist() == [2, 3, 4, 1]
    assert got.num_trained_tokens == 1 + 2 + 3 + 1
    assert got.counts[BAD_TEMPLATE] == 1 and len(got.rows) == 2
    assert tuple(got.rows.column_names) == pairs.COLUMNS


@pytest.mark.parametrize(("overlong", "ids", "labels", "expected"), [
    ("truncate", [1, 2, 3], [X, 2, 3], ([1, 2, 3], [X, 2, 3], OK)),
    ("truncate", [1, 2, 3, 4, 5], [X, 2, 3, 4, 5], ([1, 2, 3, 4], [X, 2, 3, 4], TRUNCATED)),
    ("truncate", [1, 2, 3, 4, 5], [X, X, X, X, 5], ([], [], NO_TARGET)),
    ("drop", [1, 2, 3, 4, 5], [X, 2, 3, 4, 5], ([], [], TOO_LONG)),
    ("drop", [1, 2], [X, X], ([], [], NO_TARGET)),
])
def test_fit_row(overlong, ids, labels, expected):
    assert rows.fit_row(ids, labels, DataConfig(max_length=4, overlong=overlong)) == expected


def test_empty_reason_names_the_unit_and_the_fix():
    cfg = DataConfig(max_length=64)
    counts = dict.fromkeys(rows.STATUSES, 0)
    assert rows.empty_reason({**counts, TOO_LONG: 3}, cfg, unit="pair").startswith(
        "every pair is longer than data.max_length=64 tokens and overlong=drop removed all 3")
    assert "raise data.max_length" in rows.empty_reason({**counts, NO_TARGET: 2}, cfg, unit="sample")
    assert rows.empty_reason({**counts, BAD_TEMPLATE: 5}, cfg, unit="sample") == (
        "no usable training sample (5 could not be rendered by the chat template)")


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dir)


def test_each_kind_has_its_cache_file_and_a_rerun_hits_it(tmp_path, tokenizer):
    sample = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yes"}]}
    pair = {"prompt": "hi", "chosen": "yes", "rejected": "no"}
    for name, row in (("s.jsonl", sample), ("p.jsonl", pair)):
        (tmp_path / name).write_text(json.dumps(row) + "\n")
    cfg = DataConfig(sources=[SourceConfig(path=str(tmp_path / "s.jsonl"))], cache_dir=str(tmp_path / "c"))
    assert not sft.prepare_data(cfg, tokenizer, seed=0).report.cache_hit
    assert sft.prepare_data(cfg, tokenizer, seed=0).report.cache_hit
    cfg = DataConfig(sources=[SourceConfig(path=str(tmp_path / "p.jsonl"))], cache_dir=str(tmp_path / "c"))
    assert not pairs.prepare_pairs(cfg, tokenizer, seed=0).report.cache_hit
    assert pairs.prepare_pairs(cfg, tokenizer, seed=0).report.cache_hit
    names = sorted(p.name.split("-")[0] for p in (tmp_path / "c").glob("*.arrow"))
    assert names == ["pairs", "tokenized"]


def test_the_front_door_imports_no_torch():
    code = "import sys, homelab_ft.data; print('torch' in sys.modules)"
    repo = Path(__file__).resolve().parents[3]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(repo), os.environ.get("PYTHONPATH", "")])}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, env=env)
    assert out.stdout.strip() == "False"
