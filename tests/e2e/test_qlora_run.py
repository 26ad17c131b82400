"""A whole QLoRA run on CPU: train with eval passes between steps, crash, resume, export."""

from __future__ import annotations

from pathlib import Path

import build_recipe
import pytest
import torch

bnb = pytest.importorskip("bitsandbytes")


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory) -> Path:
    from tiny import make_llama

    return make_llama(tmp_path_factory.mktemp("qlora-llama"), hidden_size=64, intermediate_size=128)




@pytest.mark.parametrize("quant_section", [{}, {"bits": 8}], ids=["nf4", "int8"])
def test_qlora_train_eval_resume_export(llama_dir, tmp_path, quant_section):
    """Train with eval passes between steps (the repack trigger), crash, resume to the same losses,
    export into the full-precision base and reload it with plain transformers."""
    import json
    import shutil

    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from homelab_ft.cli.main import main
    from homelab_ft.train.metrics import read_metrics

    words = "the quick brown fox jumps over lazy dog answer yes no paris".split()
    gen = torch.Generator().manual_seed(0)
    with (tmp_path / "train.jsonl").open("w") as fh:
        for _ in range(40):
            q = " ".join(words[int(i)] for i in torch.randint(0, len(words), (5,), generator=gen))
            fh.write(json.dumps({"messages": [{"role": "user", "content": q},
                                              {"role": "assistant", "content": f"answer: {q.split()[0]}"}]}) + "\n")
    recipe = build_recipe.write_recipe(tmp_path / "qlora.yaml", build_recipe.tiny_run(
        llama_dir, method="qlora", quant=quant_section, lora={"r": 8, "alpha": 16},
        data={"eval_fraction": 0.2, "max_length": 128},
        train={"max_steps": 6, "micro_batch_size": 4, "lr": 1e-2, "eval_every": 2, "save_every": 3, "keep_last": 5}))
    run = tmp_path / "run"

    def losses():
        return {r["step"]: r["loss"] for r in read_metrics(run / "metrics.jsonl") if "loss" in r}

    assert main(["train", str(recipe), "--run-dir", str(run)]) == 0
    full = losses()
    assert full[6] < full[1]
    shutil.rmtree(run / "checkpoints" / "step_000006")
    assert main(["train", str(recipe), "--run-dir", str(run), "--resume"]) == 0
    resumed = losses()
    for step in (4, 5, 6):
        assert resumed[step] == pytest.approx(full[step], abs=1e-6), step

    out = tmp_path / "export"
    assert main(["export", str(run), "--out", str(out)]) == 0
    merged = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    assert not any(isinstance(m, (bnb.nn.Linear4bit, bnb.nn.Linear8bitLt)) for m in merged.modules())
    base = AutoModelForCausalLM.from_pretrained(llama_dir, dtype=torch.float32)
    reference = PeftModel.from_pretrained(base, run / "checkpoints" / "step_000006" / "adapter").eval()
    ids = torch.randint(0, 300, (2, 16), generator=gen)
    with torch.no_grad():
        got, want = merged(input_ids=ids).logits, reference(input_ids=ids).logits
        assert (got - want).abs().max() <= 1e-4
        assert (got - AutoModelForCausalLM.from_pretrained(llama_dir)(input_ids=ids).logits).abs().max() > 1e-3


