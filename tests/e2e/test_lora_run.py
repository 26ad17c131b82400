"""End to end on a tiny Llama: train -> checkpoint -> crash and resume -> export -> reload."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import build_recipe
import procs
import pytest
import torch

from homelab_ft.cli.main import main
from homelab_ft.train.metrics import read_metrics


def write_chat_data(path: Path, num_rows: int, *, seed: int = 0) -> Path:
    """Short rows: at max_length 64 the tiny tokenizer leaves room for the answer."""
    return procs.write_chat_data(path, num_rows, seed=seed, answer_prefix="answer: ", max_q_words=8, max_a_words=6)


def write_recipe(tmp: Path, model_dir: Path, **train) -> Path:
    data = write_chat_data(tmp / "train.jsonl", 48)
    write_chat_data(tmp / "eval.jsonl", 8, seed=1)
    return build_recipe.write_recipe(tmp / "tiny.yaml", build_recipe.tiny_run(
        model_dir, rows=data.name,
        lora={"r": 8, "alpha": 16, "dropout": 0.1}, data={"eval_sources": [{"path": "eval.jsonl"}]},
        train={"max_steps": 6, "micro_batch_size": 4, "grad_accum_steps": 2, "lr": 5e-3, "warmup_steps": 2,
               "eval_every": 3, "save_every": 3, "keep_last": 5, **train},
        output={"tensorboard": True}))


def losses(run_dir: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in read_metrics(run_dir / "metrics.jsonl") if "loss" in r}


def test_train_resume_export(tmp_path, tiny_model_dir):
    recipe = write_recipe(tmp_path, tiny_model_dir)
    run = tmp_path / "run"
    assert main(["train", str(recipe), "--run-dir", str(run)]) == 0
    full = losses(run)
    assert sorted(full) == [1, 2, 3, 4, 5, 6]
    assert full[6] < full[1]  # it learns
    rows = read_metrics(run / "metrics.jsonl")
    assert {"step", "loss", "lr", "tokens", "tokens_per_s"} <= set(rows[0])
    # each step logs the rate it trained with: warmup 1/3, 2/3, then cosine from 5e-3, never 0 at the end
    lrs = {r["step"]: r["lr"] for r in rows if "lr" in r}
    assert lrs[1] == pytest.approx(5e-3 / 3) and lrs[2] == pytest.approx(2 * 5e-3 / 3) and lrs[3] == pytest.approx(5e-3)
    assert 0 < lrs[6] < lrs[5]
    assert [r["step"] for r in rows if "eval_loss" in r] == [3, 6]
    assert (run / "loss.png").stat().st_size > 0
    assert list((run / "tensorboard").iterdir())
    assert (run / "checkpoints" / "step_000006" / "adapter" / "adapter_model.safetensors").is_file()

    # A crash after step 3: later checkpoints gone, one half-written checkpoint of step 6 left behind.
    shutil.rmtree(run / "checkpoints" / "step_000006")
    half = run / "checkpoints" / ".tmp-step_000006"
    (half / "state").mkdir(parents=True)
    (run / "checkpoints" / "step_000009").mkdir()  # no trainer_state.json: incomplete
    with (run / "metrics.jsonl").open("a") as fh:  # a kill -9 mid-write: a torn last row (it crashed resume)
        fh.write('{"step": 7, "lo')
    assert main(["train", str(recipe), "--run-dir", str(run), "--resume"]) == 0
    assert all(line.startswith("{") and line.endswith("}") for line in (run / "metrics.jsonl").read_text().splitlines())
    resumed = losses(run)
    assert sorted(resumed) == [1, 2, 3, 4, 5, 6]
    for step in (4, 5, 6):
        assert resumed[step] == pytest.approx(full[step], abs=1e-6), step

    out = tmp_path / "export"
    assert main(["export", str(run), "--out", str(out)]) == 0
    # idempotent: a second export of the same checkpoint does nothing and succeeds
    assert main(["export", str(run), "--out", str(out)]) == 0

    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    merged = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    reference = PeftModel.from_pretrained(base, run / "checkpoints" / "step_000006" / "adapter").eval()
    tokenizer = AutoTokenizer.from_pretrained(out)
    assert tokenizer.chat_template
    ids = torch.tensor([tokenizer("the quick brown fox answer yes")["input_ids"]])
    with torch.no_grad():
        diff = (merged(input_ids=ids).logits - reference(input_ids=ids).logits).abs().max()
    assert diff <= 1e-4
    # the adapter changed the model: the merged logits are not the base's
    with torch.no_grad():
        base_logits = AutoModelForCausalLM.from_pretrained(tiny_model_dir)(input_ids=ids).logits
    assert (merged(input_ids=ids).logits - base_logits).abs().max() > 1e-3

    # --adapter-only: the adapter alone in PEFT's format, loadable on the base it was trained on
    adapter = tmp_path / "adapter-export"
    assert main(["export", str(run), "--out", str(adapter), "--adapter-only"]) == 0
    assert (adapter / "adapter_model.safetensors").is_file() and not (adapter / "model.safetensors").exists()
    assert json.loads((adapter / "adapter_config.json").read_text())["base_model_name_or_path"] == str(tiny_model_dir)
    reloaded = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32),
                                         adapter).eval()
    with torch.no_grad():
        assert (reloaded(input_ids=ids).logits - reference(input_ids=ids).logits).abs().max() == 0


def test_same_losses_with_activation_checkpointing_and_deterministic(tmp_path, tiny_model_dir):
    recipe = write_recipe(tmp_path, tiny_model_dir, max_steps=3, eval_every=0, save_every=0)
    a, b = tmp_path / "a", tmp_path / "b"
    assert main(["train", str(recipe), "--run-dir", str(a)]) == 0
    assert main(["train", str(recipe), "--run-dir", str(b), "train.activation_checkpointing=true"]) == 0
    la, lb = losses(a), losses(b)
    for step in la:
        assert la[step] == pytest.approx(lb[step], abs=1e-6)


def test_packed_run(tmp_path, tiny_model_dir, capsys):
    recipe = write_recipe(tmp_path, tiny_model_dir, max_steps=2, eval_every=0, save_every=0, micro_batch_size=2)
    run = tmp_path / "packed"
    assert main(["train", str(recipe), "--run-dir", str(run), "data.packing=true"]) == 0
    out = capsys.readouterr().out
    assert re.search(r"data: \d+ training samples .* packed into \d+ rows, [\d.]+% non-pad", out)
    rows = read_metrics(run / "metrics.jsonl")
    train_rows = [r for r in rows if "loss" in r]
    assert [r["step"] for r in train_rows] == [1, 2]
    assert all(r["tokens"] == 2 * 2 * 64 for r in train_rows)  # 2 micro-batches x 2 full packed rows of 64


def test_dora_rslora_train_and_export(tmp_path, tiny_model_dir):
    recipe = write_recipe(tmp_path, tiny_model_dir, max_steps=2, eval_every=0, save_every=0)
    run = tmp_path / "dora"
    assert main(["train", str(recipe), "--run-dir", str(run), "lora.use_dora=true", "lora.use_rslora=true"]) == 0
    config = json.loads((run / "checkpoints" / "step_000002" / "adapter" / "adapter_config.json").read_text())
    assert config["use_dora"] is True and config["use_rslora"] is True
    assert main(["export", str(run), "--out", str(tmp_path / "dora-export")]) == 0  # checks logits itself


def test_generate_applies_the_chat_template(tiny_model_dir, capsys, monkeypatch):
    from transformers import AutoTokenizer, GenerationMixin

    seen = {}
    original = GenerationMixin.generate

    def spy(self, *args, **kwargs):
        seen["input_ids"] = kwargs["input_ids"]
        out = original(self, *args, **kwargs)
        seen["new_tokens"] = out.shape[1] - kwargs["input_ids"].shape[1]
        return out

    monkeypatch.setattr(GenerationMixin, "generate", spy)
    assert main(["generate", str(tiny_model_dir), "--prompt", "hello world", "--max-new-tokens", "4"]) == 0
    prompt = AutoTokenizer.from_pretrained(tiny_model_dir).decode(seen["input_ids"][0])
    assert prompt.endswith("<|im_start|>user\nhello world<|im_end|>\n<|im_start|>assistant\n")
    assert 1 <= seen["new_tokens"] <= 4


def test_exported_files_get_the_folder_mode(tmp_path, tiny_model_dir, umask_027):
    """Issue 39.4: every file of a checkpoint's adapter, of the merged export (DoRA: merged in memory
    and written by save_pretrained) and of the adapter-only export has the mode a new file gets
    (0o640 under umask 027), never safetensors' own 600."""
    from tiny import file_modes

    recipe = build_recipe.write_recipe(tmp_path / "r.yaml", build_recipe.tiny_run(
        tiny_model_dir, rows=write_chat_data(tmp_path / "train.jsonl", 8).name, train={"max_steps": 1}))
    run = tmp_path / "run"
    assert main(["train", str(recipe), "--run-dir", str(run), "lora.use_dora=true"]) == 0
    assert main(["export", str(run), "--out", str(tmp_path / "merged")]) == 0
    assert main(["export", str(run), "--out", str(tmp_path / "adapter"), "--adapter-only"]) == 0
    for folder, weights in ((run / "checkpoints" / "step_000001" / "adapter", "adapter_model.safetensors"),
                            (tmp_path / "merged", "model.safetensors"), (tmp_path / "adapter", "adapter_model.safetensors")):
        modes = file_modes(folder)
        assert weights in modes and set(modes.values()) == {umask_027}, (folder.name, modes)


