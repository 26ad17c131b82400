"""What an image-text model's images cost in the plan (plan/price/images.py, planner.recipe_images,
report.image_lines), table-driven and with properties: the images per row priced (measured rows, a
bound, none), the frozen tower's working set beside the language model, a tower with adapters keeping
its activations, more pixels never fewer tokens or less memory or time, and the `images` line."""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[4]
sys.path.insert(0, str(ROOT / "tests"))

from homelab_ft.plan.inputs import Cluster, RowImages  # noqa: E402
from homelab_ft.plan.ladder import option_rung  # noqa: E402
from homelab_ft.plan.planner import plan_for_recipe, recipe_shape, request_from_recipe  # noqa: E402
from homelab_ft.plan.price import images  # noqa: E402
from homelab_ft.plan.price.memory import Memory, estimate  # noqa: E402
from homelab_ft.plan.report import format_plan  # noqa: E402
from homelab_ft.recipe.config import recipe_from_dict  # noqa: E402

CPU = Cluster(device="cpu", nodes=1, gpus_per_node=1, device_bytes=8 << 30, host_ram_bytes=8 << 30, tflops=0.05)


def _fixed(shape, request, *, tokens: int = 4):
    """`shape` and `request` as a family whose every image is `tokens` tokens (Gemma 3's 256, Llava's
    576): the measured points all one count, no bound set (tests/e2e/test_vision_families.py measures
    such families themselves)."""
    points = tuple((side, side, tokens) for side, _, _ in shape.vision.points)
    shape = dataclasses.replace(shape, vision=dataclasses.replace(shape.vision, points=points))
    return shape, dataclasses.replace(request, images=RowImages(tokens_per_image=tokens, size=(768, 768), bounded=False))


def _recipe(folder: Path, **data):
    return recipe_from_dict({"model": {"path": str(folder)}, "method": "lora",
                             "data": {"max_length": 512, "images": True, **data}, "train": {"micro_batch_size": 2}})


def _priced(folder: Path, *, counts=(), lora=None, **data):
    recipe = _recipe(folder, **data)
    if lora:
        recipe = dataclasses.replace(recipe, lora=dataclasses.replace(recipe.lora, **lora))
    shape, _ = recipe_shape(recipe)
    from homelab_ft.plan.planner import recipe_images

    request = request_from_recipe(recipe, images=recipe_images(recipe, shape, counts=counts))
    rung = option_rung("lora", "no_shard", False, request=request, cluster=CPU)
    return shape, request, estimate(shape, rung=rung, request=request, cluster=CPU)


def test_a_row_is_priced_at_its_measured_images_else_one_at_the_bound(vlm_folders):
    shape, request, _ = _priced(vlm_folders["qwen2_vl"], image_max_pixels=224 * 224)
    assert request.images.size == (224, 224) and request.images.tokens_per_image == 64 and request.images.bounded
    assert images.row_images(shape, request, timed=False) == (1, 64)
    measured = ((0, 0, 3), (1, 64, 4), (2, 300, 1))  # (images, image tokens, rows)
    shape, request, _ = _priced(vlm_folders["qwen2_vl"], counts=measured, image_max_pixels=224 * 224)
    assert images.row_images(shape, request, timed=False) == (2, 300)  # memory: the row with the most
    assert images.row_images(shape, request, timed=True) == pytest.approx((6 / 8, 556 / 8))  # time: the mean


def test_without_a_bound_a_growing_count_may_fill_the_row_and_a_fixed_one_does_not(vlm_folders):
    shape, request, _ = _priced(vlm_folders["qwen2_vl"])
    assert not request.images.bounded and request.images.size == (images.REFERENCE_SIDE, images.REFERENCE_SIDE)
    assert images.row_images(shape, request, timed=False) == (1, 512)  # data.max_length
    shape, request = _fixed(shape, request)
    assert images.row_images(shape, request, timed=False) == (1, 4)  # a fixed count: 4 tokens whatever the size


