"""The non-finite guard (train/divergence.py) on a tiny Llama in this process: a diverging LoRA run
stops at its first non-finite step with one line and exit 3, records it, never applies the step,
and its last finite checkpoint exports and reloads; `train.skip_nonfinite_steps` skips and counts."""

from __future__ import annotations

import json
from pathlib import Path

import build_recipe
import procs
import pytest
import torch
from safetensors.torch import load_file

from homelab_ft.cli.main import main
from homelab_ft.recipe.config import TrainConfig
from homelab_ft.train import divergence
from homelab_ft.train.metrics import read_metrics


def _recipe(tmp: Path, model_dir: Path, *, lora: dict | None = None, **train) -> Path:
    procs.write_chat_data(tmp / "train.jsonl", 16, answer_prefix="answer: ", max_q_words=8, max_a_words=6)
    body = build_recipe.tiny_run(model_dir, rows=tmp / "train.jsonl", lora={"alpha": None, **(lora or {})},
                                 train={"max_steps": 4, "lr": 1e-3, "save_every": 1, "keep_last": 5, "num_threads": 1,
                                        **train})
    return build_recipe.write_recipe(tmp / "recipe.yaml", body)


def test_decision_names_what_is_not_finite():
    assert divergence.nonfinite(loss=1.0, grad_norm=2.0) is None
    assert divergence.nonfinite(loss=float("nan"), grad_norm=2.0) == "loss"
    assert divergence.nonfinite(loss=1.0, grad_norm=float("inf")) == "gradient norm"


def test_skip_is_bounded_and_refused_with_optimizer_in_backward():
    assert TrainConfig().skip_nonfinite_steps == 0
    with pytest.raises(ValueError):
        TrainConfig(skip_nonfinite_steps=1001)
    with pytest.raises(ValueError, match="skip_nonfinite_steps=0"):
        TrainConfig(optimizer_in_backward=True, max_grad_norm=0, skip_nonfinite_steps=1)


def test_huge_alpha_stops_at_the_first_nonfinite_step_and_the_finite_checkpoint_exports(tmp_path, tiny_model_dir,
                                                                                        capsys):
    recipe, run = _recipe(tmp_path, tiny_model_dir, max_steps=2), tmp_path / "run"
    assert main(["-q", "train", str(recipe), "--run-dir", str(run)]) == 0
    finite = load_file(run / "checkpoints" / "step_000002" / "adapter" / "adapter_model.safetensors")
    capsys.readouterr()
    # The same run resumed with lora.alpha 1e30 (not fixed on resume): step 3's loss is NaN (B is no longer 0).
    code = main(["-q", "train", str(recipe), "--run-dir", str(run), "--resume", "lora.alpha=1e30", "train.max_steps=4"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 3 and len(err) == 1, err
    assert err[0].startswith("homelab-ft: diverged: step 3: the loss is nan") and "lora.alpha=1e+30" in err[0]
    assert "step_000002" in err[0]
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step_000001", "step_000002"]
    failure = json.loads((run / "diverged.json").read_text())
    assert failure == {"step": 3, "what": "loss", "value": "nan", "skipped": 0, "checkpoint": "step_000002"}
    assert [r for r in read_metrics(run / "metrics.jsonl") if r["step"] == 3] == [
        {"step": 3, "nonfinite": "loss", "skipped_nonfinite": 1}]
    kept = load_file(run / "checkpoints" / "step_000002" / "adapter" / "adapter_model.safetensors")
    assert all(torch.equal(kept[k], finite[k]) for k in finite)

    out = tmp_path / "merged"
    assert main(["-q", "export", str(run), "--out", str(out)]) == 0
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(out)
    assert all(torch.isfinite(p).all() for p in model.parameters())
    logits = model(torch.tensor([[1, 2, 3, 4]])).logits
    assert torch.isfinite(logits).all()


def test_skip_nonfinite_steps_skips_counts_and_stops_at_the_next(tmp_path, tiny_model_dir, capsys):
    recipe, run = _recipe(tmp_path, tiny_model_dir, lora={"alpha": 1e30}, skip_nonfinite_steps=2), tmp_path / "run"
    code = main(["-q", "train", str(recipe), "--run-dir", str(run)])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 3 and len(err) == 1 and "step 3" in err[0] and "after skipping 2" in err[0], err
    rows = read_metrics(run / "metrics.jsonl")
    assert [(r["step"], r["skipped_nonfinite"]) for r in rows] == [(1, 1), (2, 2), (3, 3)]
    assert json.loads((run / "diverged.json").read_text())["skipped"] == 2
    # The skipped steps' checkpoints hold the untouched start: LoRA's B is still zero.
    adapter = load_file(run / "checkpoints" / "step_000002" / "adapter" / "adapter_model.safetensors")
    assert all(torch.count_nonzero(t) == 0 for k, t in adapter.items() if "lora_B" in k)


def test_learning_rate_past_the_bound_is_refused_before_the_run(tmp_path, tiny_model_dir, capsys):
    recipe, run = _recipe(tmp_path, tiny_model_dir, lr=1e6), tmp_path / "run"
    assert main(["-q", "train", str(recipe), "--run-dir", str(run)]) == 2
    assert "train.lr" in capsys.readouterr().err and not run.exists()


def test_optimizer_in_backward_hooks_never_step_on_a_nonfinite_gradient():
    from homelab_ft.distributed.comm import DistEnv
    from homelab_ft.train.optim_backward import OptimizerInBackward

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 1))
    before = [p.detach().clone() for p in model.parameters()]
    opt = OptimizerInBackward(model, make_optimizer=lambda params: torch.optim.AdamW(params, lr=0.1))
    x = torch.ones(2, 4)
    (model(x).sum() * float("inf")).backward()  # every gradient is inf or nan
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before, strict=True))
    assert all(not inner.state for inner in opt.optimizers)  # no moment absorbed it
    env = DistEnv(rank=0, local_rank=0, world_size=1, num_nodes=1, device=torch.device("cpu"), backend=None, is_main=True)
    assert divergence.nonfinite(loss=1.0, grad_norm=opt.grad_norm(env)) == "gradient norm"
    model(x).sum().backward()  # a finite one steps
    assert not all(torch.equal(p, b) for p, b in zip(model.parameters(), before, strict=True))
