"""train/preflight.check_image_rows: a sharded image run, or one whose DDP replicas train vision
layers, needs an image in every row; the other rungs take text rows beside image rows."""

from __future__ import annotations

from types import SimpleNamespace

import datasets
import pytest
from tiny_vlm import save_vlm

from homelab_ft.errors import UserError
from homelab_ft.recipe.config import recipe_from_dict
from homelab_ft.rung import Rung
from homelab_ft.train.preflight import check_image_rows


def _data(train_images, eval_images=None):
    def split(counts):
        return None if counts is None else datasets.Dataset.from_dict({"num_images": counts})

    return SimpleNamespace(train=split(train_images), eval=split(eval_images))


@pytest.fixture(scope="module")
def llava(tmp_path_factory):
    return save_vlm(tmp_path_factory.mktemp("llava"), "llava", weights=False)


def _recipe(llava, targets="all-linear"):
    return recipe_from_dict({"model": {"path": str(llava)}, "data": {"images": True},
                             "lora": {"target_modules": targets}})


def test_a_sharded_image_run_refuses_rows_without_an_image(llava):
    fsdp = Rung("full", "full_shard", False, procs_per_node=2, images=True)
    check_image_rows(_data([1, 2, 1], [1]), rung=fsdp, recipe=_recipe(llava), model_dir=llava)
    with pytest.raises(UserError, match=r"full_shard with data.images: 1 held-out row\(s\) hold no image.*FSDP2"):
        check_image_rows(_data([1, 2], [0, 1]), rung=fsdp, recipe=_recipe(llava), model_dir=llava)
    for rung in (Rung("lora", "no_shard", False, procs_per_node=2, images=True),  # DDP, the tower frozen
                 Rung("full", "full_shard", True, images=True),  # one process, offloaded
                 Rung("full", "full_shard", False, procs_per_node=2)):  # text rows
        check_image_rows(_data([0, 1], [0]), rung=rung, recipe=_recipe(llava), model_dir=llava)


def test_ddp_replicas_that_train_vision_layers_refuse_rows_without_an_image(llava):
    ddp = Rung("lora", "no_shard", False, procs_per_node=2, images=True)
    check_image_rows(_data([0, 1]), rung=ddp, recipe=_recipe(llava, ["gate_proj"]), model_dir=llava)  # CLIP has none
    for listed in (["multi_modal_projector.linear_1"], ["q_proj"]):  # CLIP's attention has a q_proj too
        with pytest.raises(UserError, match="1 training row.*trains vision layers"):
            check_image_rows(_data([0, 1]), rung=ddp, recipe=_recipe(llava, listed), model_dir=llava)
