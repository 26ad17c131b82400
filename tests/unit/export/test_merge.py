"""The file-by-file LoRA merge (merge.py) against PEFT's own merge_and_unload."""

from __future__ import annotations

import json

import pytest
import torch

from homelab_ft.export import merge


def _adapter(model_dir, out, **lora_kwargs):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(3)
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"], init_lora_weights=False,
                        **lora_kwargs)
    peft_model = get_peft_model(base, config)
    peft_model.save_pretrained(out)
    return peft_model


@pytest.mark.parametrize("shards", [1, 3], ids=["one-file", "indexed"])
def test_file_by_file_merge_equals_peft(tmp_path, tiny_model_dir, shards):
    from transformers import AutoModelForCausalLM

    base_dir = tiny_model_dir
    if shards > 1:  # the base as several files with an index, as the Hub ships big models
        model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
        size = sum(p.numel() * 4 for p in model.parameters())
        base_dir = tmp_path / "sharded-base"
        model.save_pretrained(base_dir, max_shard_size=size // shards)
        assert len(merge.base_files(base_dir)) >= 3
    peft_model = _adapter(base_dir, tmp_path / "adapter", use_rslora=True)
    assert merge.unsupported_reason(tmp_path / "adapter", base_dir) is None
    stats = merge.merge_files(tmp_path / "adapter", base_dir, tmp_path / "out", dtype=torch.float32)
    assert stats["merged"] == 3 * 2 and stats["files"] == len(merge.base_files(base_dir))  # 3 modules x 2 layers
    assert merge.check_written(tmp_path / "adapter", base_dir, tmp_path / "out", dtype=torch.float32) == 0.0

    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "out", dtype=torch.float32).eval()
    reference = peft_model.merge_and_unload().eval()
    ids = torch.randint(0, 200, (2, 10), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert (merged(input_ids=ids).logits - reference(input_ids=ids).logits).abs().max() <= 1e-5
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["dtype"] == "float32" and "quantization_config" not in config


def test_merge_in_bf16_rounds_once(tmp_path, tiny_model_dir):
    _adapter(tiny_model_dir, tmp_path / "adapter")
    merge.merge_files(tmp_path / "adapter", tiny_model_dir, tmp_path / "out", dtype=torch.bfloat16)
    assert merge.check_written(tmp_path / "adapter", tiny_model_dir, tmp_path / "out", dtype=torch.bfloat16) == 0.0
    from safetensors import safe_open

    with safe_open(str(tmp_path / "out" / "model.safetensors"), "pt") as fh:
        assert {fh.get_tensor(k).dtype for k in fh.keys()} == {torch.bfloat16}


def test_adapters_it_cannot_stream_are_named(tmp_path, tiny_model_dir):
    _adapter(tiny_model_dir, tmp_path / "dora", use_dora=True)
    assert "DoRA" in merge.unsupported_reason(tmp_path / "dora", tiny_model_dir)


def test_merged_files_get_the_folder_mode(tmp_path, tiny_model_dir, umask_027):
    """Issue 39.4: safetensors 0.8 writes mode 600; the merged weights get what the config beside them gets."""
    from tiny import file_modes

    _adapter(tiny_model_dir, tmp_path / "adapter")
    merge.merge_files(tmp_path / "adapter", tiny_model_dir, tmp_path / "out", dtype=torch.float32)
    modes = file_modes(tmp_path / "out")
    assert "model.safetensors" in modes and set(modes.values()) == {umask_027}, modes
