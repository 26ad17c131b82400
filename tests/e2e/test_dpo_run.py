"""End to end DPO on a tiny Llama: LoRA (reference = adapters off) train -> metrics -> crash and
resume -> export; and a full fine-tune whose reference comes from the cached pre-pass."""

from __future__ import annotations

import math
import shutil
from pathlib import Path

import build_recipe
import procs
import pytest
import torch

from homelab_ft.cli.main import main
from homelab_ft.train.metrics import read_metrics

PAIR_KEYS = {"reward_chosen", "reward_rejected", "reward_margin", "reward_accuracy", "logp_chosen", "logp_rejected"}


def write_recipe(tmp: Path, model_dir: Path, *, method: str = "lora", loss: str = "sigmoid", **train) -> Path:
    """The DPO recipe of these tests; `loss: kto` trains on the same pairs taken apart (unpaired rows)."""
    write = procs.write_unpaired_data if loss == "kto" else procs.write_pair_data
    write(tmp / "pairs.jsonl", 32)
    write(tmp / "eval.jsonl", 8, seed=1)
    return build_recipe.write_recipe(tmp / "dpo.yaml", build_recipe.tiny_run(
        model_dir, method=method, rows="pairs.jsonl", objective="dpo", dpo={"beta": 0.5, "loss": loss},
        lora={"r": 8, "alpha": 16, "dropout": 0.1},
        data={"eval_sources": [{"path": "eval.jsonl"}], "max_length": 96, "cache_dir": str(tmp / "cache")},
        train={"max_steps": 6, "micro_batch_size": 2, "grad_accum_steps": 2, "lr": 5e-3 if method == "lora" else 1e-3,
               "eval_every": 3, "save_every": 3, "keep_last": 5, **train},
        output={"tensorboard": True}))


def test_lora_dpo_train_resume_export(tmp_path, tiny_model_dir, capsys):
    recipe = write_recipe(tmp_path, tiny_model_dir)
    run = tmp_path / "run"
    assert main(["train", str(recipe), "--run-dir", str(run)]) == 0
    assert "32 training pairs" in capsys.readouterr().out
    rows = procs.step_rows(run)
    assert sorted(rows) == [1, 2, 3, 4, 5, 6]
    assert PAIR_KEYS <= set(rows[1])
    # LoRA's B starts at 0: the policy is the reference, every margin 0, the loss ln 2 exactly
    assert rows[1]["loss"] == pytest.approx(math.log(2), abs=1e-6)
    assert rows[1]["reward_margin"] == pytest.approx(0, abs=1e-6) and rows[1]["reward_accuracy"] == 0
    assert rows[6]["loss"] < rows[1]["loss"] - 0.05 and rows[6]["reward_margin"] > 0 and rows[6]["reward_accuracy"] > 0.5
    evals = [r for r in read_metrics(run / "metrics.jsonl") if "eval_loss" in r]
    assert [r["step"] for r in evals] == [3, 6]
    assert {"eval_reward_accuracy", "eval_reward_margin"} <= set(evals[0])
    assert evals[-1]["eval_loss"] < math.log(2) and evals[-1]["eval_reward_accuracy"] > 0.5
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(next((run / "tensorboard").iterdir()).parent)).Reload()
    assert {"reward_accuracy", "reward_margin", "eval_reward_accuracy"} <= set(events.Tags()["scalars"])

    # crash after step 3, resume: the same losses and rewards
    shutil.rmtree(run / "checkpoints" / "step_000006")
    assert main(["train", str(recipe), "--run-dir", str(run), "--resume"]) == 0
    resumed = procs.step_rows(run)
    for step in (4, 5, 6):
        assert resumed[step]["loss"] == pytest.approx(rows[step]["loss"], abs=1e-6), step
        assert resumed[step]["reward_margin"] == pytest.approx(rows[step]["reward_margin"], abs=1e-6), step

    out = tmp_path / "export"
    assert main(["export", str(run), "--out", str(out)]) == 0  # export compares logits itself
    from transformers import AutoModelForCausalLM

    merged = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    ids = torch.arange(3, 20).reshape(1, -1)
    with torch.no_grad():
        assert (merged(input_ids=ids).logits - base(input_ids=ids).logits).abs().max() > 1e-3


