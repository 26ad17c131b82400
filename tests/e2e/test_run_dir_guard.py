"""A finished run's directory is protected: resuming it with another model is refused and its
checkpoints are left alone (trains one step, so it lives with the other whole runs)."""

from __future__ import annotations

from pathlib import Path

import build_recipe

from homelab_ft.cli.main import main


def run_cli(capsys, *argv) -> str:
    code = main([str(a) for a in argv])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1, err
    return err


def one_step_lora(tmp_path: Path, model_dir: Path) -> tuple[Path, Path]:
    """A LoRA recipe of one step over eight rows, and the run directory to train it in."""
    data = tmp_path / "d.jsonl"
    data.write_text('{"messages": [{"role": "user", "content": "hello"}, {"role": "assistant", "content": "yes"}]}\n' * 8)
    body = build_recipe.tiny_run(model_dir, rows=data, lora=None, train={"max_steps": 1})
    return build_recipe.write_recipe(tmp_path / "r.yaml", body), tmp_path / "run"


def test_resume_with_another_model_is_refused(capsys, tmp_path, tiny_model_dir):
    from tiny import make_llama

    recipe, run = one_step_lora(tmp_path, tiny_model_dir)
    assert main(["train", str(recipe), "--run-dir", str(run)]) == 0
    capsys.readouterr()
    before = sorted(p.name for p in (run / "checkpoints").iterdir())
    other = make_llama(tmp_path / "other", hidden_size=96, intermediate_size=192)
    capsys.readouterr()
    err = run_cli(capsys, "train", recipe, "--run-dir", run, "--resume", f"model.path={other}")
    assert "resume needs the same model" in err
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == before


def test_resume_refusal_names_the_changed_key(capsys, tmp_path, tiny_model_dir):
    """Issue 39.3: trained with lora.r=4, resumed without it: the refusal (before anything is built or
    written) names lora.r with both values, offers the restoring override (which then resumes), and
    says --overwrite deletes the run."""
    recipe, run = one_step_lora(tmp_path, tiny_model_dir)
    assert main(["train", str(recipe), "--run-dir", str(run), "lora.r=4"]) == 0
    capsys.readouterr()
    saved = (run / "recipe.yaml").read_text()
    err = run_cli(capsys, "train", recipe, "--run-dir", run, "--resume", "train.max_steps=2")  # before the model loads
    assert (run / "recipe.yaml").read_text() == saved  # the refused resume changed nothing in the run
    assert "(lora.r: 4 -> 16)" in err and "resume with lora.r=4," in err, err
    assert "--overwrite starts one here, deleting this run and its checkpoints" in err
    assert "output.overwrite=true" not in err
    err = run_cli(capsys, "train", recipe, "--run-dir", run, "train.lr=1e-3")  # a resume cannot change lr either
    assert "resume it with --resume lora.r=4 train.lr=0.0002," in err and "--overwrite to delete this run" in err, err
    assert main(["train", str(recipe), "--run-dir", str(run), "--resume", "lora.r=4", "train.max_steps=2"]) == 0
    assert (run / "checkpoints" / "step_000002").is_dir()
