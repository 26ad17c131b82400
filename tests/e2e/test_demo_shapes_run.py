"""`make demo-shapes` end to end: the image task's pictures, the tiny SmolVLM (built from a small
tokenizer here instead of SmolLM2's, so nothing is converted), scored before, fine-tuned through
recipes/smolvlm-shapes-cpu.yaml, exported, reloaded and scored again."""

from __future__ import annotations

from homelab_ft import logs
from homelab_ft.demo import shapes, shapes_model
from homelab_ft.demo.run import run_shapes_demo

TASK_WORDS = [f"{question} {answer}" for kind in shapes.KINDS
              for question in shapes.QUESTIONS[kind] for answer in shapes.ANSWERS[kind]]
"""The tokenizer's corpus: the answers become a token or two, as in SmolLM2's vocabulary."""


def test_shapes_demo_lifts_held_out_accuracy_from_chance(tmp_path, capsys):
    from tiny import make_tokenizer

    logs.configure()
    make_tokenizer(tmp_path / "tokenizer", corpus=TASK_WORDS)
    base = shapes_model.build(tmp_path / "tokenizer", tmp_path / "base")
    result = run_shapes_demo(run_dir=tmp_path / "run", work_dir=tmp_path / "work", model_dir=base,
                             overrides=("train.max_steps=400", "train.lr=2e-3", "output.tensorboard=false"),
                             num_examples=2)
    assert result.before.num_rows == result.after.num_rows == shapes.NUM_EVAL_ROWS
    assert result.before.chance == result.after.chance == 2 / 9
    assert result.before.accuracy <= result.before.chance  # random weights: never above guessing
    assert result.after.accuracy >= 0.9, result.after.summary()
    assert all(good > 0.75 * total for good, total in result.after.per_kind.values()), result.after.per_kind
    assert list(result.seconds) == ["build", "score base", "train", "export", "score export"]
    assert (result.export_dir / "processor_config.json").is_file() and result.export_dir.parent == result.run_dir.parent
    out = capsys.readouterr().out
    assert "base (random weights)" in out and "fine-tuned, reloaded export" in out
    assert out.count(" fine-tuned '") == 2
