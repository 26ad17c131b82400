"""The pipeline dimension of the rung and its refusals, without a process group: the rung's own
rules (rung._validate_pipeline), the split of blocks into stages, and the refusals that need the
model's config (stages.check_recipe), which preflight runs before anything is created."""

from __future__ import annotations

import pytest

from homelab_ft.distributed.stages import check_recipe, stage_ranges
from homelab_ft.errors import UserError
from homelab_ft.recipe.config import recipe_from_dict
from homelab_ft.rung import Rung, RungError, rung_for


def _rung(**kwargs) -> Rung:
    return Rung(**{"method": "lora", "strategy": "no_shard", "cpu_offload": False, "procs_per_node": 2,
                   "pipeline_stages": 2, **kwargs})


@pytest.mark.parametrize("kwargs, message", [
    (dict(pipeline_stages=0), "at least 1 stage"),
    (dict(pipeline_stages=3), "does not divide the 2 processes"),
    (dict(pipeline_schedule="zb"), "pipeline_schedule='zb' does not exist; use one of 1f1b, gpipe"),
    (dict(stage_blocks=(4,)), "lists 1 stage"),
    (dict(stage_blocks=(4, 0)), "at least one decoder block"),
    (dict(strategy="full_shard"), "not supported yet: set sharding.strategy=no_shard"),
    (dict(method="full", optimizer_in_backward=True), "train.optimizer_in_backward=false"),
])
def test_refused_pipeline_rungs_name_the_fix(kwargs, message):
    with pytest.raises(RungError, match=message):
        _rung(**kwargs)


def test_pipeline_properties():
    two_by_two = _rung(procs_per_node=4, stage_blocks=[3, 1])
    assert two_by_two.pipeline_enabled and two_by_two.data_parallel_size == 2
    assert two_by_two.stage_blocks == (3, 1)  # a JSON list (run.json, the handoff) becomes the tuple
    assert Rung.from_dict(two_by_two.to_dict()) == two_by_two
    plain = Rung("lora", "no_shard", False, procs_per_node=2)
    assert not plain.pipeline_enabled and plain.data_parallel_size == 2


def test_rung_for_takes_the_recipes_pipeline():
    recipe = recipe_from_dict({"method": "full", "cluster": {"gpus_per_node": 2},
                               "sharding": {"pipeline_stages": 2, "stage_blocks": [3, 1], "pipeline_schedule": "gpipe"}})
    rung = rung_for(recipe)
    assert (rung.pipeline_stages, rung.stage_blocks, rung.pipeline_schedule) == (2, (3, 1), "gpipe")
    assert rung.strategy == "no_shard"  # `auto` of a full fine-tune on 2 ranks is full_shard, but not pipelined
    assert rung_for(recipe_from_dict({"cluster": {"gpus_per_node": 2}})).pipeline_stages == 1


def test_recipe_keys_are_validated():
    with pytest.raises(UserError, match="sharding.pipeline_stage; did you mean sharding.pipeline_stages"):
        recipe_from_dict({"sharding": {"pipeline_stage": 2}})
    with pytest.raises(UserError, match="pipeline_schedule"):
        recipe_from_dict({"sharding": {"pipeline_schedule": "zero_bubble"}})
    with pytest.raises(UserError, match="stage_blocks"):
        recipe_from_dict({"sharding": {"stage_blocks": [2, 0]}})
    assert recipe_from_dict({"sharding": {"pipeline_stages": "auto"}}).sharding.pipeline_stages == "auto"


def test_stage_ranges():
    assert stage_ranges(4, _rung(stage_blocks=(3, 1))) == [range(0, 3), range(3, 4)]
    assert stage_ranges(5, _rung()) == [range(0, 3), range(3, 5)]  # the remainder on the earlier stage
    assert stage_ranges(8, _rung(procs_per_node=4, pipeline_stages=4)) == [range(i, i + 2) for i in range(0, 8, 2)]


def _recipe(**train) -> object:
    return recipe_from_dict({"method": "lora", "cluster": {"gpus_per_node": 2}, "sharding": {"pipeline_stages": 2},
                             "train": {"grad_accum_steps": 4, **train}})


@pytest.mark.parametrize("train, rung, config, message", [
    ({"grad_accum_steps": 1}, {}, {"num_hidden_layers": 4}, "train.grad_accum_steps >= 2"),
    ({}, {}, {"num_hidden_layers": 1}, "has 1 decoder block"),
    ({}, {"stage_blocks": (2, 1)}, {"num_hidden_layers": 4}, "make them sum to 4"),
    ({}, {}, {"model_type": "x"}, "no num_hidden_layers"),
    ({"sample_every": 2, "sample_prompts": ["hi"]}, {}, {"num_hidden_layers": 4}, "train.sample_every=0"),
    ({}, {"method": "qlora", "quant_bits": 8}, {"num_hidden_layers": 4}, "set quant.bits=4"),
])
def test_refusals_that_need_the_model(train, rung, config, message):
    with pytest.raises(UserError, match=message):
        check_recipe(_recipe(**train), rung=_rung(**rung), config=config, moe_experts=False)


def test_a_schedule_this_torch_lacks_is_refused(monkeypatch):
    import torch.distributed.pipelining as pipelining

    monkeypatch.delattr(pipelining, "ScheduleGPipe")
    with pytest.raises(UserError, match="has no torch.distributed.pipelining.ScheduleGPipe"):
        check_recipe(_recipe(), rung=_rung(pipeline_schedule="gpipe"), config={"num_hidden_layers": 4}, moe_experts=False)
    check_recipe(_recipe(), rung=_rung(), config={"text_config": {"num_hidden_layers": 4}}, moe_experts=False)  # 1f1b is there


def test_preflight_refuses_before_the_run_directory_exists(tmp_path, tiny_model_dir):
    from homelab_ft.plan.planner import recipe_shape
    from homelab_ft.train import preflight

    recipe = recipe_from_dict({"method": "full", "model": {"path": str(tiny_model_dir)},
                               "output": {"dir": str(tmp_path / "run")}, "cluster": {"gpus_per_node": 2},
                               "sharding": {"pipeline_stages": 2}, "train": {"grad_accum_steps": 4}})
    preflight.check_inputs(recipe, rung=rung_for(recipe), facts=recipe_shape(recipe)[0].facts, device_type="cpu")  # 2 blocks, 2 stages: fine
    too_many = recipe_from_dict({**{"method": "full", "model": {"path": str(tiny_model_dir)}},
                                 "output": {"dir": str(tmp_path / "run")}, "cluster": {"gpus_per_node": 4},
                                 "sharding": {"pipeline_stages": 4}, "train": {"grad_accum_steps": 4}})
    with pytest.raises(UserError, match="the model has 2 decoder block"):
        preflight.check_inputs(too_many, rung=rung_for(too_many), facts=recipe_shape(too_many)[0].facts, device_type="cpu")
    assert not (tmp_path / "run").exists()