def test_full_dpo_uses_a_cached_reference(tmp_path, tiny_model_dir, caplog):
    recipe = write_recipe(tmp_path, tiny_model_dir, method="full", max_steps=3, eval_every=0, save_every=0)
    first, second = tmp_path / "a", tmp_path / "b"
    assert main(["train", str(recipe), "--run-dir", str(first), "output.tensorboard=false"]) == 0
    cached = list((tmp_path / "cache").glob("reference-*.safetensors"))
    assert len(cached) == 1
    a = procs.step_rows(first)
    assert a[1]["loss"] == pytest.approx(math.log(2), abs=1e-5)  # the pre-pass scored the starting weights
    assert a[3]["loss"] < a[1]["loss"]
    stamp = cached[0].stat().st_mtime_ns
    assert main(["train", str(recipe), "--run-dir", str(second), "output.tensorboard=false"]) == 0
    assert cached[0].stat().st_mtime_ns == stamp  # read, not scored again
    b = procs.step_rows(second)
    for step in a:
        assert b[step]["loss"] == pytest.approx(a[step]["loss"], abs=1e-6)


def test_data_inspect_shows_pairs(tmp_path, tiny_model_dir, capsys):
    recipe = write_recipe(tmp_path, tiny_model_dir)
    assert main(["data", "inspect", str(recipe), "--no-color"]) == 0
    out = capsys.readouterr().out
    assert "train: 32 pairs in 32 rows (chosen + rejected: 2 token rows each)" in out
    assert "first training pair" in out
    assert "chosen:\n" in out and "[[answer: yes" in out and "[[answer: no" in out


def test_qlora_dpo_reference_is_the_4bit_base(tmp_path, tiny_model_dir):
    """QLoRA: the adapters disabled leave the 4-bit base, so step 1 is ln 2 as for LoRA; eval passes
    between steps run the reference and the policy forwards on the quantized layers too."""
    pytest.importorskip("bitsandbytes")
    recipe = write_recipe(tmp_path, tiny_model_dir, method="qlora", max_steps=4, eval_every=2, save_every=0)
    run = tmp_path / "qlora"
    assert main(["train", str(recipe), "--run-dir", str(run), "output.tensorboard=false", "train.lr=1e-2"]) == 0
    rows = procs.step_rows(run)
    assert rows[1]["loss"] == pytest.approx(math.log(2), abs=1e-5)
    assert rows[4]["loss"] < rows[1]["loss"] and rows[4]["reward_margin"] > 0


def test_resuming_an_sft_run_as_dpo_is_refused(tmp_path, tiny_model_dir, capsys):
    recipe = write_recipe(tmp_path, tiny_model_dir, max_steps=1, eval_every=0, save_every=0)
    run = tmp_path / "run"
    sft = ["objective=sft", "data.sources=[{path: sft.jsonl}]", "data.eval_sources=[]", "output.tensorboard=false"]
    procs.write_chat_data(tmp_path / "sft.jsonl", 16)
    assert main(["train", str(recipe), "--run-dir", str(run), *sft]) == 0
    saved = (run / "recipe.yaml").read_text()
    capsys.readouterr()
    assert main(["train", str(recipe), "--run-dir", str(run), "--resume", "train.max_steps=2"]) == 2
    assert "is a run with objective sft, not dpo" in capsys.readouterr().err
    assert (run / "recipe.yaml").read_text() == saved  # refused before anything was touched


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("method", ["lora", "full"])
def test_dpo_on_cuda_in_bf16(tmp_path, tiny_model_dir, method):
    """The GPU path: bf16 weights, fp32 answer log-probabilities, the reference on the device
    (adapters off) or cached from the device pre-pass; step 1 is ln 2 within bf16 rounding."""
    recipe = write_recipe(tmp_path, tiny_model_dir, method=method, max_steps=3, eval_every=3, save_every=0)
    run = tmp_path / method
    assert main(["train", str(recipe), "--run-dir", str(run), "train.device=cuda", "model.dtype=bfloat16",
                 "output.tensorboard=false"]) == 0
    rows = procs.step_rows(run)
    assert rows[1]["loss"] == pytest.approx(math.log(2), abs=1e-2)
    assert all(math.isfinite(r["reward_margin"]) for r in rows.values())


