"""The run directory type: where each file lives, run.json read back typed, and a broken run.json
refused in one line that names the file and the fix."""

import json

import pytest

from homelab_ft.errors import UserError
from homelab_ft.recipe.config import load_recipe
from homelab_ft.rung import Rung
from homelab_ft.store.layout import RunDir, RunInfo

RUNG = Rung(method="qlora", strategy="full_shard", cpu_offload=False, procs_per_node=2, activation_checkpointing=True)
INFO = RunInfo(rung=RUNG, model_dir="/models/smol", world_size=2, params=134_515_008)


def test_paths(tmp_path):
    run = RunDir(tmp_path / "r")
    assert {name: getattr(run, name).relative_to(run.root).as_posix() for name in (
        "recipe_file", "info_file", "plan_file", "metrics_file", "tensorboard_dir", "loss_plot", "checkpoints",
        "lock_file", "trackio_dir", "mlflow_dir", "wandb_dir", "trackers_file", "report_dir")} == {
        "recipe_file": "recipe.yaml", "info_file": "run.json", "plan_file": "plan.json", "metrics_file": "metrics.jsonl",
        "tensorboard_dir": "tensorboard", "loss_plot": "loss.png", "checkpoints": "checkpoints", "lock_file": ".lock",
        "trackio_dir": "trackio", "mlflow_dir": "mlflow", "wandb_dir": "wandb", "trackers_file": "trackers.json",
        "report_dir": "report"}
    assert RunDir(str(tmp_path)).root == tmp_path  # a string is taken as a path
    assert not (tmp_path / "r").exists()  # naming paths creates nothing


def test_info_round_trip(tmp_path):
    run = RunDir(tmp_path)
    run.write_info(INFO)
    back = run.read_info()
    assert back == INFO
    assert back.rung.adapters_enabled and back.rung.quantized_enabled and back.rung.fsdp_enabled


def test_info_file_keeps_its_flat_layout(tmp_path):
    """Old run directories and other tools read run.json as the rung's fields plus three more."""
    run = RunDir(tmp_path)
    run.write_info(INFO)
    data = json.loads(run.info_file.read_text())
    fields = json.loads(json.dumps(RUNG.to_dict()))  # as JSON carries them: stage_blocks () is a list
    assert data == {**fields, "model_dir": "/models/smol", "world_size": 2, "params": 134_515_008}
    assert list(data)[-3:] == ["model_dir", "world_size", "params"]


def test_info_defaults_missing_optional_rung_fields(tmp_path):
    """A run.json from before a rung field existed reads back with that field's default."""
    run = RunDir(tmp_path)
    run.info_file.write_text(json.dumps({"method": "lora", "strategy": "no_shard", "cpu_offload": False,
                                         "model_dir": "m", "world_size": 1, "params": 10}))
    assert run.read_info().rung == Rung(method="lora", strategy="no_shard", cpu_offload=False)


@pytest.mark.parametrize(("text", "said"), [
    (None, "not a homelab-ft run directory (no run.json)"),
    ('{"method": "lora",', "is not valid JSON"),
    ("[1, 2]", "holds a list, not a JSON object"),
    ('{"method": "lora", "model_dir": "m", "world_size": 1, "params": 1}', "has no 'strategy'"),
    (json.dumps({**RUNG.to_dict(), "world_size": 1, "params": 1}), "has no 'model_dir'"),
    (json.dumps({**RUNG.to_dict(), "method": "dora", "model_dir": "m", "world_size": 1, "params": 1}), "is not a rung"),
    (json.dumps({**RUNG.to_dict(), "model_dir": "m", "world_size": "two", "params": 1}), "wrong type"),
])
def test_broken_info_is_one_user_error_line(tmp_path, text, said):
    run = RunDir(tmp_path)
    if text is not None:
        run.info_file.write_text(text)
    with pytest.raises(UserError) as err:
        run.read_info()
    message = str(err.value)
    assert said in message and len(message.splitlines()) == 1
    assert str(tmp_path) in message
    if text is not None:
        assert "train the run again" in message


def test_broken_info_through_export_is_one_line_exit_2(tmp_path, capsys):
    """In this process: the console entry point's own exit path is test_cli_errors'."""
    from homelab_ft.cli.main import main

    run = tmp_path / "run"  # --out beside the run: one inside it is refused first (export/target.py)
    run.mkdir()
    (run / "run.json").write_text("{not json")
    assert main(["export", str(run), "--out", str(tmp_path / "x")]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1, err
    assert f"{run / 'run.json'} is not valid JSON" in err
    assert not (tmp_path / "x").exists()


def test_recipe_round_trip_and_missing_recipe(tmp_path):
    run = RunDir(tmp_path)
    with pytest.raises(UserError, match="no recipe.yaml"):
        run.read_recipe()
    source = tmp_path / "in.yaml"
    source.write_text("method: lora\nmodel:\n  path: /models/smol\n")
    recipe = load_recipe(source)
    run.write_recipe(recipe)
    assert run.read_recipe() == recipe


def test_plan_written_as_plan_json_prints_it(tmp_path):
    run = RunDir(tmp_path)
    run.write_plan({"chosen": {"method": "lora"}})
    assert run.plan_file.read_text() == json.dumps({"chosen": {"method": "lora"}}, indent=2)


def test_unfinished_saves_are_the_temporary_folders_only(tmp_path):
    from homelab_ft.store import checkpoint

    assert checkpoint.unfinished(tmp_path) == []  # no checkpoints folder yet
    root = RunDir(tmp_path).checkpoints
    for name in ("step_000001", ".tmp-step_000002", ".tmp-step_000003"):
        (root / name).mkdir(parents=True)
    (root / ".tmp-step_000004").write_text("not a folder")
    assert [p.name for p in checkpoint.unfinished(tmp_path)] == [".tmp-step_000002", ".tmp-step_000003"]
    assert [p.name for p in checkpoint.candidates(tmp_path)] == ["step_000001"]
