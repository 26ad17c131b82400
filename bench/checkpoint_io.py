"""Checkpoint write and verify time, and their share of a training step, before and after the manifest.

Trains a recipe for a few steps with a checkpoint after every step, timing inside the same run:
each optimizer step, each whole `checkpoint.save`, and the part of it the manifest added (SHA-256
of every file with its fsync, the directory fsyncs and manifest.json: `manifest.hash_file`,
`fsync_dirs`, `write`). "Before" is the save without that part, which is the save as it was before
manifests (DCP, RNG, adapter, trainer_state.json, rename). The contenders are thus measured on the
same saves of the same run, interleaved by construction. Verify (what a resume does before
loading) is timed on the last checkpoint in one process; a resume on N ranks splits the hashing N
ways. Wall seconds with CPU seconds (resource.getrusage, this process) beside them; medians.

    python bench/checkpoint_io.py                       # the demo recipe (LoRA, 1 process) and
                                                        # the 2-process full fine-tune recipe
    python bench/checkpoint_io.py recipes/X.yaml [key=value ...]
"""

from __future__ import annotations

import functools
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
STEPS = 3
DEFAULT = [
    ("recipes/smollm2-lora-cpu.yaml", ["data.eval_sources=[]"]),
    ("recipes/tiny-full-2proc-cpu.yaml", []),
]


def _cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def _timed(store: dict, name: str, fn):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        wall, cpu = time.perf_counter(), _cpu_s()
        try:
            return fn(*args, **kwargs)
        finally:
            store[name].append((time.perf_counter() - wall, _cpu_s() - cpu))
    return wrapper


def worker(recipe_path: str, overrides: list[str], out: str) -> None:
    """Runs inside the training process (every rank under torchrun); rank 0 writes the numbers."""
    from homelab_ft.plan.planner import plan_for_recipe
    from homelab_ft.recipe.config import load_recipe
    from homelab_ft.rung import rung_for
    from homelab_ft.store import checkpoint, manifest
    from homelab_ft.train import trainer

    times: dict[str, list] = defaultdict(list)
    trainer.train_step = _timed(times, "step", trainer.train_step)
    checkpoint.save = _timed(times, "save", checkpoint.save)
    for name in ("hash_file", "fsync_dirs", "write"):
        setattr(manifest, name, _timed(times, "manifest", getattr(manifest, name)))
    recipe = load_recipe(recipe_path, overrides)
    trainer.train(recipe, plan=plan_for_recipe(recipe).to_dict(), rung=rung_for(recipe), base_dir=Path(recipe_path).resolve().parent)
    if os.environ.get("RANK", "0") != "0":
        return
    ckpt = checkpoint.latest(recipe.run_dir)
    wall, cpu = time.perf_counter(), _cpu_s()
    checkpoint.verify(ckpt)
    times["verify"].append((time.perf_counter() - wall, _cpu_s() - cpu))
    size = sum(p.stat().st_size for p in ckpt.rglob("*") if p.is_file())
    Path(out).write_text(json.dumps({"times": times, "bytes": size, "world_size": recipe.world_size}))


def _worker_main(argv: list[str]) -> None:
    from homelab_ft.distributed.comm import exit_now

    worker(argv[0], argv[2:], argv[1])
    exit_now(0)  # see distributed.teardown: FSDP2 on CPU may abort in interpreter finalizers


def _median(pairs, index: int) -> float:
    return statistics.median(p[index] for p in pairs) if pairs else 0.0


def run(recipe: str, extra: list[str]) -> str:
    from homelab_ft.model.loading import resolve_model_dir
    from homelab_ft.recipe.config import load_recipe

    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "times.json"
        overrides = [f"train.max_steps={STEPS}", "train.save_every=1", "train.keep_last=1",
                     f"output.dir={tmp}/run", "output.tensorboard=false", *extra]
        loaded = load_recipe(ROOT / recipe, overrides)
        resolve_model_dir(loaded.model.path)  # convert an embedded GGUF once, before any rank starts
        procs = loaded.world_size
        python = [sys.executable] if procs == 1 else [
            sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={procs}"]
        env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
        subprocess.run([*python, __file__, "--worker", str(ROOT / recipe), str(out), *overrides],
                       check=True, env=env, cwd=ROOT, stdout=subprocess.DEVNULL)
        data = json.loads(out.read_text())
    t = data["times"]
    step, save, mani, verify = (_median(t.get(k, []), 0) for k in ("step", "save", "manifest", "verify"))
    # several manifest calls per save: the manifest's share of one save is their sum over the run / saves
    mani_total = sum(w for w, _ in t.get("manifest", []))
    mani_cpu = sum(c for _, c in t.get("manifest", []))
    mani = mani_total / max(len(t.get("save", [])), 1)
    before = save - mani
    return (
        f"{Path(recipe).stem} ({data['world_size']} proc, checkpoint {data['bytes'] / 2**20:.1f} MiB): "
        f"step {step:.2f} s | save before manifest {before:.3f} s ({before / step:.1%} of a step), "
        f"after {save:.3f} s ({save / step:.1%}); manifest +{mani:.3f} s wall, "
        f"{mani_cpu / max(len(t.get('save', [])), 1):.3f} s CPU (rank 0) | verify {verify:.3f} s "
        f"({_median(t.get('verify', []), 1):.3f} s CPU, {verify / step:.1%} of a step)"
    )


def main(argv: list[str]) -> None:
    if argv and argv[0] == "--worker":
        _worker_main(argv[1:])
    jobs = [(argv[0], argv[1:])] if argv else DEFAULT
    for recipe, extra in jobs:
        print(run(recipe, extra), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
