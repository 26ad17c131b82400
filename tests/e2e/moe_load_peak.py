"""Measure one-process MoE QLoRA loading (train/build.py) in a fresh process: `python moe_load_peak.py
RECIPE.json OUT.json`. The peak is the process's RSS high-water mark (VmHWM) above its RSS before
the build, the mark reset just before (`echo 5 > /proc/self/clear_refs`, Linux >= 4.0), so what the
imports held for a moment does not hide it. A first build, dropped, runs every lazy import
(transformers' modeling module, PEFT's tuners, FSDP) and warms the allocator, which otherwise
added ~40 MB of code and arenas to the measured build; the checkpoint was written by another process."""

from __future__ import annotations

import gc
import json
import sys
from pathlib import Path

import bitsandbytes  # noqa: F401  (imported before the baseline: not loading memory)
import peft  # noqa: F401
import torch
import transformers  # noqa: F401
from safetensors import safe_open

from homelab_ft.distributed.comm import DistEnv
from homelab_ft.model import moe_experts
from homelab_ft.plan.planner import recipe_shape
from homelab_ft.recipe.config import recipe_from_dict
from homelab_ft.rung import rung_for
from homelab_ft.train.build import build_model


def _rss_bytes() -> int:
    import os

    with open("/proc/self/statm") as fh:
        return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _peak_rss_bytes() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024  # kB
    raise AssertionError("no VmHWM in /proc/self/status")


def _reset_peak() -> None:
    Path("/proc/self/clear_refs").write_text("5")


def _release_freed_memory() -> None:
    import ctypes

    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def main(recipe_path: str, out_path: str) -> None:
    recipe = recipe_from_dict(json.loads(Path(recipe_path).read_text()), source="load-peak")
    env = DistEnv(rank=0, local_rank=0, world_size=1, num_nodes=1, device=torch.device("cpu"), backend=None,
                  is_main=True)
    facts = recipe_shape(recipe)[0].facts
    build_model(recipe, model_dir=Path(recipe.model.path), facts=facts, rung=rung_for(recipe), env=env)  # dropped at once
    _release_freed_memory()
    _reset_peak()
    rss_before, peak_before = _rss_bytes(), _peak_rss_bytes()
    model = build_model(recipe, model_dir=Path(recipe.model.path), facts=facts, rung=rung_for(recipe), env=env)
    gc.collect()
    peak = _peak_rss_bytes() - rss_before
    experts = moe_experts.fused_experts(model)
    held = sum(_nbytes(p) for p in model.parameters()) + sum(_nbytes(b) for b in model.buffers())
    held += sum(moe_experts.packed_bytes(m) - sum(_nbytes(p) for n, p in m.named_parameters(recurse=False)
                                                  if n.endswith("_4bit")) for m in experts.values())
    # one layer's experts in the compute dtype (fp32 on CPU), from the checkpoint's shapes
    layer = next(iter(experts)).removeprefix("base_model.model.")
    with safe_open(str(Path(recipe.model.path) / "model.safetensors"), framework="pt") as fh:
        layer_values = sum(fh.get_slice(k).get_shape()[0] * fh.get_slice(k).get_shape()[1]
                           for k in fh.keys() if k.startswith(f"{layer}."))
    Path(out_path).write_text(json.dumps({
        "load_peak_bytes": peak,
        "baseline_valid": peak_before - rss_before < 16 * 2**20,
        "model_bytes": held,
        "layer_experts_bytes": layer_values * 4,
        "experts_bytes_whole": layer_values * 4 * len(experts),
        "packed_dtypes": sorted({str(getattr(m, f"{p}_4bit").dtype) for m in experts.values()
                                 for p in moe_experts.projections(m)}),
    }))


if __name__ == "__main__":
    main(*sys.argv[1:])
