"""rules/vision.py: the class a run builds for an image-text checkpoint, decided from transformers'
own mappings and `data.images` (the rung's `images`), and which modules are the vision side."""

from __future__ import annotations

import pytest
import torch
from families import tiny_config
from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

from homelab_ft.rules import vision


@pytest.mark.parametrize("model_type, text_run, image_run", [
    ("llama", AutoModelForCausalLM, None),  # a text model reads no images
    ("gemma3", AutoModelForCausalLM, AutoModelForImageTextToText),  # both classes are Gemma3ForConditionalGeneration
    ("qwen3_5", AutoModelForCausalLM, AutoModelForImageTextToText),  # text runs: the text decoder alone, as before
    ("qwen2_vl", AutoModelForImageTextToText, AutoModelForImageTextToText),  # no causal-LM class at all
    ("llava", AutoModelForImageTextToText, AutoModelForImageTextToText),
])
def test_the_class_a_run_builds(model_type, text_run, image_run):
    config = tiny_config(model_type)
    assert vision.auto_class(config, images=False) is text_run
    if image_run is None:
        assert "data.images: llama is a text model" in vision.images_refusal(config, images=True)
    else:
        assert vision.auto_class(config, images=True) is image_run and vision.images_refusal(config, images=True) is None
    assert vision.images_refusal(config, images=False) is None
    if model_type == "qwen3_5":
        assert vision.model_class(config, images=False).__name__ == "Qwen3_5ForCausalLM"
        assert vision.model_class(config, images=True).__name__ == "Qwen3_5ForConditionalGeneration"


def test_the_vision_side_is_frozen_unless_listed_and_kept_out_of_4bit():
    config = tiny_config("qwen2_vl")
    config.vision_config.depth, config.vision_config.embed_dim, config.vision_config.num_heads = 2, 32, 2
    config.vision_config.hidden_size = config.text_config.hidden_size
    with torch.device("meta"):
        model = AutoModelForImageTextToText.from_config(config)
    assert vision.vision_prefixes(model) == ("model.visual",) and vision.quant_skip(model) == ["model.visual"]
    visual = {n for n, _ in model.named_parameters() if n.startswith("model.visual.")}
    assert vision.freeze(model) == vision.vision_param_count(model) > 0
    assert not any(p.requires_grad for n, p in model.named_parameters() if n in visual)
    assert all(p.requires_grad for n, p in model.named_parameters() if n not in visual)
    for p in model.parameters():
        p.requires_grad_(True)
    vision.freeze(model, targets=("merger.mlp.0",))  # a listed vision layer trains
    trained = {n for n, p in model.named_parameters() if p.requires_grad and n in visual}
    assert trained == {"model.visual.merger.mlp.0.weight", "model.visual.merger.mlp.0.bias"}