def test_the_evaluation_shows_progress_unless_quiet(tmp_path, tiny_model_dir, capsys, monkeypatch):
    """Issue 39.2: the final held-out pass ran at a silent 100% (29 s for the DPO recipe); it has a
    bar of its own, ticked once per forward up to its total, and none under -q."""
    from homelab_ft.train import metrics, trainer

    made = []  # (desc, total, enabled, ticks) of every eval bar

    def spy(start, total, *, enabled, **kwargs):
        bar = metrics.progress_bar(start, total, enabled=enabled, **kwargs)
        if kwargs.get("desc", "").startswith("eval"):
            made.append([kwargs["desc"], total, enabled, 0])
            update = bar.update

            def counted(n, _row=made[-1]):
                _row[3] += n
                return update(n)
            bar.update = counted
        return bar

    monkeypatch.setattr(trainer, "progress_bar", spy)
    recipe = write_recipe(tmp_path, tiny_model_dir, max_steps=1, eval_every=0, save_every=0, micro_batch_size=2,
                          grad_accum_steps=1)
    assert main(["train", str(recipe), "--run-dir", str(tmp_path / "run")]) == 0
    out, err = capsys.readouterr()
    [(desc, total, enabled, ticks)] = made
    assert desc == "eval after step 1" and enabled and total > 1 and ticks == total
    assert f"eval after step 1:   0%|          | 0/{total} " in err and "step 1: eval_loss" in out
    made.clear()
    assert main(["-q", "train", str(recipe), "--run-dir", str(tmp_path / "quiet")]) == 0
    assert [enabled for _, _, enabled, _ in made] == [False] and "eval after step" not in capsys.readouterr().err
