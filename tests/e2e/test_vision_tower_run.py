"""A text fine-tune of a checkpoint whose causal-LM class loads a vision tower (Gemma 3: transformers'
`AutoModelForCausalLM` builds `Gemma3ForConditionalGeneration`), rules/vision.py: the plan prices the
tower and projector as frozen weights, `all-linear` wraps the language model only, and a full
fine-tune leaves the tower's weights as they were. Before, the plan priced the text decoder alone
and LoRA wrapped the SigLIP tower's projections too."""

from __future__ import annotations

import json
import re

import build_recipe
import procs
import pytest
import torch
from families import tiny_config
from safetensors.torch import load_file

from homelab_ft.cli.main import main

VISION = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 2,
          "image_size": 56, "patch_size": 14}


@pytest.fixture(scope="module")
def gemma3_dir(tmp_path_factory):
    from tiny import make_tokenizer
    from transformers import AutoModelForCausalLM, GenerationConfig

    out = tmp_path_factory.mktemp("gemma3-vlm")
    make_tokenizer(out, vocab_size=320)
    config = tiny_config("gemma3")
    for key, value in VISION.items():
        setattr(config.vision_config, key, value)
    config.mm_tokens_per_image = 4
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    model.generation_config = GenerationConfig(bos_token_id=1, eos_token_id=2, pad_token_id=0)
    model.save_pretrained(out)
    return out


def _vision_count(model) -> int:
    return sum(p.numel() for name, p in model.named_parameters()
               if name.startswith(("model.vision_tower.", "model.multi_modal_projector.")))


def test_the_plan_prices_the_tower_and_lora_wraps_the_language_model_only(gemma3_dir):
    from transformers import AutoModelForCausalLM

    from homelab_ft.model import loading
    from homelab_ft.plan.planner import request_from_recipe
    from homelab_ft.plan.price.params import trainable_params
    from homelab_ft.plan.shape.derive import derive_shape
    from homelab_ft.recipe.config import recipe_from_dict
    from homelab_ft.rules import lora_targets

    model = AutoModelForCausalLM.from_pretrained(gemma3_dir)
    assert type(model).__name__ == "Gemma3ForConditionalGeneration"
    shape = derive_shape(json.loads((gemma3_dir / "config.json").read_text()))
    assert shape.vision_params == _vision_count(model) > 0
    unique = {id(p): p.numel() for p in model.parameters()}
    assert shape.total_params + shape.vision_params == sum(unique.values())  # every loaded weight priced once
    assert not [n for n in lora_targets.wrapped_names(model) if "vision_tower" in n or "multi_modal_projector" in n]

    recipe = recipe_from_dict(build_recipe.tiny_run(gemma3_dir))
    peft_model = loading.attach_lora(model, recipe.lora)
    wrapped = [n for n, _ in peft_model.named_modules() if n.endswith(".lora_A")]
    assert wrapped and not [n for n in wrapped if "vision_tower" in n or "multi_modal_projector" in n]
    trained = sum(p.numel() for p in peft_model.parameters() if p.requires_grad)
    assert trained == trainable_params(shape, request_from_recipe(recipe))


def test_a_full_finetune_trains_the_language_model_and_leaves_the_tower(gemma3_dir, tmp_path, capsys):
    procs.write_chat_data(tmp_path / "train.jsonl", 8)
    recipe = build_recipe.write_recipe(tmp_path / "r.yaml", build_recipe.tiny_run(
        gemma3_dir, method="full", rows=tmp_path / "train.jsonl", train={"max_steps": 2, "lr": 1e-3}))
    assert main(["plan", str(recipe)]) == 0
    assert "vision, frozen" in capsys.readouterr().out
    run = tmp_path / "run"
    assert main(["train", str(recipe), "--run-dir", str(run)]) == 0
    from homelab_ft.plan.shape.derive import derive_shape

    shape = derive_shape(json.loads((gemma3_dir / "config.json").read_text()))
    counts = re.search(r"full \(no_shard\): ([\d,]+) trainable of ([\d,]+) parameters", capsys.readouterr().out)
    trainable, total = (int(g.replace(",", "")) for g in counts.groups())
    assert (trainable, total) == (shape.total_params, shape.total_params + shape.vision_params)  # the tower frozen
    assert main(["export", str(run), "--out", str(tmp_path / "out"), "--format", "safetensors"]) == 0
    base, trained = load_file(gemma3_dir / "model.safetensors"), load_file(tmp_path / "out" / "model.safetensors")
    # save_pretrained writes Gemma 3's original layout: vision_tower.*, multi_modal_projector.*, language_model.model.*
    vision = [k for k in base if k.startswith(("vision_tower.", "multi_modal_projector."))]
    language = [k for k in base if k.startswith("language_model.") and k.endswith("proj.weight")]
    assert vision and language
    assert all(torch.equal(base[k], trained[k]) for k in vision)
    assert all(not torch.equal(base[k], trained[k]) for k in language)
