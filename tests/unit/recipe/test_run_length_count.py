"""How long a run is (train.steps.total_steps, config.TrainConfig): steps or epochs, never both."""

from __future__ import annotations

import pytest

from homelab_ft.errors import UserError
from homelab_ft.recipe.config import DEFAULT_MAX_STEPS, TrainConfig, load_recipe
from homelab_ft.train import steps


@pytest.mark.parametrize(("num_epochs", "grad_accum_steps", "expected"), [
    (1, 1, 30),      # 30 global micro-batches an epoch, one per step
    (3, 4, 23),      # 90 micro-batches, 4 per step: 22.5 rounds up, so every row is seen 3 times
    (0.1, 1, 3),     # 0.1 x 30 is 3.0000000000000004 in floats: still 3 steps
    (0.01, 8, 1),    # never 0 steps
])
def test_epochs_become_steps_from_the_batches_of_an_epoch(num_epochs, grad_accum_steps, expected):
    cfg = TrainConfig(num_epochs=num_epochs, grad_accum_steps=grad_accum_steps)
    assert steps.total_steps(cfg, batches_per_epoch=30) == expected


def test_max_steps_is_the_length_when_set_and_defaults_once():
    assert steps.total_steps(TrainConfig(max_steps=7), batches_per_epoch=30) == 7
    assert TrainConfig().max_steps == DEFAULT_MAX_STEPS and TrainConfig(num_epochs=2).max_steps is None


def test_both_lengths_are_refused_naming_both_keys(tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text("train:\n  max_steps: 5\n")
    with pytest.raises(UserError, match=r"train\.max_steps \(5\) and train\.num_epochs \(2\.0\) both say how long"):
        load_recipe(recipe, ["train.num_epochs=2"])
    assert load_recipe(recipe, ["train.num_epochs=2", "train.max_steps=null"]).train.num_epochs == 2
    with pytest.raises(UserError, match="train.num_epochs"):
        load_recipe(recipe, ["train.max_steps=null", "train.num_epochs=0"])


def test_a_resume_past_the_end_is_refused():
    steps.check_resume_point(TrainConfig(max_steps=10), start_step=10, max_steps=10)  # a finished run: nothing to do
    with pytest.raises(UserError, match=r"step 12, past train.num_epochs=1 \(10 steps\)"):
        steps.check_resume_point(TrainConfig(num_epochs=1), start_step=12, max_steps=10)


def test_the_start_line_says_what_the_epochs_mean():
    assert steps.length_note(TrainConfig(max_steps=5), batches_per_epoch=6, world_size=1) == ""
    note = steps.length_note(TrainConfig(num_epochs=2, micro_batch_size=4, grad_accum_steps=2), batches_per_epoch=6,
                             world_size=2)
    assert note == " (train.num_epochs 2 of 6 micro-batches: 4 rows x 2 processes each, 2 per step)"


def test_data_inspect_counts_the_steps_and_plan_says_where(tmp_path, tiny_model_dir, capsys):
    import json

    from homelab_ft.cli.main import main

    rows = [{"messages": [{"role": "user", "content": f"what is {i}"}, {"role": "assistant", "content": f"answer: {i}"}]}
            for i in range(14)]
    (tmp_path / "d.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    recipe = tmp_path / "r.yaml"
    recipe.write_text(f"model:\n  path: {tiny_model_dir}\ndata:\n  sources:\n    - path: d.jsonl\n  max_length: 128\n"
                      f"  cache_dir: {tmp_path / 'c'}\ntrain:\n  micro_batch_size: 4\n  device: cpu\n")
    epochs = ["train.max_steps=null", "train.num_epochs=2", "train.grad_accum_steps=2"]
    assert main(["data", "inspect", str(recipe), "--no-color", *epochs]) == 0
    # 14 rows: 3 micro-batches of 4 an epoch (2 rows left over), 2 per step: ceil(2 x 3 / 2) = 3 steps
    assert ("run length: train.num_epochs 2 = 3 optimizer steps = 2.00 epochs of 3 micro-batches "
            "(4 rows x 1 processes, 2 per step)") in capsys.readouterr().out
    main(["plan", str(recipe), *epochs])
    assert f"the steps are counted once the data is tokenised; `homelab-ft data inspect {recipe}`" in \
        capsys.readouterr().out
    main(["plan", str(recipe), "--json", *epochs])
    json.loads(capsys.readouterr().out)  # --json stays one JSON document
