"""DPO step vs SFT step on the same pairs' chosen answers (not a test): seconds, CPU seconds and peak memory.

    OMP_NUM_THREADS=2 .venv/bin/python bench/dpo_step.py

The same random ~20M-parameter Llama (saved, reloaded with from_pretrained), LoRA, micro-batch of
MICRO_BATCH pairs. The SFT contender trains on prompt + chosen answer only (the rows DPO's chosen
half holds); the DPO contender runs the trainer's `dpo_step`: the reference forward with adapters
disabled (no grad) and one forward + backward of chosen + rejected. Expected from FLOPs: the policy
pass carries 2x the rows of SFT (3 units each) plus a no-grad reference pass over them (1 unit
each): (2*3 + 2) / 3 = 2.7x SFT's time; activations and logits 2x.

Each contender runs on the CPU in its own process (peak memory is the process's own: ru_maxrss
after the steps minus ru_maxrss after setup, i.e. what the steps added on top), ROUNDS times,
interleaved (sft, dpo, sft, dpo ...), keeping each one's best round; the figures are medians over
the measured steps, wall time and the process's CPU time (time.process_time: getrusage's user +
system time) side by side.
"""

from __future__ import annotations

import json
import os
import random
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT))

MICRO_BATCH = 4
WARMUP = 2
STEPS = 6
ROUNDS = 2
WORDS = "the quick brown fox jumps over lazy dog answer yes no paris capital".split()


def setup(tmp: Path) -> None:
    from tiny import make_llama

    make_llama(tmp / "model", hidden_size=384, intermediate_size=1024, num_hidden_layers=8,
               num_attention_heads=6, num_key_value_heads=2)
    rng = random.Random(0)

    def text(n: int) -> str:
        return " ".join(rng.choice(WORDS) for _ in range(n))

    with (tmp / "pairs.jsonl").open("w") as pairs, (tmp / "chosen.jsonl").open("w") as chosen:
        for _ in range(MICRO_BATCH * (WARMUP + STEPS)):
            prompt, good, bad = text(40), text(rng.randint(30, 50)), text(rng.randint(30, 50))
            pairs.write(json.dumps({"prompt": prompt, "chosen": good, "rejected": bad}) + "\n")
            chosen.write(json.dumps({"messages": [{"role": "user", "content": prompt},
                                                  {"role": "assistant", "content": good}]}) + "\n")


def one(tmp: Path, objective: str) -> dict:
    """Run WARMUP + STEPS steps of `objective` through the trainer's own step function."""
    import torch

    from homelab_ft.data import collate, collate_pairs
    from homelab_ft.distributed import comm
    from homelab_ft.plan.planner import recipe_shape
    from homelab_ft.recipe.config import recipe_from_dict
    from homelab_ft.rung import rung_for
    from homelab_ft.train import preflight, session, trainer

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "2")))
    recipe = recipe_from_dict({
        "method": "lora", "objective": objective,
        "model": {"path": str(tmp / "model"), "dtype": "float32"},
        "lora": {"r": 16, "alpha": 32, "dropout": 0.0},
        "data": {"sources": [{"path": str(tmp / ("pairs.jsonl" if objective == "dpo" else "chosen.jsonl"))}],
                 "max_length": 512, "shuffle": False, "cache_dir": str(tmp / "cache")},
        "train": {"max_steps": WARMUP + STEPS, "micro_batch_size": MICRO_BATCH, "device": "cpu", "lr": 1e-4},
        "output": {"dir": str(tmp / f"run-{objective}"), "overwrite": True, "tensorboard": False},
    })
    env = comm.setup(device_pref="cpu")
    rung = rung_for(recipe)
    inputs = preflight.check_inputs(recipe, rung=rung, facts=recipe_shape(recipe)[0].facts, device_type="cpu")
    s = session.setup(recipe, env=env, rung=rung, plan=None, inputs=inputs, base_dir=tmp)
    collate_fn, step_fn = (collate_pairs, trainer.dpo_step) if objective == "dpo" else (collate, trainer.train_step)
    batches = [collate_fn([s.data.train[i] for i in s.sampler.next_indices()], pad_token_id=s.pad_token_id)
               for _ in range(WARMUP + STEPS)]
    base_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    walls, cpus = [], []
    for batch in batches:
        t0, c0 = time.perf_counter(), time.process_time()
        step_fn(s, [batch])
        walls.append(time.perf_counter() - t0)
        cpus.append(time.process_time() - c0)
    peak_mib = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - base_rss) / 1024
    return {"wall_s": statistics.median(walls[WARMUP:]), "cpu_s": statistics.median(cpus[WARMUP:]),
            "peak_mib": peak_mib, "tokens": int(sum(int(b["attention_mask"].sum()) for b in batches[WARMUP:]) / STEPS)}


def main() -> None:
    if len(sys.argv) == 3:
        print(json.dumps(one(Path(sys.argv[1]), sys.argv[2])))
        return
    with tempfile.TemporaryDirectory() as tmp_str:
        tmp = Path(tmp_str)
        setup(tmp)
        best: dict[str, dict] = {}
        for _ in range(ROUNDS):
            for objective in ("sft", "dpo"):
                out = subprocess.run([sys.executable, __file__, str(tmp), objective], capture_output=True, text=True,
                                     check=True, env={**os.environ, "HF_DATASETS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"})
                got = json.loads(out.stdout.strip().splitlines()[-1])
                if objective not in best or got["wall_s"] < best[objective]["wall_s"]:
                    best[objective] = got
    sft, dpo = best["sft"], best["dpo"]
    print(f"dpo_step: LoRA r16 on a 20M Llama, {MICRO_BATCH} pairs per step, {STEPS} measured steps, "
          f"threads {os.environ.get('OMP_NUM_THREADS', '2')}")
    for name, r in best.items():
        print(f"  {name}  {r['wall_s']:.3f} s/step  {r['cpu_s']:.3f} CPU s/step  peak +{r['peak_mib']:.0f} MiB  "
              f"{r['tokens']} tokens read/step")
    print(f"  dpo/sft: wall {dpo['wall_s'] / sft['wall_s']:.2f}x, CPU {dpo['cpu_s'] / sft['cpu_s']:.2f}x, "
          f"peak memory {dpo['peak_mib'] / max(sft['peak_mib'], 1):.2f}x (FLOP model: 2.7x time, 2x activations)")


if __name__ == "__main__":
    main()
