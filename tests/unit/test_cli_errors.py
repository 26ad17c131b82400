"""Bad input: one line naming what to fix, exit code 2, no traceback, nothing overwritten."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import yaml

from homelab_ft.cli import main


def run_cli(capsys, *argv) -> str:
    code = main([str(a) for a in argv])
    err = capsys.readouterr().err.strip()
    assert code == 2, err
    assert len(err.splitlines()) == 1, err
    assert "Traceback" not in err
    return err


def recipe_file(tmp: Path, body: dict | str, name: str = "r.yaml") -> Path:
    path = tmp / name
    path.write_text(body if isinstance(body, str) else yaml.safe_dump(body))
    return path


def test_missing_recipe(capsys, tmp_path):
    assert "not found" in run_cli(capsys, "train", tmp_path / "nope.yaml")


def test_malformed_yaml(capsys, tmp_path):
    err = run_cli(capsys, "train", recipe_file(tmp_path, "train:\n  lr: [1,\n  x"))
    assert "r.yaml" in err and "not valid YAML" in err


def test_unknown_key_suggests_nearest(capsys, tmp_path):
    err = run_cli(capsys, "train", recipe_file(tmp_path, {"train": {"learning_rate": 1e-4, "max_step": 3}}))
    assert "train.max_step" in err or "train.learning_rate" in err
    err = run_cli(capsys, "train", recipe_file(tmp_path, {"train": {"max_step": 3}}))
    assert "unknown key train.max_step; did you mean train.max_steps?" in err


def test_wrong_type_and_range(capsys, tmp_path):
    assert "train.micro_batch_size" in run_cli(capsys, "train", recipe_file(tmp_path, {"train": {"micro_batch_size": "four"}}))
    assert "lora.dropout" in run_cli(capsys, "train", recipe_file(tmp_path, {"lora": {"dropout": 1.5}}))
    assert "train.lr" in run_cli(capsys, "train", recipe_file(tmp_path, {}), "train.lr=-1")


def test_bad_override_syntax(capsys, tmp_path):
    assert "key=value" in run_cli(capsys, "train", recipe_file(tmp_path, {}), "=3")


def test_missing_model_path_and_gguf(capsys, tmp_path):
    run = tmp_path / "run"
    err = run_cli(capsys, "train", recipe_file(tmp_path, {"model": {"path": str(tmp_path / "no-model")}}), "--run-dir", run)
    assert "model.path" in err and "no-model" in err
    err = run_cli(capsys, "train", recipe_file(tmp_path, {"model": {"path": str(tmp_path / "m.gguf")}}), "--run-dir", run)
    assert "GGUF file" in err and "m.gguf" in err
    err = run_cli(capsys, "train", recipe_file(tmp_path, {"model": {"path": "nobody/not-cached-model"}}), "--run-dir", run)
    assert "hf download nobody/not-cached-model" in err
    assert not run.exists()  # nothing is created for a run that cannot start


def test_missing_dataset_file(capsys, tmp_path, tiny_model_dir):
    body = {"model": {"path": str(tiny_model_dir)}, "data": {"sources": [{"path": "missing.jsonl"}]}}
    err = run_cli(capsys, "train", recipe_file(tmp_path, body), "--run-dir", tmp_path / "run")
    assert "missing.jsonl" in err
    assert not (tmp_path / "run").exists()


def test_output_dir_with_other_run_is_left_alone(capsys, tmp_path, tiny_model_dir):
    run = tmp_path / "run"
    run.mkdir()
    (run / "recipe.yaml").write_text("name: another\n")
    (run / "notes.txt").write_text("precious")
    body = {"model": {"path": str(tiny_model_dir)}}
    err = run_cli(capsys, "train", recipe_file(tmp_path, body), "--run-dir", run)
    assert "already holds a run" in err and "--resume" in err
    assert (run / "notes.txt").read_text() == "precious"
    assert (run / "recipe.yaml").read_text() == "name: another\n"


def test_export_refuses_non_run_and_foreign_output(capsys, tmp_path):
    assert "not a homelab-ft run directory" in run_cli(capsys, "export", tmp_path, "--out", tmp_path / "x")


def test_no_traceback_from_the_console_entry_point(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "homelab_ft", "train", str(tmp_path / "missing.yaml")],
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 2
    assert proc.stderr.strip().startswith("homelab-ft: error:")
    assert "Traceback" not in proc.stderr


def test_resume_with_another_model_is_refused(capsys, tmp_path, tiny_model_dir):
    from tiny import make_llama

    data = tmp_path / "d.jsonl"
    data.write_text('{"messages": [{"role": "user", "content": "hello"}, {"role": "assistant", "content": "yes"}]}\n' * 8)
    body = {"method": "lora", "model": {"path": str(tiny_model_dir)}, "data": {"sources": [{"path": str(data)}], "max_length": 64},
            "train": {"max_steps": 1, "micro_batch_size": 2, "device": "cpu"}, "output": {"tensorboard": False}}
    recipe = recipe_file(tmp_path, body)
    run = tmp_path / "run"
    assert main(["train", str(recipe), "--run-dir", str(run)]) == 0
    capsys.readouterr()
    before = sorted(p.name for p in (run / "checkpoints").iterdir())
    other = make_llama(tmp_path / "other", hidden_size=96, intermediate_size=192)
    capsys.readouterr()
    err = run_cli(capsys, "train", recipe, "--run-dir", run, "--resume", f"model.path={other}")
    assert "resume needs the same model" in err
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == before


def test_memory_savers_a_rung_cannot_use(capsys, tmp_path, tiny_model_dir):
    """Refused in one line before any file is written: optimizer in backward with accumulation or
    clipping (recipe alone), or on an adapter rung (optim_backward.check_optimizer_in_backward);
    activation offload without checkpointing."""
    run = tmp_path / "run"
    body = {"method": "full", "model": {"path": str(tiny_model_dir)}, "train": {"device": "cpu"}}
    recipe = recipe_file(tmp_path, body)
    err = run_cli(capsys, "train", recipe, "--run-dir", run, "train.optimizer_in_backward=true")
    assert "set train.max_grad_norm=0" in err
    err = run_cli(capsys, "train", recipe, "--run-dir", run, "train.optimizer_in_backward=true",
                  "train.max_grad_norm=0", "train.grad_accum_steps=2")
    assert "set train.grad_accum_steps=1" in err
    err = run_cli(capsys, "train", recipe, "--run-dir", run, "method=lora", "train.optimizer_in_backward=true",
                  "train.max_grad_norm=0")
    assert "train.optimizer_in_backward is for full fine-tunes" in err
    err = run_cli(capsys, "train", recipe, "--run-dir", run, "train.activation_offload=true")
    assert "train.activation_checkpointing=true" in err
    assert not run.exists()
