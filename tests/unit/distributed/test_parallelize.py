"""distributed/parallelize.py on a one-process gloo group: the FSDP2 units of an image-text model."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from homelab_ft.distributed.comm import DistEnv
from homelab_ft.distributed.parallelize import parallelize
from homelab_ft.rules import vision
from homelab_ft.rung import Rung


@pytest.fixture
def one_rank():
    dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())
    try:
        yield DistEnv(0, 0, 1, 1, torch.device("cpu"), "gloo", True)
    finally:
        dist.destroy_process_group()


def test_an_idefics3_full_shard_has_a_unit_per_vision_layer(one_rank):
    """Idefics3 (SmolVLM's architecture) names its vision attention in `_no_split_modules`: each
    vision encoder layer is an FSDP2 unit whole (rules/decoder_blocks.py), so its MLP is gathered
    with its attention, not held by the root unit for the whole step."""
    from tiny_vlm import tiny_vlm_config
    from torch.distributed.fsdp import FSDPModule
    from transformers import AutoModelForImageTextToText

    torch.manual_seed(0)
    model = AutoModelForImageTextToText.from_config(tiny_vlm_config("idefics3"))
    vision.freeze(model)
    layers = model.model.vision_model.encoder.layers
    parallelize(model, one_rank, rung=Rung("full", "full_shard", False, procs_per_node=2))  # the units a 2-rank run makes
    assert len(layers) == 3 and all(isinstance(layer, FSDPModule) for layer in layers)
    assert all(isinstance(layer, FSDPModule) for layer in model.model.text_model.layers)
    units = [m for m in model.modules() if isinstance(m, FSDPModule) and m is not model]
    in_units = {id(p) for unit in units for p in unit.parameters()}
    left = [n for n, p in model.named_parameters() if id(p) not in in_units]  # the root unit's own
    assert left and not [n for n in left if ".encoder.layers." in n]
