"""The run's length through the real CLI on a tiny LoRA model: resuming with another
`train.max_steps` continues the schedule (issue 24, item 1) and `train.num_epochs` becomes steps.

metrics.jsonl logs the rate each step trained with, so the LRs compared here are what ran.
"""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import build_recipe
import procs
import pytest
import yaml

from homelab_ft.cli.main import main
from homelab_ft.recipe.config import TrainConfig
from homelab_ft.train.metrics import read_metrics
from homelab_ft.train.optim import lr_factor

LR = 1e-3
WARMUP = 2


def _recipe(tmp: Path, model_dir: Path, **train) -> Path:
    procs.write_chat_data(tmp / "train.jsonl", 48, answer_prefix="answer: ", max_q_words=8, max_a_words=6)
    return build_recipe.write_recipe(tmp / "tiny.yaml", build_recipe.tiny_run(
        model_dir, lora={"dropout": None},
        train={"max_steps": None, "micro_batch_size": 4, "lr": LR, "lr_schedule": "cosine", "warmup_steps": WARMUP,
               "keep_last": 5, **train}))


def _lrs(run: Path) -> dict[int, float]:
    return {r["step"]: r["lr"] for r in read_metrics(run / "metrics.jsonl") if "lr" in r}


def _state(run: Path, step: int) -> dict:
    return json.loads((run / "checkpoints" / f"step_{step:06d}" / "trainer_state.json").read_text())


@pytest.fixture(scope="module")
def ten_steps(tmp_path_factory, tiny_model_dir):
    """A finished 10-step cosine run (checkpoints at 5 and 10) and a 15-step run of the same recipe."""
    tmp = tmp_path_factory.mktemp("length")
    recipe = _recipe(tmp, tiny_model_dir, max_steps=10, save_every=5)
    run, reference = tmp / "run10", tmp / "run15"
    assert main(["train", str(recipe), "--run-dir", str(run)]) == 0
    assert main(["train", str(recipe), "--run-dir", str(reference), "train.max_steps=15", "train.save_every=0"]) == 0
    return recipe, run, _lrs(run), _lrs(reference)


def test_resuming_with_a_longer_max_steps_continues_the_new_schedule(ten_steps, tmp_path):
    recipe, run10, first, fifteen = ten_steps
    run = shutil.copytree(run10, tmp_path / "run")
    assert first[10] == pytest.approx(LR * 0.5 * (1 + math.cos(math.pi * 7 / 8)))
    assert main(["train", str(recipe), "--run-dir", str(run), "--resume", "train.max_steps=15"]) == 0
    resumed = _lrs(run)
    assert sorted(resumed) == list(range(1, 16))
    # Where they match: every resumed step is the 15-step run's step. (Before the fix step 11 ran at
    # the 10-step schedule's final rate, 0.0, and step 12 jumped back up to the 15-step one's.)
    for step in range(11, 16):
        assert resumed[step] == pytest.approx(fifteen[step], rel=1e-9), step
    assert all(a >= b for a, b in zip([resumed[s] for s in range(11, 16)], [resumed[s] for s in range(12, 16)],
                                      strict=False))  # no warm-up again, no jump up mid-way
    # Where they cannot: steps 1..10 ran before anyone asked for 15, on the 10-step schedule. They
    # agree only in the warm-up (which does not depend on the length) and at its first decay step.
    for step in range(1, 11):
        assert resumed[step] == first[step]
        same = step <= WARMUP + 1
        assert (resumed[step] == pytest.approx(fifteen[step], rel=1e-9)) is same, step
    # Steps 10 -> 11 are the one seam: the rate rises from where the 10-step decay had reached to
    # where a 15-step run stands at step 11 (docs/recipes.md, "Resuming with another length").
    assert resumed[11] > resumed[10]
    assert _state(run, 15)["max_steps"] == 15