@pytest.mark.parametrize(("loss", "beta"), [("orpo", 0.5), ("simpo", 2.0)])
def test_reference_free_losses_learn_the_preference_without_a_reference(tmp_path, tiny_model_dir, monkeypatch, loss, beta):
    """ORPO and SimPO (dpo.loss): LoRA and full fine-tuning learn the preference and never run a
    reference forward nor score a pre-pass (the reference cache stays empty)."""
    from homelab_ft.train import preference

    def no_reference(*args, **kwargs):
        raise AssertionError("a reference-free loss asked for the reference")

    monkeypatch.setattr(preference, "reference_logps", no_reference)
    recipe = write_recipe(tmp_path, tiny_model_dir, max_steps=6, eval_every=6, save_every=0)
    for method in ("lora", "full"):
        run = tmp_path / method
        assert main(["train", str(recipe), "--run-dir", str(run), f"method={method}", f"dpo.loss={loss}",
                     f"dpo.beta={beta}", "output.tensorboard=false"] + (["train.lr=1e-3"] if method == "full" else [])) == 0
        rows = procs.step_rows(run)
        assert rows[6]["reward_margin"] > rows[1]["reward_margin"] and rows[6]["loss"] < rows[1]["loss"], (method, rows)
    assert not list((tmp_path / "cache").glob("reference-*"))
    # a crash after step 3, then resume: the same losses (LoRA's run saved at 3 and 6)
    run = tmp_path / "resumed"
    common = [f"dpo.loss={loss}", f"dpo.beta={beta}", "output.tensorboard=false", "train.save_every=3"]
    assert main(["train", str(recipe), "--run-dir", str(run), *common]) == 0
    import shutil

    whole = procs.step_rows(run)
    shutil.rmtree(run / "checkpoints" / "step_000006")
    assert main(["train", str(recipe), "--run-dir", str(run), "--resume", *common]) == 0
    again = procs.step_rows(run)
    for step in (4, 5, 6):
        assert again[step]["loss"] == pytest.approx(whole[step]["loss"], abs=1e-6), step


KTO_KEYS = {"reward_chosen", "reward_rejected", "reward_margin", "kl", "logp_chosen", "logp_rejected"}


@pytest.mark.parametrize("method", ["lora", "full"])
def test_kto_learns_resumes_exactly_and_exports(tmp_path, tiny_model_dir, method):
    """KTO on unpaired rows (the pairs taken apart), 4 rows a step: the margin between desirable and
    undesirable rewards moves, a crash after step 3 resumes to the same losses, the export loads.
    LoRA's step 1 is the policy = reference: every log-ratio and z0 0, the loss 1 - sigmoid(0) = 0.5."""
    recipe = write_recipe(tmp_path, tiny_model_dir, method=method, loss="kto")
    run = tmp_path / "run"
    lr = "train.lr=2e-2" if method == "lora" else "train.lr=2e-3"
    assert main(["train", str(recipe), "--run-dir", str(run), "output.tensorboard=false", lr]) == 0
    rows = procs.step_rows(run)
    assert KTO_KEYS <= set(rows[1]) and "reward_accuracy" not in rows[1]
    assert rows[1]["loss"] == pytest.approx(0.5, abs=1e-5) and rows[1]["kl"] >= 0
    assert rows[6]["reward_margin"] > rows[1]["reward_margin"] + 0.05 and rows[6]["loss"] < rows[1]["loss"], rows
    evals = [r for r in read_metrics(run / "metrics.jsonl") if "eval_loss" in r]
    assert [r["step"] for r in evals] == [3, 6] and {"eval_reward_margin", "eval_kl"} <= set(evals[-1])
    assert evals[-1]["eval_reward_margin"] > 0
    if method == "full":  # the reference of both rows (completion, mismatched) came from the pre-pass
        assert len(list((tmp_path / "cache").glob("reference-*.safetensors"))) == 1
    shutil.rmtree(run / "checkpoints" / "step_000006")
    assert main(["train", str(recipe), "--run-dir", str(run), "--resume", "output.tensorboard=false", lr]) == 0
    resumed = procs.step_rows(run)
    for step in (4, 5, 6):
        for key in ("loss", "reward_margin", "kl"):
            assert resumed[step][key] == pytest.approx(rows[step][key], abs=1e-6), (step, key)
    out = tmp_path / "export"
    assert main(["export", str(run), "--out", str(out)]) == 0  # export reloads and compares logits itself
    from transformers import AutoModelForCausalLM

    assert AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32) is not None


