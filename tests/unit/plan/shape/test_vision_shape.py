"""An image-text model's shape (plan/shape/derive.py, plan/shape/vision.py) against the model
transformers builds and runs, on a family whose image tokens grow with the image
(tests/tiny_vlm.UNIT_FAMILIES; tests/e2e/test_vision_families.py runs the other eight): the
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
from tiny_vlm import UNIT_FAMILIES, tiny_vlm_config  # noqa: E402
from vision_checks import check_against_real_forward, check_planned_whole  # noqa: E402


@pytest.mark.parametrize("model_type", UNIT_FAMILIES)
def test_an_image_text_family_is_planned_with_each_weight_once(model_type, vlm_folders):
    check_planned_whole(model_type, vlm_folders[model_type])


@pytest.mark.parametrize("model_type", UNIT_FAMILIES)
def test_measured_vision_costs_equal_a_real_cpu_forward(model_type, vlm_folders):
    check_against_real_forward(model_type, vlm_folders[model_type])


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


def test_an_image_run_builds_the_image_text_class(tmp_path):
    """What derive.py builds for a run: Llama 4's causal-LM class is its text decoder, so a text run's
    config is its text config and an image run's the whole checkpoint's, built as
    AutoModelForImageTextToText with its tower (tests/e2e/test_vision_families.py derives both)."""
    import json

    from tiny_vlm import save_vlm

    from homelab_ft.plan.shape import derive
    from homelab_ft.rules import vision

    folder = save_vlm(tmp_path / "llama4", "llama4", weights=False)
    config = json.loads((folder / "config.json").read_text())
    text, notes = derive.loaded_config(config, model_path=str(folder), trust_remote_code=False)
    whole, none = derive.loaded_config(config, model_path=str(folder), trust_remote_code=False, images=True)
    assert text.model_type == "llama4_text" and "a text run builds, counts and trains only" in notes[0]
    assert whole.model_type == "llama4" and none == ()
    model = derive.build_on_meta(whole, attn_implementation="sdpa", images=True)
    assert vision.vision_prefixes(model) == ("vision_model", "multi_modal_projector")
    assert type(derive.build_on_meta(text, attn_implementation="sdpa")).__name__ == "Llama4ForCausalLM"


def test_a_text_run_that_loads_the_tower_and_an_image_run_share_one_derivation(tmp_path, monkeypatch):
    """plan/shape/cache.py: where a text run builds the image-text class (its shape has a vision side:
    Gemma 3, Qwen2-VL), the image run's shape is the same model, stored once derived, either way
    round; where it does not (Llama 4, Qwen 3.5), each run derives its own."""
    from homelab_ft.plan.shape import cache, derive
    from homelab_ft.plan.shape.types import ModelShape, VisionShape

    monkeypatch.setenv("HOMELAB_FT_CACHE", str(tmp_path))
    derived = []

    def fake(config, *, images, **where):
        derived.append((config["model_type"], images))
        tower = VisionShape(params=10) if images or config["model_type"] == "gemma3" else None
        return ModelShape(model_type="t", vocab_size=8, hidden_size=4, num_layers=1, max_position_embeddings=8,
                          tie_word_embeddings=True, blocks=(), embedding_params=32, lm_head_params=0,
                          other_root_params=0, largest_param=32, vision=tower)

    monkeypatch.setattr(derive, "derive_shape", fake)
    monkeypatch.setattr(derive, "text_run_loads_tower", lambda config, **where: config["model_type"] == "gemma3")
    for model_type in ("gemma3", "llama4"):
        for images in (False, True, False, True):
            shape = cache.cached_shape({"model_type": model_type}, images=images)
            assert (shape.vision is not None) == (images or model_type == "gemma3")
    cache.cached_shape({"model_type": "qwen2_vl_like"}, images=True)  # derived for the image run first
    monkeypatch.setattr(derive, "text_run_loads_tower", lambda config, **where: True)
    cache.cached_shape({"model_type": "gemma3", "x": 1}, images=True)
    cache.cached_shape({"model_type": "gemma3", "x": 1}, images=False)
    assert derived == [("gemma3", False), ("llama4", False), ("llama4", True), ("qwen2_vl_like", True),
                       ("gemma3", True)]
