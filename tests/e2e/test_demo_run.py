"""`make demo`'s orchestration end to end on the tiny random model: score, train, export, score."""

from __future__ import annotations

import json

from homelab_ft import logs
from homelab_ft.demo.run import run_demo


def test_run_demo_scores_base_trains_exports_and_scores_the_reloaded_export(tiny_model_dir, tmp_path, capsys):
    """The wiring, on the tiny random model (the real SmolLM2 run is tests/e2e/test_demo_smollm2.py)."""
    logs.configure()
    run_dir = tmp_path / "demo"
    result = run_demo(
        run_dir=run_dir,
        overrides=(f"model.path={tiny_model_dir}", "data.max_length=512", "train.max_steps=2", "output.tensorboard=false"),
        num_eval_rows=4,
        num_examples=2,
    )
    assert result.before.num_rows == result.after.num_rows == 4
    assert (result.export_dir / "config.json").is_file() and result.export_dir.parent == run_dir.parent
    assert (run_dir / "metrics.jsonl").is_file()
    assert list(result.seconds) == ["convert", "score base", "train", "export", "score export", "score gguf", "report"]
    assert result.report == run_dir / "report" / "report.html" and "data:image/png;base64," in result.report.read_text()
    assert (result.export_dir / "model-q8_0.gguf").is_file() and result.gguf.num_rows == 4
    out = capsys.readouterr().out
    assert "base SmolLM2-135M-Instruct" in out and "fine-tuned, reloaded export" in out
    assert "the same, as model-q8_0.gguf" in out
    assert out.count("  user:       ") == 2
    assert f"report (loss, lr, tokens/s, memory vs plan): {result.report}" in out
    # a second run replaces the first (the demo owns its run directory)
    again = run_demo(
        run_dir=run_dir,
        overrides=(f"model.path={tiny_model_dir}", "data.max_length=512", "train.max_steps=1", "output.tensorboard=false"),
        num_eval_rows=2,
        num_examples=0,
    )
    assert again.after.num_rows == 2
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in rows if "loss" in row] == [1]
