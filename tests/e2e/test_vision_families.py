"""The image-text families the unit tests leave out (tests/tiny_vlm.E2E_FAMILIES: Qwen2.5-VL,
Qwen3-VL, Llava, InternVL, PaliGemma), through the same checks as tests/unit/plan/shape/test_vision_shape.py
and test_image_tokens.py: planned with every loaded weight priced once, the vision side's measured
bytes a real fp32 CPU forward's within 3%, the counted image tokens what the real model accepts at
four sizes, and what the real Llava and PaliGemma processors expand an image to. ~30 CPU s."""

from __future__ import annotations

import pytest
from tiny_vlm import E2E_FAMILIES, save_families
from vision_checks import check_accepted_tokens, check_against_real_forward, check_planned_whole, check_processor_expansion


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    return save_families(tmp_path_factory.mktemp("vision-families-e2e"), E2E_FAMILIES)


@pytest.mark.parametrize("model_type", E2E_FAMILIES)
def test_the_family_is_planned_measured_and_counted(model_type, folders):
    check_planned_whole(model_type, folders[model_type])
    check_against_real_forward(model_type, folders[model_type])
    check_accepted_tokens(folders[model_type])


@pytest.mark.parametrize("model_type", ["llava", "paligemma"])
def test_the_real_processor_expands_an_image_to_the_counted_tokens(model_type, folders):
    check_processor_expansion(model_type, folders[model_type])