def test_the_frozen_towers_working_set_is_held_before_the_language_models_activations(vlm_folders):
    shape, request, est = _priced(vlm_folders["qwen2_vl"], image_max_pixels=448 * 448)
    m = est.memory
    saved, held = images.vision_bytes(shape, rung=option_rung("lora", "no_shard", False, request=request, cluster=CPU),
                                      request=request, act_bytes=4)
    assert saved == 0 and m.vision_forward == held == pytest.approx(shape.vision.transient_bytes(4, 256, 2), rel=1e-6)
    # the peak is the larger of the tower's moment and the language model's, never their sum
    base = dict(weights=100, gradients=0, optimizer=10, logits=5, gathered=0, context=0)
    assert Memory(**base, activations=50, vision_forward=30).forward_backward == 165
    assert Memory(**base, activations=50, vision_forward=80).forward_backward == 190


def test_adapters_in_the_tower_keep_its_activations_and_triple_its_seconds(vlm_folders):
    frozen_shape, frozen_request, frozen = _priced(vlm_folders["qwen2_vl"], image_max_pixels=448 * 448)
    name = frozen_shape.vision.linears[0].name.rpartition(".")[2]  # a vision layer's own name, e.g. `qkv`
    shape, request, trained = _priced(vlm_folders["qwen2_vl"], image_max_pixels=448 * 448,
                                      lora={"target_modules": ("q_proj", name)})
    rung = option_rung("lora", "no_shard", False, request=request, cluster=CPU)
    assert images.tower_trained(shape, rung=rung, request=request)
    assert not images.tower_trained(frozen_shape, rung=rung, request=frozen_request)  # all-linear leaves it out
    kept = shape.vision.saved_bytes(4, 256, 2)
    assert kept > 0 and trained.memory.vision_forward == pytest.approx(frozen.memory.vision_forward + kept, rel=1e-6)
    from homelab_ft.plan.price.params import trainable_params
    from homelab_ft.plan.report import lora_text

    adapters = sum(request.lora.r * (lin.in_features + lin.out_features) for lin in shape.vision.linears if lin.name.endswith(name))
    assert adapters and trainable_params(shape, request) >= adapters  # the tower's adapters train
    assert f"vision tower: {{{name}}} in " in lora_text(shape, request)
    tower_s = images.vision_s(frozen_shape, rung=rung, request=frozen_request, cluster=CPU)
    assert images.vision_s(shape, rung=rung, request=request, cluster=CPU) == pytest.approx(3 * tower_s)


def test_adapters_only_in_the_tower_are_priced_at_its_widest_layer(vlm_folders):
    """lora.target_modules naming vision layers alone: no language-model linear is adapted, and the
    optimizer step's temporaries are sized by the widest vision layer (an empty language-model set
    raised ValueError from max() in a full fine-tune's ladder, which prices LoRA and QLoRA too)."""
    from homelab_ft.plan.price.memory import step_temporary_bytes
    from homelab_ft.plan.price.params import trainable_params

    shape, _, _ = _priced(vlm_folders["qwen2_vl"])
    name = shape.vision.linears[0].name.rpartition(".")[2]
    shape, request, priced = _priced(vlm_folders["qwen2_vl"], lora={"target_modules": (name,)})
    rung = option_rung("lora", "no_shard", False, request=request, cluster=CPU)
    trainable = trainable_params(shape, request)
    widest = max(lin.in_features + lin.out_features for lin in shape.vision.linears if lin.name.endswith(name))
    assert trainable > 0 and priced.memory.total > 0
    from homelab_ft.plan.price.params import optimizer_step_bytes

    assert step_temporary_bytes(shape, rung, request, CPU, trainable=trainable, state_bytes=4, in_backward=False) == \
        optimizer_step_bytes(request, CPU, params=trainable, largest=widest * request.lora.r, state_bytes=4)