def test_kto_refuses_a_step_too_small_for_its_kl_estimate(tmp_path, tiny_model_dir, capsys):
    recipe = write_recipe(tmp_path, tiny_model_dir, loss="kto", micro_batch_size=1, grad_accum_steps=3)
    run = tmp_path / "run"
    assert main(["train", str(recipe), "--run-dir", str(run)]) == 2
    err = capsys.readouterr().err
    assert "dpo.loss=kto estimates its KL reference point over each step's rows, and a step holds 3" in err
    assert not run.exists()


def test_kto_data_and_loss_must_agree_before_the_run_exists(tmp_path, tiny_model_dir, capsys):
    recipe = write_recipe(tmp_path, tiny_model_dir, loss="kto")
    run = tmp_path / "run"
    assert main(["train", str(recipe), "--run-dir", str(run), "dpo.loss=sigmoid"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "objective=dpo trains on preference pairs" in err[0] and "dpo.loss=kto" in err[0], err
    assert not run.exists()


def test_kto_sigterm_saves_and_resumes(tmp_path, tiny_model_dir):
    """SIGTERM mid-run: one line, exit 143, a checkpoint of the step it stopped after; the resume
    continues it to the losses of an uninterrupted run."""
    import signal
    import subprocess
    import sys
    import time

    # a constant rate: the stopped run (max_steps 100000) and the reference run the same schedule
    recipe = write_recipe(tmp_path, tiny_model_dir, loss="kto", eval_every=0, save_every=0, lr_schedule="constant",
                          warmup_steps=0)
    run = tmp_path / "run"
    proc = subprocess.Popen([sys.executable, "-m", "homelab_ft", "train", str(recipe), "--run-dir", str(run),
                             "train.max_steps=100000", "output.tensorboard=false"],
                            env=procs.child_env(), cwd=procs.REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            text=True)
    try:
        deadline = time.monotonic() + 180
        while not (run / "metrics.jsonl").is_file():
            assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read() if proc.poll() else "timeout"
            time.sleep(0.1)
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 143 and "SIGTERM after step" in err, err
    from homelab_ft.store import checkpoint

    stopped = checkpoint.verify(checkpoint.newest_intact(run)).step
    assert main(["train", str(recipe), "--run-dir", str(run), "--resume", "output.tensorboard=false",
                 f"train.max_steps={stopped + 2}"]) == 0
    reference = tmp_path / "reference"
    assert main(["train", str(recipe), "--run-dir", str(reference), "output.tensorboard=false",
                 f"train.max_steps={stopped + 2}"]) == 0
    resumed, expected = procs.step_rows(run), procs.step_rows(reference)
    for step in (stopped + 1, stopped + 2):
        assert resumed[step]["loss"] == pytest.approx(expected[step]["loss"], abs=1e-6), step
