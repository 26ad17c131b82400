"""A finished run's directory is protected: resuming it with another model is refused and its
checkpoints are left alone (trains one step, so it lives with the other whole runs)."""

from __future__ import annotations

from pathlib import Path

import yaml

from homelab_ft.cli.main import main


def recipe_file(tmp: Path, body: dict) -> Path:
    path = tmp / "r.yaml"
    path.write_text(yaml.safe_dump(body))
    return path


def run_cli(capsys, *argv) -> str:
    code = main([str(a) for a in argv])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1, err
    return err


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
