"""Every rung on every family (issue 20): tiny random models of tests/families.py through the real
`homelab-ft train` and `export`, in process.

For each family, 2 LoRA steps train, the safetensors export reloads with `from_pretrained` and its
logits equal base + adapter merged by PEFT in fp32; for each dense family QLoRA and a full fine-tune
train 2 steps and their export reloads. Rows of at most 64 tokens (the template's system turn alone
is ~30 of the tiny tokenizer's), micro-batches of 2, no eval: ~3 s a case, ~3 min in all on 2 cores.

Every case must pass: the planner derives each family's shape from transformers (plan/shape/derive.py),
checkpoint tensors are found through transformers' key conversion (model/checkpoint_keys.py), and
a full export writes the base's persistent buffers the checkpoint does not hold (Gemma 4's
layer_scalar).
"""

from __future__ import annotations

import build_recipe
import pytest
import torch
from families import DENSE, FAMILIES, save_tiny
from procs import write_chat_data

from homelab_ft.cli.main import main
from homelab_ft.train.metrics import read_metrics


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    folder = tmp_path_factory.mktemp("family-data")
    write_chat_data(folder / "train.jsonl", 8, answer_prefix="answer: ", max_q_words=3, max_a_words=3)
    return folder


def _train(tmp_path, data_dir, model_type: str, method: str):
    model_dir = save_tiny(tmp_path / "base", model_type)
    path = build_recipe.write_recipe(tmp_path / "recipe.yaml", build_recipe.tiny_run(
        model_dir, method=method, rows=data_dir / "train.jsonl", output=None,
        train={"grad_accum_steps": 1, "lr": 1e-2, "warmup_steps": 0, "eval_every": 0, "save_every": 0}))
    run = tmp_path / "run"
    assert main(["train", str(path), "--run-dir", str(run)]) == 0
    assert [r["step"] for r in read_metrics(run / "metrics.jsonl") if "loss" in r] == [1, 2]
    out = tmp_path / "export"
    assert main(["export", str(run), "--out", str(out)]) == 0
    return model_dir, run, out


def _logits(model, ids):
    with torch.no_grad():
        return model.eval()(input_ids=ids).logits.float()


IDS = torch.tensor([[1, 5, 17, 40, 99, 23, 7, 64]])


@pytest.mark.parametrize("model_type", FAMILIES)
def test_lora(tmp_path, data_dir, model_type):
    from transformers import AutoModelForCausalLM

    from homelab_ft.export import merged
    from homelab_ft.recipe.config import load_recipe

    model_dir, run, out = _train(tmp_path, data_dir, model_type, "lora")
    exported = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    before = _logits(base, IDS)
    ckpt = run / "checkpoints" / "step_000002"
    # base + PEFT's adapter, and on MoE models the adapters on every expert (export/expert_adapters.py)
    reference = merged.load_base_with_adapter(ckpt, model_dir, load_recipe(tmp_path / "recipe.yaml"))
    want = _logits(reference, IDS)
    got = _logits(exported, IDS)
    assert (got - want).abs().max() <= 1e-4 * max(1.0, float(want.abs().max()))
    assert (got - before).abs().max() > 1e-4  # the adapter changed the model


@pytest.mark.parametrize("method", ["qlora", "full"])
@pytest.mark.parametrize("model_type", DENSE)
def test_dense_rungs(tmp_path, data_dir, model_type, method):
    from transformers import AutoModelForCausalLM

    model_dir, _, out = _train(tmp_path, data_dir, model_type, method)
    merged = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    got = _logits(merged, IDS)
    assert torch.isfinite(got).all()
    assert (got - _logits(base, IDS)).abs().max() > 1e-4  # two steps at lr 1e-2 moved the weights
