"""An image-text model's shape (plan/shape/derive.py, plan/shape/vision.py) against the model
transformers builds and runs, on one family of each way image tokens are counted
(tests/tiny_vlm.UNIT_FAMILIES; tests/e2e/test_vision_families.py runs the other five): the
family is planned (no causal-LM class needed), every loaded weight is priced once, and what the
vision side was measured to keep for backward and to hold at once on the meta device equals what the
same hooks count on the tiny model's real fp32 CPU forward (real SDPA kernels), at an image size
the measurement never saw."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[4]
sys.path.insert(0, str(ROOT / "tests"))
from tiny_vlm import UNIT_FAMILIES, save_families, tiny_vlm_config  # noqa: E402
from vision_checks import check_against_real_forward, check_planned_whole  # noqa: E402


@pytest.fixture(scope="module")
def saved_models(tmp_path_factory):
    """Each family saved once (config, weights, preprocessor_config.json), derived through the cache."""
    return save_families(tmp_path_factory.mktemp("vision-families"), UNIT_FAMILIES)


@pytest.mark.parametrize("model_type", UNIT_FAMILIES)
def test_an_image_text_family_is_planned_with_each_weight_once(model_type, saved_models):
    check_planned_whole(model_type, saved_models[model_type])


@pytest.mark.parametrize("model_type", UNIT_FAMILIES)
def test_measured_vision_costs_equal_a_real_cpu_forward(model_type, saved_models):
    check_against_real_forward(model_type, saved_models[model_type])


def test_the_fit_reads_a_parabola_a_line_and_a_fixed_count():
    from homelab_ft.plan.shape.vision import fit

    assert fit([64, 256, 576], [3 + 2 * t + 0.5 * t * t for t in (64, 256, 576)]) == pytest.approx((3, 2, 0.5))
    assert fit([64, 256, 576], [100 * t - 0.01 * t * t for t in (64, 256, 576)])[2] == 0  # never bends down
    assert fit([256, 256, 256], [5120.0] * 3) == (0.0, 20.0, 0.0)  # Gemma 3: the one cost is per token of the image


def test_an_unrunnable_vision_side_is_priced_by_its_weights_and_says_why(monkeypatch):
    from homelab_ft.plan.shape import vision
    from homelab_ft.plan.shape.derive import build_on_meta

    def refuse(*args, **kwargs):
        raise RuntimeError("Tensor.item() cannot be called on meta tensors")

    monkeypatch.setattr(vision, "_measured", refuse)
    config = tiny_vlm_config("qwen2_vl")
    sight = vision.measure_vision(lambda dtype: build_on_meta(config, attn_implementation="sdpa", dtype=dtype),
                                  model_path=None)
    assert sight.params > 0 and "meta device (RuntimeError: Tensor.item()" in sight.unmeasured
    assert sight.saved_bytes(2, 100) == 0
