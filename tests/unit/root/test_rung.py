"""The rung as one validated value: rules without a process group, and the grid check that every
option the planner prints is one the trainer accepts (plan and train cannot disagree)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from homelab_ft.plan.inputs import Cluster, PlanRequest
from homelab_ft.plan.ladder import evaluate, saver_levels
from homelab_ft.plan.planner import default_request, named_rung, plan, validate
from homelab_ft.plan.price.memory import GiB
from homelab_ft.plan.shape.shapes import model_shape
from homelab_ft.recipe.config import recipe_from_dict
from homelab_ft.rung import Rung, RungError, implied_checkpointing, rung_for

CONFIGS = Path(__file__).resolve().parents[2] / "configs"


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(method="qlora", strategy="full_shard", cpu_offload=False, procs_per_node=2, quant_bits=8),
         "8-bit base cannot be sharded"),
        (dict(method="qlora", strategy="full_shard", cpu_offload=True, quant_bits=8), "quant.bits=4"),
        (dict(method="qlora", strategy="full_shard", cpu_offload=False, procs_per_node=2, optimizer="paged_adamw_8bit"),
         "cannot update FSDP2-sharded"),
        (dict(method="qlora", strategy="no_shard", cpu_offload=False, quant_bits=3), "4 or 8 bits"),
        (dict(method="full", strategy="full_shard", cpu_offload=False, procs_per_node=2, optimizer="adamw_8bit"),
         "cannot update FSDP2-sharded"),
        (dict(method="lora", strategy="no_shard", cpu_offload=True, procs_per_node=2), "needs a sharded strategy"),
        (dict(method="full", strategy="hybrid_shard", cpu_offload=False, procs_per_node=4), "cluster.nodes >= 2"),
        (dict(method="full", strategy="full_shard", cpu_offload=False), "shards nothing"),
        (dict(method="full", strategy="zero3", cpu_offload=False), "does not exist"),
        (dict(method="adapters", strategy="no_shard", cpu_offload=False), "not a rung"),
        (dict(method="full", strategy="no_shard", cpu_offload=False, optimizer="sgd"), "train.optimizer"),
        (dict(method="full", strategy="no_shard", cpu_offload=False, nodes=0), ">= 1"),
        (dict(method="qlora", strategy="no_shard", cpu_offload=False, optimizer_in_backward=True), "full fine-tunes"),
        (dict(method="lora", strategy="no_shard", cpu_offload=False, procs_per_node=2, pipeline_stages=2, images=True),
         "with data.images: the vision tower .* set sharding.pipeline_stages=1"),
    ],
)
def test_refused_rungs_name_the_fix(kwargs, message):
    with pytest.raises(RungError, match=message):
        Rung(**kwargs)


def test_properties():
    hybrid = Rung("full", "hybrid_shard", False, nodes=2, procs_per_node=4)
    assert hybrid.world_size == 8 and hybrid.shard_size == 4 and hybrid.fsdp_enabled and hybrid.hybrid_enabled
    assert hybrid.reshard_after_forward and not hybrid.adapters_enabled and hybrid.process_group_enabled
    ddp = Rung("qlora", "no_shard", False, procs_per_node=2, optimizer="paged_adamw_8bit")
    assert ddp.ddp_enabled and ddp.quantized_enabled and ddp.adapters_enabled and ddp.shard_size == 1
    assert ddp.bnb_optimizer_enabled and not ddp.fsdp_enabled
    single = Rung("lora", "no_shard", False)
    assert not single.process_group_enabled and not single.ddp_enabled
    offload = Rung("full", "full_shard", True)  # FSDP on one GPU, to offload to the CPU
    assert offload.process_group_enabled and offload.shard_size == 1
    assert not Rung("full", "shard_grad_op", False, procs_per_node=2).reshard_after_forward
    assert Rung.from_dict(hybrid.to_dict()) == hybrid
    fsdp_qlora = Rung("qlora", "full_shard", True, procs_per_node=2)  # the 4-bit base sharded and offloaded
    assert fsdp_qlora.quantized_enabled and fsdp_qlora.fsdp_enabled and fsdp_qlora.shard_size == 2
    assert Rung.from_dict(fsdp_qlora.to_dict()) == fsdp_qlora


def _recipe(**sections):
    return recipe_from_dict(sections)


def test_rung_for_validates_the_recipes_own_rung_when_there_is_no_plan():
    """Without a plan, `auto` takes the defaults: LoRA (full with the optimizer in backward), the
    default strategy, savers off unless explicit offload brings checkpointing."""
    two = {"gpus_per_node": 2}
    assert rung_for(_recipe(cluster=two)) == Rung("lora", "no_shard", False, procs_per_node=2)
    in_backward = _recipe(cluster=two, train={"optimizer_in_backward": True, "max_grad_norm": 0})
    assert rung_for(in_backward) == Rung("full", "full_shard", False, procs_per_node=2, optimizer_in_backward=True)
    assert rung_for(_recipe(method="full", cluster=two)).strategy == "full_shard"
    assert rung_for(_recipe(method="full", sharding={"strategy": "full_shard"})).strategy == "no_shard"  # 1 process
    sharded_4bit = rung_for(_recipe(method="qlora", sharding={"strategy": "full_shard"}, cluster=two))
    assert sharded_4bit == Rung("qlora", "full_shard", False, procs_per_node=2) and sharded_4bit.quantized_enabled
    assert rung_for(_recipe(method="qlora", sharding={"strategy": "full_shard", "cpu_offload": True})).fsdp_enabled
    offloaded = rung_for(_recipe(method="lora", train={"activation_offload": True}))
    assert offloaded.activation_checkpointing and offloaded.activation_offload
    assert not rung_for(_recipe(method="lora")).activation_checkpointing  # `auto` with nothing planned: off
    with pytest.raises(RungError, match="8-bit base"):
        rung_for(_recipe(method="qlora", quant={"bits": 8}, sharding={"strategy": "full_shard"}, cluster=two))


def test_data_images_is_read_once_into_the_rung():
    """The one decision "does this run train on images" is data.images, carried by the rung (rung.build)."""
    images = rung_for(_recipe(method="lora", data={"images": True}))
    assert images.images and "+images" in images.label and not rung_for(_recipe(method="lora")).images
    assert Rung.from_dict(images.to_dict()) == images
    assert Rung.from_dict({k: v for k, v in images.to_dict().items() if k != "images"}) == rung_for(_recipe(method="lora"))


def test_the_planner_and_rung_for_share_the_savers_rule():
    """Explicit activation offload brings checkpointing in both: one rule (rung.implied_checkpointing)."""
    assert implied_checkpointing("auto", activation_offload=True) is True
    assert implied_checkpointing("auto", activation_offload="auto") == "auto"
    assert implied_checkpointing(False, activation_offload=True) is False  # refused by the rung, not overridden
    request = default_request(train={"activation_offload": True})
    assert {c for c, _ in saver_levels(request, CLUSTERS[0])} == {True}


# --------------------------------------------------------------------------------------------
# the grid: every printed option is one the trainer accepts, and the choice is what train runs


def _cluster(device: str, nodes: int, per_node: int, vram_gib: float, host_gib: float = 64) -> Cluster:
    return Cluster(device=device, nodes=nodes, gpus_per_node=per_node, device_bytes=int(vram_gib * GiB),
                   host_ram_bytes=int(host_gib * GiB), inter_link_gbit=1.0, tflops=40.0)


CLUSTERS = [
    _cluster("cuda", 1, 1, 24), _cluster("cuda", 1, 1, 8, 32), _cluster("cuda", 1, 2, 24, 128),
    _cluster("cuda", 2, 2, 24, 128), _cluster("cuda", 2, 1, 12), _cluster("cpu", 1, 1, 16), _cluster("cpu", 1, 2, 8),
]
MODELS = sorted(p.stem for p in CONFIGS.glob("*.json"))
REQUESTS = [
    default_request(data={"max_length": 1024}, train={"micro_batch_size": 1, "activation_checkpointing": True}),
    default_request(data={"max_length": 512}, train={"optimizer": "adamw_8bit"}),
    default_request(method="lora", data={"max_length": 512}, train={"optimizer": "paged_adamw_8bit"}),
    default_request(method="full", data={"max_length": 256}, sharding={"strategy": "auto", "cpu_offload": True}),
    default_request(data={"max_length": 256}, train={"optimizer_in_backward": True, "max_grad_norm": 0}),
    default_request(data={"max_length": 512}, quant={"bits": 8}),  # an 8-bit base is never offered sharded
]


def _recipe_for(option, cluster: Cluster, request: PlanRequest):
    """A recipe that names `option` explicitly."""
    sections = {
        "method": option.method,
        "sharding": {"strategy": option.strategy, "cpu_offload": option.cpu_offload},
        "cluster": {"nodes": cluster.nodes, "gpus_per_node": cluster.gpus_per_node},
        "train": {"optimizer": request.train.optimizer,
                  "activation_checkpointing": option.rung.activation_checkpointing,
                  "activation_offload": option.rung.activation_offload,
                  **({"optimizer_in_backward": True, "max_grad_norm": 0} if request.train.optimizer_in_backward else {})},
        "quant": {"bits": request.quant.bits},
    }
    return _recipe(**sections)


@pytest.mark.parametrize("name", MODELS)
def test_every_planned_option_is_accepted_by_the_trainer(name):
    shape = model_shape(json.loads((CONFIGS / f"{name}.json").read_text()))
    checked = 0
    for cluster in CLUSTERS:
        for request in REQUESTS:
            if request.sharding.cpu_offload and cluster.device == "cpu":
                continue
            p = plan(shape, request=request, cluster=cluster)
            for option in p.options:
                # Naming the printed option in the recipe gives exactly that rung, validated.
                explicit = request.changed(method=option.method, sharding={"strategy": option.strategy, "cpu_offload": option.cpu_offload})
                # The planner's own up-front checks pass, and its ladder offers the same rung again
                # (plan() on it would add only the advice and warnings, priced above for `request`).
                validate(shape, request=explicit, cluster=cluster)
                assert option.rung in {o.rung for o in evaluate(shape, request=explicit, cluster=cluster)}
                assert named_rung(_recipe_for(option, cluster, request), p) == option.rung
                checked += 1
    assert checked > 50
