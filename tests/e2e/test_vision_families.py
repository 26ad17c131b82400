"""The image-text families the unit tests leave out (tests/tiny_vlm.E2E_FAMILIES: Qwen2.5-VL,
Qwen3-VL, Gemma 3, SmolVLM, Llava, Mistral 3, InternVL, PaliGemma), through the same checks as
tests/unit/plan/shape/test_vision_shape.py and test_image_tokens.py: planned with every loaded weight
priced once, the vision side's measured bytes a real fp32 CPU forward's within 3%, the counted image
tokens what the real model accepts at four sizes and never fewer for more pixels, and what the real
Gemma 3, Llava and PaliGemma processors expand an image to; and Llama 4's text and image runs
derived as the classes they build. ~45 CPU s."""

from __future__ import annotations

import pytest
from tiny_vlm import E2E_FAMILIES, save_families, save_vlm
from vision_checks import (
    check_accepted_tokens,
    check_against_real_forward,
    check_more_pixels,
    check_planned_whole,
    check_processor_expansion,
)


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    return save_families(tmp_path_factory.mktemp("vision-families-e2e"), E2E_FAMILIES)


@pytest.mark.parametrize("model_type", E2E_FAMILIES)
def test_the_family_is_planned_measured_and_counted(model_type, folders):
    check_planned_whole(model_type, folders[model_type])
    check_against_real_forward(model_type, folders[model_type])
    check_accepted_tokens(folders[model_type])
    check_more_pixels(folders[model_type])


@pytest.mark.parametrize("model_type", ["gemma3", "llava", "paligemma"])
def test_the_real_processor_expands_an_image_to_the_counted_tokens(model_type, folders):
    check_processor_expansion(model_type, folders[model_type])


def test_an_image_run_is_priced_as_the_class_it_builds(tmp_path):
    """Llama 4's causal-LM class is its text decoder: a text run's shape has no tower, an image run's
    (data.images, derived apart) has it, its language model the same, and each names the input
    embedding as the class it builds does (`model.embed_tokens`, `language_model.model.embed_tokens`:
    what lora.target_modules and the embedding offload rule match)."""
    import json

    import torch
    from transformers import AutoConfig

    from homelab_ft.plan.shape.shapes import model_shape
    from homelab_ft.rules import vision

    folder = save_vlm(tmp_path / "llama4", "llama4", weights=False)
    config = json.loads((folder / "config.json").read_text())
    text, image = (model_shape(config, model_path=str(folder), images=images) for images in (False, True))
    names = []
    for shape, hf_config, images in ((text, AutoConfig.from_pretrained(folder).get_text_config(), False),
                                     (image, AutoConfig.from_pretrained(folder), True)):
        with torch.device("meta"):
            built = vision.auto_class(hf_config, images=images).from_config(hf_config)
        embed = built.get_input_embeddings()
        names.append(next(n for n, m in built.named_modules() if m is embed))
        assert shape.embedding_name == names[-1]
    assert names == ["model.embed_tokens", "language_model.model.embed_tokens"]
    assert text.vision is None and image.vision.params == vision.vision_param_count(built) > 0
    assert (image.num_layers, image.total_params) == (text.num_layers, text.total_params)
    assert "a text run builds, counts and trains only its text decoder" in " ".join(text.notes)