def test_adapters_named_on_the_projector_alone_are_priced_on_every_rung(vlm_folders):
    """A full fine-tune that trains the projector too (lora.target_modules naming only it): the ladder
    prices its LoRA rungs with those adapters alone, whose widest sizes the optimizer step (it found
    no targeted layer in the language model's blocks and stopped: max() of nothing)."""
    shape, _, _ = _priced(vlm_folders["qwen2_vl"])
    projector = shape.vision.linears[-1].name  # model.visual.merger.mlp.2
    recipe = dataclasses.replace(_recipe(vlm_folders["qwen2_vl"]), method="full")
    recipe = dataclasses.replace(recipe, lora=dataclasses.replace(recipe.lora, target_modules=(projector,)))
    result = plan_for_recipe(recipe, cluster=CPU)
    assert result.chosen.method == "full" and {o.method for o in result.options} >= {"lora", "full"}
    lora = next(o for o in result.options if o.method == "lora")
    assert lora.trainable_params == 16 * (shape.vision.linears[-1].in_features + shape.vision.linears[-1].out_features)


def test_more_pixels_never_fewer_tokens_nor_less_memory_or_time(vlm_folders):
    previous = None
    for side in (112, 224, 336, 448, 672):
        shape, request, est = _priced(vlm_folders["qwen2_vl"], image_max_pixels=side * side)
        now = (request.images.tokens_per_image, est.memory.vision_forward, est.memory.total, est.compute_s)
        assert previous is None or all(a <= b for a, b in zip(previous, now, strict=True)), (side, previous, now)
        previous = now
    assert previous[0] > 64


def test_a_text_model_and_a_text_run_have_no_images(tmp_path, vlm_folders):
    from families import save_tiny

    folder = save_tiny(tmp_path / "llama", "llama", with_tokenizer=False)
    shape, request, _ = _priced(folder)
    assert shape.vision is None and request.images is None
    assert images.row_images(shape, request, timed=False) == (0.0, 0.0)
    # a text run of an image-text checkpoint loads the tower (priced as weights) and shows it no image
    shape, request, est = _priced(vlm_folders["qwen2_vl"], images=False)
    assert shape.vision is not None and request.images is None and est.memory.vision_forward == 0


def test_the_plan_says_what_an_image_costs(vlm_folders):
    text = format_plan(plan_for_recipe(_recipe(vlm_folders["qwen2_vl"], image_max_pixels=448 * 448), cluster=CPU))
    line = next(line for line in text.splitlines() if line.startswith("images"))
    assert ("~256 tokens per image at 448x448, data.image_max_pixels (Qwen2VLImageProcessorPil: ~28x28 px per token); "
            "rows priced with one image of 256 tokens") in line
    tower = text.splitlines()[text.splitlines().index(line) + 1]
    assert "vision tower" in tower and "frozen" in tower and "MiB for a micro-batch's images" in tower and "s a step" in tower
    from homelab_ft.plan.planner import plan

    shape, request = _fixed(*_priced(vlm_folders["qwen2_vl"])[:2])
    fixed = format_plan(plan(shape, request=request, cluster=CPU))
    assert "~4 tokens per image at a 768x768 photo; data.image_max_pixels is unset (Qwen2VLImageProcessorPil: a fixed count" in fixed


def test_the_measured_rows_are_named(vlm_folders):
    recipe = _recipe(vlm_folders["qwen2_vl"], image_max_pixels=224 * 224)
    text = format_plan(plan_for_recipe(recipe, cluster=CPU, image_counts=((1, 64, 9), (3, 192, 1))))
    assert "rows as measured on 10: up to 3 image(s) and 192 image tokens, 1.20 and 77 on average" in text


def test_row_images_properties():
    counts = RowImages(tokens_per_image=64, size=(224, 224), bounded=True, counts=((1, 64, 2), (1, 80, 2)))
    assert counts.most_per_row == (1, 80) and counts.mean_per_row == (1, 72) and counts.num_rows == 4
