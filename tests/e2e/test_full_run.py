"""A one-process full fine-tune end to end: its checkpoint consolidated into several safetensors
files with an index (what a 70B export is), and `export --dtype` honoured."""

from __future__ import annotations

import json

import build_recipe
import torch
from procs import write_chat_data
from safetensors import safe_open

from homelab_ft.cli.main import main
from homelab_ft.export.consolidate import consolidate_to_hf
from homelab_ft.store import checkpoint


def test_full_run_consolidates_to_several_files_and_exports_in_the_asked_dtype(tmp_path, tiny_model_dir):
    from transformers import AutoModelForCausalLM

    write_chat_data(tmp_path / "train.jsonl", 16)
    recipe = build_recipe.write_recipe(tmp_path / "full.yaml", build_recipe.tiny_run(
        tiny_model_dir, method="full", lora=None, data={"max_length": 96}, train={"micro_batch_size": 4, "lr": 1e-3}))
    run = tmp_path / "run"
    assert main(["train", str(recipe), "--run-dir", str(run)]) == 0
    ckpt = checkpoint.latest(run)

    out = tmp_path / "multi"
    param_bytes = sum(p.numel() * 4 for p in AutoModelForCausalLM.from_pretrained(tiny_model_dir).parameters())
    assert consolidate_to_hf(ckpt, tiny_model_dir, out, max_shard_bytes=param_bytes // 3) == 0.0
    index = json.loads((out / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) >= 3 and all((out / f).is_file() for f in files)
    ids = torch.randint(0, 200, (1, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        multi = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)(input_ids=ids).logits
    single = tmp_path / "single"
    consolidate_to_hf(ckpt, tiny_model_dir, single)
    with torch.no_grad():
        assert torch.equal(multi, AutoModelForCausalLM.from_pretrained(single, dtype=torch.float32)(input_ids=ids).logits)

    exported = tmp_path / "bf16"
    assert main(["export", str(run), "--out", str(exported), "--dtype", "bfloat16"]) == 0
    with safe_open(str(exported / "model.safetensors"), "pt") as fh:
        assert {fh.get_tensor(k).dtype for k in fh.keys()} == {torch.bfloat16}
