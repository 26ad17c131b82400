"""A resume knows its data: each checkpoint records what the run read (data/fingerprint.py), and
`--resume` after the data changed refuses in one line (nothing in the run is touched) unless
`--allow-data-change` says to go on, which the run's log then records."""

from __future__ import annotations

import shutil

import build_recipe
import procs
import pytest

from homelab_ft.cli.main import main
from homelab_ft.store import checkpoint


@pytest.fixture(scope="module")
def trained(tmp_path_factory, tiny_model_dir):
    tmp = tmp_path_factory.mktemp("resume-data")
    procs.write_chat_data(tmp / "train.jsonl", 24, answer_prefix="answer: ", max_q_words=8, max_a_words=6)
    recipe = build_recipe.write_recipe(tmp / "tiny.yaml", build_recipe.tiny_run(
        tiny_model_dir, lora={"dropout": None}, train={"micro_batch_size": 4, "save_every": 2}))
    run = tmp / "run"
    assert main(["train", str(recipe), "--run-dir", str(run)]) == 0
    return recipe, run


def _snapshot(run):
    return {p.relative_to(run): p.read_bytes() for p in sorted(run.rglob("*")) if p.is_file()}


def test_checkpoint_records_the_data(trained):
    recipe, run = trained
    state = checkpoint.read_state(checkpoint.newest_intact(run))
    (path, size, digest), = state.data_fingerprint["files"]
    assert path == str(recipe.parent / "train.jsonl") and size == (recipe.parent / "train.jsonl").stat().st_size
    assert len(digest) == 64


def test_resume_after_the_data_changed_refuses_or_continues_when_told(trained, tmp_path, capsys, caplog):
    recipe, run = trained
    data = recipe.parent / "train.jsonl"
    original = data.read_bytes()
    copy = tmp_path / "run"
    shutil.copytree(run, copy)
    before = _snapshot(copy)
    more = ["train", str(recipe), "--run-dir", str(copy), "--resume", "train.max_steps=3"]
    try:
        data.write_bytes(original + original.splitlines(keepends=True)[0])  # one row appended
        assert main(more) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and "Traceback" not in err
        assert "the data differs from what" in err and "train.jsonl changed" in err and "--allow-data-change" in err
        assert _snapshot(copy) == before  # refused before anything in the run was touched

        data.write_bytes(original.replace(b"answer: ", b"ANSWER: "))  # same size
        assert main(more) == 2
        assert "same size, other bytes" in capsys.readouterr().err

        caplog.clear()
        assert main([*more, "--allow-data-change"]) == 0
        said = capsys.readouterr().err + caplog.text  # the run's log: stderr, or pytest's capture of it
        assert "--allow-data-change: continuing from" in said and "train.jsonl changed" in said
        assert checkpoint.step_of(checkpoint.newest_intact(copy)) == 3
    finally:
        data.write_bytes(original)


def test_resume_with_the_same_data_goes_on(trained, tmp_path, capsys):
    recipe, run = trained
    copy = tmp_path / "run"
    shutil.copytree(run, copy)
    assert main(["train", str(recipe), "--run-dir", str(copy), "--resume", "train.max_steps=3"]) == 0
