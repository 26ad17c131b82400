"""train/preflight.check_image_rows: a sharded image run needs an image in every row, the other
rungs take text rows beside image rows."""

from __future__ import annotations

from types import SimpleNamespace

import datasets
import pytest

from homelab_ft.errors import UserError
from homelab_ft.rung import Rung
from homelab_ft.train.preflight import check_image_rows


def _data(train_images, eval_images=None):
    def split(counts):
        return None if counts is None else datasets.Dataset.from_dict({"num_images": counts})

    return SimpleNamespace(train=split(train_images), eval=split(eval_images))


def test_a_sharded_image_run_refuses_rows_without_an_image():
    fsdp = Rung("full", "full_shard", False, procs_per_node=2, images=True)
    check_image_rows(_data([1, 2, 1], [1]), rung=fsdp)
    with pytest.raises(UserError, match=r"full_shard with data.images: 1 held-out row\(s\) hold no image.*no_shard"):
        check_image_rows(_data([1, 2], [0, 1]), rung=fsdp)
    for rung in (Rung("lora", "no_shard", False, procs_per_node=2, images=True),  # DDP
                 Rung("full", "full_shard", True, images=True),  # one process, offloaded
                 Rung("full", "full_shard", False, procs_per_node=2)):  # text rows
        check_image_rows(_data([0, 1], [0]), rung=rung)
