"""Where models come from: local dirs, cached hub ids, GGUF files; all offline."""

from __future__ import annotations

import shutil

import pytest
import torch

from homelab_ft import modeling
from homelab_ft.config import LoraConfig, ModelConfig
from homelab_ft.errors import UserError


def test_local_dir_and_bad_paths(tmp_path, tiny_model_dir):
    assert modeling.resolve_model_dir(str(tiny_model_dir)) == tiny_model_dir
    (tmp_path / "empty").mkdir()
    with pytest.raises(UserError, match="no config.json"):
        modeling.resolve_model_dir(str(tmp_path / "empty"))
    (tmp_path / "weights.bin").write_text("x")
    with pytest.raises(UserError, match="is a file"):
        modeling.resolve_model_dir(str(tmp_path / "weights.bin"))


def test_hub_id_is_found_in_the_local_cache_only(tmp_path, tiny_model_dir, monkeypatch):
    cache = tmp_path / "hub"
    repo = cache / "models--acme--tiny-llama"
    snapshot = repo / "snapshots" / "0123abcd"
    shutil.copytree(tiny_model_dir, snapshot)
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text("0123abcd")
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    assert modeling.resolve_model_dir("acme/tiny-llama") == snapshot
    with pytest.raises(UserError, match="hf download acme/other"):
        modeling.resolve_model_dir("acme/other")


def test_lora_attaches_to_all_linear_layers_but_the_head(tiny_model_dir):
    cfg = ModelConfig(path=str(tiny_model_dir))
    model = modeling.load_model(cfg, tiny_model_dir, dtype=torch.float32, device=torch.device("cpu"))
    peft_model = modeling.attach_lora(model, LoraConfig(r=4, alpha=8))
    names = {n.split(".lora_A")[0].rsplit(".", 1)[-1] for n, _ in peft_model.named_parameters() if "lora_A" in n}
    assert names == {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}
    trainable, total = modeling.count_params(peft_model)
    assert 0 < trainable < total


def test_unknown_target_module_is_a_user_error(tiny_model_dir):
    cfg = ModelConfig(path=str(tiny_model_dir))
    model = modeling.load_model(cfg, tiny_model_dir, dtype=torch.float32, device=torch.device("cpu"))
    with pytest.raises(UserError, match="lora.target_modules"):
        modeling.attach_lora(model, LoraConfig(target_modules=["no_such_proj"]))
