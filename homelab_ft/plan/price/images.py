"""What a micro-batch's images cost an image-text model beyond its language model: the vision tower's
bytes and seconds. Pure arithmetic over the shape's measured vision side (shape/types.VisionShape)
and the request's images (inputs.RowImages).

An image's tokens are tokens of the row: the language model's activations and seconds already count
them at data.max_length (memory) or at the rows' measured lengths (time), since the prepared rows
carry them. What the images add is the tower's own work, once per micro-batch on all its rows'
images in one call (get_image_features):
- memory: the frozen tower (the default: rules/vision.py) runs without grad and keeps nothing for
  backward, but its working set is held while it runs, before the language model's activations
  exist (Memory.vision_forward); a tower whose layers `lora.target_modules` names trains adapters and
  keeps what it saved for backward beside the language model's activations (priced as every vision
  parameter training: an upper bound for adapters on some of its layers);
- time: its forward FLOPs, three times that when it trains (forward, and backward's two), at the
  device's throughput; the reference forward of a DPO adapter step and KTO's KL forward run it too.
"""

from __future__ import annotations

from homelab_ft.plan.inputs import Cluster, PlanRequest
from homelab_ft.plan.price.params import vision_linears_for
from homelab_ft.plan.shape.types import ModelShape
from homelab_ft.rung import Rung

REFERENCE_SIDE = 768
"""The side of the square image the plan quotes tokens for when data.image_max_pixels is unset:
LLaMA-Factory's default image_max_pixels is 768 * 768, where a Qwen2-VL-style model spends ~752
tokens per image (issue 35)."""


def row_images(shape: ModelShape, request: PlanRequest, *, timed: bool) -> tuple[float, float]:
    """(images, image tokens) of one row: the measured rows' (for memory the row with the most image
    tokens, for time the average row); else one image per row, of the tokens an image at the recipe's
    bound becomes; without a bound a family whose tokens grow with the image may fill the row
    (data.max_length: the processor's own limit, 16,384 tokens for Qwen2-VL, is beyond any row),
    a fixed-count one spends its count. (0, 0) for a text model or an unmeasured vision side."""
    images = request.images
    if images is None or shape.vision is None or shape.vision.unmeasured:
        return 0.0, 0.0
    if images.counts:
        return images.mean_per_row if timed else images.most_per_row
    tokens = images.tokens_per_image if images.bounded or not shape.vision.dynamic else request.data.max_length
    return 1.0, float(min(tokens, request.data.max_length))


def tower_trained(shape: ModelShape, *, rung: Rung, request: PlanRequest) -> bool:
    """Adapters in the vision tower: a `lora.target_modules` entry (never `all-linear`, which leaves the
    tower out) names one of its linear layers (params.vision_linears_for). A full fine-tune freezes
    the tower (rules/vision.freeze)."""
    return rung.adapters_enabled and bool(vision_linears_for(shape, request.lora.targets))


def _micro_batch(shape: ModelShape, request: PlanRequest, *, timed: bool) -> tuple[int, float]:
    """(images in one micro-batch's call, image tokens per image)."""
    images, tokens = row_images(shape, request, timed=timed)
    if not images:
        return 0, 0.0
    count = max(1, round(images * request.rows_per_micro_batch))
    return count, tokens * request.rows_per_micro_batch / count


def vision_bytes(shape: ModelShape, *, rung: Rung, request: PlanRequest, act_bytes: int) -> tuple[int, int]:
    """(bytes the tower keeps for backward, bytes held while it runs) for one micro-batch's images."""
    count, tokens = _micro_batch(shape, request, timed=False)
    if not count:
        return 0, 0
    saved = shape.vision.saved_bytes(act_bytes, tokens, count) if tower_trained(shape, rung=rung, request=request) else 0.0
    return round(saved), round(saved + shape.vision.transient_bytes(act_bytes, tokens, count))


def vision_s(shape: ModelShape, *, rung: Rung, request: PlanRequest, cluster: Cluster) -> float:
    """Seconds per optimizer step the tower computes: its forward on every micro-batch's images (x3
    trained), plus the no-grad forwards of DPO's reference and KTO's KL pass (network.compute_s)."""
    count, tokens = _micro_batch(shape, request, timed=True)
    if not count:
        return 0.0
    passes = (3 if tower_trained(shape, rung=rung, request=request) else 1) + request.kl_forwards
    passes += request.reference_forwards if rung.adapters_enabled else 0
    flops = passes * shape.vision.forward_flops(tokens, count) * request.train.grad_accum_steps
    return flops / (cluster.tflops * 1e12)


def images_per_step(shape: ModelShape, request: PlanRequest) -> float:
    """Images one optimizer step reads per rank, at the timed (average) row."""
    images, _ = row_images(shape, request, timed=True)
    return images * request.rows_per_micro_batch * request.train.grad_accum_steps