def test_resuming_with_a_shorter_max_steps_ends_at_the_new_length(ten_steps, tmp_path, capsys):
    recipe, run10, _, _ = ten_steps
    run = shutil.copytree(run10, tmp_path / "run")
    shutil.rmtree(run / "checkpoints" / "step_000010")  # resume from step 5
    assert main(["train", str(recipe), "--run-dir", str(run), "--resume", "train.max_steps=8"]) == 0
    resumed, eight = _lrs(run), tmp_path / "run8"
    assert main(["train", str(recipe), "--run-dir", str(eight), "train.max_steps=8", "train.save_every=0"]) == 0
    assert sorted(resumed) == list(range(1, 9))
    for step in (6, 7, 8):
        assert resumed[step] == pytest.approx(_lrs(eight)[step], rel=1e-9), step
    # A checkpoint past the new end trains nothing: refused, naming both numbers.
    capsys.readouterr()
    assert main(["train", str(recipe), "--run-dir", str(run), "--resume", "train.max_steps=6"]) == 2
    err = capsys.readouterr().err
    assert "checkpoint is of step 8, past train.max_steps=6" in err, err
    assert yaml.safe_load((run / "recipe.yaml").read_text())["train"]["max_steps"] == 8  # refused before writing


def test_num_epochs_sets_the_steps_and_a_resume_extends_them(tiny_model_dir, tmp_path, capsys):
    # 48 rows written, 26 left once tokenised (the other 22 are cut to nothing to learn at
    # max_length 64): the steps are counted from those. Micro-batch 4 on one process: 6 micro-batches
    # an epoch (the 2 rows left over are dropped), 2 per step: 1.5 epochs are ceil(4.5) = 5 steps.
    recipe = _recipe(tmp_path, tiny_model_dir, num_epochs=1.5, grad_accum_steps=2)
    run = tmp_path / "run"
    capsys.readouterr()
    assert main(["train", str(recipe), "--run-dir", str(run)]) == 0
    said = "".join(capsys.readouterr())  # information goes to stdout, the progress bar to stderr
    assert "26 training rows; steps 1..5 (train.num_epochs 1.5 of 6 micro-batches: 4 rows x 1 process each, " \
           "2 per step)" in said, said
    assert "| 0/5 [" in said  # the progress bar's total
    rows = [r for r in read_metrics(run / "metrics.jsonl") if "lr" in r]
    assert [r["step"] for r in rows] == list(range(1, 6))
    assert rows[-1]["epoch"] == 1  # 10 micro-batches drawn: into the second epoch
    schedule = TrainConfig(lr_schedule="cosine", warmup_steps=WARMUP, num_epochs=1.5)
    for row in rows:  # the schedule is 5 steps long: the epochs' end is its end
        assert row["lr"] == pytest.approx(LR * lr_factor(row["step"] - 1, train_cfg=schedule, max_steps=5))
    assert _state(run, 5)["max_steps"] == 5
    # A resume to 3 epochs: 9 steps, the schedule of a 9-step run from step 6.
    assert main(["train", str(recipe), "--run-dir", str(run), "--resume", "train.num_epochs=3"]) == 0
    said = "".join(capsys.readouterr())
    assert "steps 6..9 (train.num_epochs 3 of 6 micro-batches" in said, said
    assert "| 5/9 [" in said
    rows = [r for r in read_metrics(run / "metrics.jsonl") if "lr" in r]
    assert [r["step"] for r in rows] == list(range(1, 10)) and rows[-1]["epoch"] == 3
    for row in rows[5:]:
        assert row["lr"] == pytest.approx(LR * lr_factor(row["step"] - 1, train_cfg=schedule, max_steps=9))
    assert _state(run, 9)["max_steps"] == 9
    # Both lengths at once are refused before anything runs, naming both keys.
    assert main(["train", str(recipe), "--run-dir", str(tmp_path / "x"), "train.max_steps=5"]) == 2
    err = capsys.readouterr().err
    assert "train.max_steps (5) and train.num_epochs (1.5) both say how long to train" in err, err
    assert not (tmp_path / "x").exists()
