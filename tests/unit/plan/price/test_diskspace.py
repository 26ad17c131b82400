"""Checkpoint pricing (pure) and the start-of-run warning when the disk cannot hold keep_last + 1."""

from __future__ import annotations

import shutil
from collections import namedtuple

from homelab_ft.plan.inputs import Cluster
from homelab_ft.plan.planner import default_request
from homelab_ft.plan.price import diskspace
from homelab_ft.rung import Rung
from homelab_ft.store.layout import RunDir


def _option(method: str, trainable: int):
    Option = namedtuple("Option", "rung trainable_params")
    return Option(Rung(method, "no_shard", False), trainable)


def test_checkpoint_bytes_per_trainable_parameter():
    gpu = Cluster(nodes=1, gpus_per_node=2, device="cuda", device_bytes=24 << 30, host_ram_bytes=64 << 30)
    # LoRA: fp32 adapter + two fp32 AdamW moments + the safetensors copy of the adapter
    assert diskspace.checkpoint_bytes(_option("lora", 1000), request=default_request(), cluster=gpu) == 16_000
    # full fine-tune in bf16 on GPUs: 2 bytes of weight + AdamW's two moments in the param dtype
    assert diskspace.checkpoint_bytes(_option("full", 1000), request=default_request(), cluster=gpu) == 6_000
    eight_bit = default_request(train={"optimizer": "adamw_8bit"})
    assert diskspace.checkpoint_bytes(_option("full", 256_000), request=eight_bit, cluster=gpu) == 256_000 * (2 + 2 + 8 / 256)


def test_space_warning_counts_keep_last_plus_one(tmp_path, monkeypatch):
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda _: usage(10 << 30, 0, 3 << 30))
    run = RunDir(tmp_path / "not" / "made" / "yet").checkpoints
    assert diskspace.space_warning(run, checkpoint_bytes=1 << 30, keep_last=2) is None  # 3 GiB for 3
    note = diskspace.space_warning(run, checkpoint_bytes=1 << 30, keep_last=3)
    assert "3.0 GiB free" in note and "4 checkpoints" in note and "train.keep_last=3" in note
    # a resumed run's own checkpoints will be pruned, so their space counts as available
    (run / "step_000001").mkdir(parents=True)
    (run / "step_000001" / "x").write_bytes(b"\0" * (1 << 20))
    assert diskspace.space_warning(run, checkpoint_bytes=(3 << 30) // 4 + 1, keep_last=3) is None
