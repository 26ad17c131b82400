"""An image-text model's shape (plan/shape/derive.py, plan/shape/vision.py) against the model
transformers builds and runs: every family of tests/vision_families.py is planned (no causal-LM
class needed), every loaded weight is priced once, and what the vision side was measured to keep for
backward and to hold at once on the meta device equals what the same hooks count on the tiny model's
real fp32 CPU forward (real SDPA kernels), at an image size the measurement never saw."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[4]
sys.path.insert(0, str(ROOT / "tests"))
from vision_families import VISION_FAMILIES, image_processor, save_tiny_vision, tiny_vision_config  # noqa: E402

from homelab_ft.plan.shape.shapes import model_shape  # noqa: E402


@pytest.fixture(scope="module")
def saved_models(tmp_path_factory):
    """Each family saved once (config, weights, preprocessor_config.json), derived through the cache."""
    root = tmp_path_factory.mktemp("vision-families")
    return {family: save_tiny_vision(root / family, family, with_tokenizer=False) for family in VISION_FAMILIES}


def _shape(folder: Path):
    return model_shape(json.loads((folder / "config.json").read_text()), model_path=str(folder))


@pytest.mark.parametrize("model_type", VISION_FAMILIES)
def test_every_image_text_family_is_planned_with_each_weight_once(model_type, saved_models):
    import torch
    from transformers import AutoModelForImageTextToText

    folder = saved_models[model_type]
    shape = _shape(folder)
    model = AutoModelForImageTextToText.from_pretrained(folder)
    language = model.get_decoder()
    assert shape.total_params + shape.vision_params == sum(p.numel() for p in model.parameters())
    assert shape.num_layers == len(language.layers) and shape.model_type == model.config.get_text_config().model_type
    assert not shape.vision.unmeasured and shape.vision.image_processor == type(image_processor(model_type)).__name__
    vision_linears = {n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)} - {
        n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and (
            n.startswith(next(k for k, v in model.named_modules() if v is language)) or m is model.get_output_embeddings())}
    assert {lin.name for lin in shape.vision.linears} == vision_linears


def _real_saved_and_peak(model, inputs) -> tuple[int, int, int]:
    """(image tokens, bytes saved for backward, the most bytes held at once without grad) of the real
    model's vision side: its own kernels, no stand-in."""
    import torch

    from homelab_ft.plan.shape import vision

    skip = {vision._storage_id(t) for t in (*model.parameters(), *model.buffers(), *inputs.values())}
    seen, keep = set(), []

    def pack(t):
        keep.append(t)
        if vision._storage_id(t) not in skip:
            seen.add(vision._storage_id(t))
            sizes[vision._storage_id(t)] = t.untyped_storage().nbytes()
        return t

    sizes: dict[int, int] = {}
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        tokens = vision._rows(model.get_image_features(**inputs))
    tracker = vision._RealUntilWeights(track=True)
    with tracker, torch.no_grad():
        model.get_image_features(**inputs)
    return tokens, sum(sizes.values()), tracker.peak


@pytest.mark.parametrize("model_type", VISION_FAMILIES)
def test_measured_vision_costs_equal_a_real_cpu_forward(model_type, saved_models):
    """At 448 x 336 px (never measured: the three measured images are square), the tokens the shape
    predicts are what the real vision side returns, and its saved and held bytes per image are the real
    forward's within 3%. Costs follow patches, priced through image tokens at a fixed number of patches
    per token: where a grid side is odd (Pixtral merges 2x2 patches and drops the odd column), the
    image costs more than priced: 6% more saved bytes at 560 x 392 on the tiny Pixtral (23 patch
    columns), under 3% at a real 1024 x 768 photo (73)."""
    import torch
    from transformers import AutoModelForImageTextToText

    from homelab_ft.plan.shape import vision

    shape = _shape(saved_models[model_type])
    torch.manual_seed(0)
    model = AutoModelForImageTextToText.from_config(tiny_vision_config(model_type), attn_implementation="sdpa")
    inputs = vision.vision_inputs(model, image_processor(model_type), height=336, width=448)
    tokens, saved, peak = _real_saved_and_peak(model, inputs)
    sight = shape.vision
    assert tokens == vision.image_tokens(model, inputs) > 0
    assert saved == pytest.approx(sight.saved_bytes(4, tokens), rel=0.03)
    assert peak == pytest.approx(sight.transient_bytes(4, tokens), rel=0.03)
    assert sight.forward_flops(tokens) > sight.forward_flops(tokens / 2) > 0


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
    config = tiny_vision_config("qwen2_vl")
    sight = vision.measure_vision(lambda dtype: build_on_meta(config, attn_implementation="sdpa", dtype=dtype),
                                  model_path=None)
    assert sight.params > 0 and "meta device" in sight.unmeasured and sight.saved_bytes(2, 100) == 0
