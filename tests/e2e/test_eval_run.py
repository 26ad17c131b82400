"""`homelab-ft eval`: lm-evaluation-harness on a finished run (adapters applied in memory) and on a
model folder, offline, with the shipped tasks; what it refuses in one line."""

from __future__ import annotations

import json

import build_recipe
import procs
import pytest

from homelab_ft.cli.main import main

pytest.importorskip("lm_eval")


@pytest.fixture(scope="module")
def run(tmp_path_factory, tiny_model_dir):
    tmp = tmp_path_factory.mktemp("evalrun")
    procs.write_chat_data(tmp / "train.jsonl", 16)
    recipe = build_recipe.write_recipe(tmp / "r.yaml", build_recipe.tiny_run(tiny_model_dir, rows=tmp / "train.jsonl",
                                                                             train={"max_steps": 2, "lr": 1e-2}))
    assert main(["train", str(recipe), "--run-dir", str(tmp / "run")]) == 0
    return tmp / "run"


def test_a_run_is_scored_with_its_adapters_and_beside_its_base(run, capsys):
    assert main(["eval", str(run), "--tasks", "homelab_demo_sums,homelab_demo_json", "--limit", "3", "--baseline"]) == 0
    out = capsys.readouterr().out
    assert "homelab_demo_sums" in out and "exact_match (last_number)" in out and " -> " in out
    written = json.loads((run / "eval" / "homelab_demo_sums.json").read_text())
    assert written["task"] == "homelab_demo_sums" and written["limit"] == 3
    assert set(written["scores"]) == {"exact_match (last_number)"} and 0 <= written["scores"]["exact_match (last_number)"] <= 1
    assert "homelab_demo_sums" in written["baseline"]
    assert not list((run / "eval").glob(".*tmp*"))


def test_a_model_folder_is_scored_and_only_printed(tiny_model_dir, capsys):
    assert main(["eval", str(tiny_model_dir), "--tasks", "homelab_demo_json", "--limit", "2"]) == 0
    assert "homelab_demo_json" in capsys.readouterr().out
    assert not (tiny_model_dir / "eval").exists()


@pytest.mark.parametrize(("argv", "message"), [
    (["--tasks", "homelab_demo_sumz"], "no task 'homelab_demo_sumz'; did you mean homelab_demo_sums"),
    (["--tasks", "hellaswag"], "not in the local Hugging Face datasets cache and homelab-ft never downloads"),
    (["--baseline"], "is not a run directory"),
])
def test_what_eval_refuses_is_one_line(tiny_model_dir, capsys, argv, message):
    code = main(["eval", str(tiny_model_dir), "--limit", "1", *argv])
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("homelab-ft:")]
    assert code == 2 and len(lines) == 1 and message in lines[0] and "Traceback" not in err, err


def test_the_recipes_eval_tasks_run_after_training_and_a_bad_one_before(tmp_path, tiny_model_dir, capsys):
    procs.write_chat_data(tmp_path / "train.jsonl", 8)
    recipe = build_recipe.write_recipe(tmp_path / "r.yaml", build_recipe.tiny_run(
        tiny_model_dir, rows=tmp_path / "train.jsonl", train={"max_steps": 1},
        eval={"tasks": ["homelab_demo_sums"], "limit": 2}))
    assert main(["train", str(recipe), "--run-dir", str(tmp_path / "run")]) == 0
    assert json.loads((tmp_path / "run" / "eval" / "homelab_demo_sums.json").read_text())["limit"] == 2
    capsys.readouterr()
    code = main(["train", str(recipe), "--run-dir", str(tmp_path / "other"), "eval.tasks=[homelab_demo_sumz]"])
    assert code == 2 and "no task 'homelab_demo_sumz'" in capsys.readouterr().err
    assert not (tmp_path / "other").exists()
