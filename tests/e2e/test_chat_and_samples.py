"""Issue 24 item 12 on a tiny Llama: sample generations during training (`train.sample_every`) and
`homelab-ft chat RUN` against the newest checkpoint, with no export."""

from __future__ import annotations

import io
import json
import shutil
from pathlib import Path

import build_recipe
import procs

from homelab_ft.cli.main import main
from homelab_ft.train.metrics import read_metrics

PROMPT = "the quick brown fox"


def _recipe(tmp: Path, model_dir: Path, *, method: str = "lora", eval_rows: bool = True, **train) -> Path:
    procs.write_chat_data(tmp / "train.jsonl", 24, answer_prefix="answer: ", max_q_words=8, max_a_words=6)
    procs.write_chat_data(tmp / "eval.jsonl", 4, seed=1, answer_prefix="answer: ", max_q_words=8, max_a_words=6)
    return build_recipe.write_recipe(tmp / f"{method}-{len(train)}.yaml", build_recipe.tiny_run(
        model_dir, method=method,
        lora={"r": 8, "alpha": 16, "dropout": 0.1},  # dropout draws random numbers: sampling must not move them
        data={"eval_sources": [{"path": "eval.jsonl"}]} if eval_rows else {},
        train={"micro_batch_size": 4, "lr": 5e-3, **train}, output={"tensorboard": True}))


def _losses(run: Path) -> list[float]:
    return [r["loss"] for r in read_metrics(run / "metrics.jsonl") if "loss" in r]


def _reply(argv: list[str], capsys) -> str:
    capsys.readouterr()
    assert main(argv) == 0
    return capsys.readouterr().out.strip().splitlines()[-1]


def test_samples_from_eval_prompts_leave_the_losses_alone(tmp_path, tiny_model_dir):
    plain, sampled = tmp_path / "plain", tmp_path / "sampled"
    assert main(["train", str(_recipe(tmp_path, tiny_model_dir)), "--run-dir", str(plain)]) == 0
    recipe = _recipe(tmp_path, tiny_model_dir, sample_every=1, sample_max_new_tokens=5)
    assert main(["train", str(recipe), "--run-dir", str(sampled)]) == 0
    assert _losses(sampled) == _losses(plain)
    rows = [r for r in read_metrics(sampled / "metrics.jsonl") if "samples" in r]
    assert [r["step"] for r in rows] == [1, 2]
    # no sample_prompts: the first 3 held-out rows' prompts, in the training template (their user turn shows)
    eval_questions = [json.loads(line)["messages"][0]["content"] for line in (tmp_path / "eval.jsonl").read_text().splitlines()]
    for row in rows:
        assert len(row["samples"]) == 3
        for sample, question in zip(row["samples"], eval_questions, strict=False):
            assert question in sample["prompt"] and isinstance(sample["completion"], str)
    events = b"".join(f.read_bytes() for f in (sampled / "tensorboard").iterdir())
    assert b"samples/text_summary" in events  # add_text's tag

def test_sample_every_without_prompts_is_refused_in_one_line(tmp_path, tiny_model_dir, capsys):
    recipe = _recipe(tmp_path, tiny_model_dir, eval_rows=False, sample_every=1)
    assert main(["train", str(recipe), "--run-dir", str(tmp_path / "run")]) == 2
    said = [line for line in capsys.readouterr().err.splitlines() if line.startswith("homelab-ft:")]
    assert len(said) == 1 and "train.sample_every=1 needs prompts: set train.sample_prompts" in said[0]
    assert "no held-out rows" in said[0]
    assert not (tmp_path / "run").exists()  # refused before the run directory was made
    assert main(["train", str(recipe), "--run-dir", str(tmp_path / "run"), "train.sample_every=0",
                 "train.sample_prompts=[hello]"]) == 2
    assert "train.sample_prompts are sampled only with train.sample_every" in capsys.readouterr().err


def test_chat_replies_as_generate_on_the_export(tmp_path, tiny_model_dir, capsys, monkeypatch):
    run = tmp_path / "run"
    assert main(["train", str(_recipe(tmp_path, tiny_model_dir, sample_every=2, sample_prompts=[PROMPT])),
                 "--run-dir", str(run)]) == 0
    assert main(["export", str(run), "--out", str(tmp_path / "export")]) == 0
    options = ["--prompt", PROMPT, "--max-new-tokens", "8"]
    exported = _reply(["generate", str(tmp_path / "export"), *options], capsys)
    assert exported != _reply(["generate", str(tiny_model_dir), *options], capsys)  # the adapter changed the reply
    assert _reply(["chat", str(run), *options], capsys) == exported
    # the sample logged at step 2 is the same greedy reply (the training template is the tokenizer's)
    logged = [r for r in read_metrics(run / "metrics.jsonl") if "samples" in r][-1]["samples"][0]
    assert logged["prompt"] == PROMPT
    assert _reply(["chat", str(run), "--prompt", PROMPT, "--max-new-tokens", "64"], capsys) == logged["completion"]

    # interactive: one reply per line, /exit ends (the line after it is never answered)
    monkeypatch.setattr("sys.stdin", io.StringIO(f"{PROMPT}\n\n/exit\nnever answered\n"))
    capsys.readouterr()
    assert main(["chat", str(run), "--max-new-tokens", "8"]) == 0
    assert capsys.readouterr().out.strip().splitlines() == [exported]


def test_chat_talks_to_a_full_fine_tune(tmp_path, tiny_model_dir, capsys):
    run = tmp_path / "full"
    assert main(["train", str(_recipe(tmp_path, tiny_model_dir, method="full")), "--run-dir", str(run)]) == 0
    assert main(["export", str(run), "--out", str(tmp_path / "export")]) == 0
    options = ["--prompt", PROMPT, "--max-new-tokens", "8"]
    base = _reply(["generate", str(tiny_model_dir), *options], capsys)
    exported = _reply(["generate", str(tmp_path / "export"), *options], capsys)
    assert exported != base  # the check below would pass on the base weights otherwise
    assert _reply(["chat", str(run), *options], capsys) == exported


def test_chat_refusals(tmp_path, tiny_model_dir, capsys):
    assert main(["chat", str(tmp_path), "--prompt", "hi"]) == 2
    assert "is not a homelab-ft run directory" in capsys.readouterr().err
    run = tmp_path / "run"
    assert main(["train", str(_recipe(tmp_path, tiny_model_dir)), "--run-dir", str(run)]) == 0
    shutil.rmtree(run / "checkpoints")
    (run / "checkpoints").mkdir()
    capsys.readouterr()
    assert main(["chat", str(run), "--prompt", "hi"]) == 2
    said = [line for line in capsys.readouterr().err.splitlines() if line.startswith("homelab-ft:")]
    assert len(said) == 1 and "has no complete checkpoint to talk to" in said[0]
