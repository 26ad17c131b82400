"""Tokens/s of MoE QLoRA against MoE LoRA on the same scaled-down model, through the trainer's own step.

The model is bench/memory.py's scaled-down Qwen3-30B-A3B (MOE_CONFIG: 4 layers of 64 experts,
top-8, hidden 512, moe_intermediate 384, vocab 8192), saved once and built twice in one process
by the trainer's `build_model`, with adapters on every expert (`all-linear`, r=16):
- QLoRA: the experts packed in 4 bits (model/moe_experts.py), each routed expert's projections
  through `bnb.matmul_4bit`, which dequantizes that expert's weight in forward and again in
  backward; attention through bitsandbytes' Linear4bit;
- LoRA: the same experts as plain weights of the base (`model.dtype`, default `auto`).
Both compute in the dtype the trainer uses on this device: on the CPU `auto` is fp32 for LoRA's
base and for QLoRA's compute dtype (config.ModelConfig, QuantConfig), so here LoRA's "bf16 base" is
fp32 (`--lora-dtype bfloat16` runs a bf16 one; CPU bf16 matmuls are not what a GPU's are).

Each step is the trainer's `train_step` on one fixed 1 x SEQ row of random tokens (every step the
same token count), after one warm-up step each (optimizer state, kernel workspaces). The two
alternate, QLoRA, LoRA, QLoRA, LoRA, ... for `--rounds` rounds, so a slow moment of a shared
machine hits both; printed per method: the median tokens per wall second and per CPU-second
(resource.getrusage of this process, every thread), and the ratio QLoRA / LoRA of each round's
pair, median and range.

What a CPU says about a GPU: on the CPU, dequantizing one expert's [768, 512] gate_up matrix takes
~0.09 ms against ~2 ms for the fp32 matmul of its 128 routed rows (SEQ x top-k / experts; one core,
bitsandbytes 0.50 without its optional CPU kernels), and QLoRA dequantizes each projection twice
per step (forward, and backward for the input gradient) beside LoRA's same two matmuls, so the
dequantize alone is ~5% here and the rest of the gap is the 4-bit path's own overheads. On a GPU
the matmul of 128 rows is far cheaper while the dequantize stays a memory-bound kernel (read 0.5
B, write 2 B per weight) per visited expert, so the gap there is expected to be larger; not
measured on a GPU here.

    OMP_NUM_THREADS=1 .venv/bin/python bench/moe_step.py                # ~1.5 minutes on one core
    OMP_NUM_THREADS=1 .venv/bin/python bench/moe_step.py --family mixtral --rounds 4

Measured (2-core CPU shared with other jobs, load average 3.8-3.9; torch 2.13, bitsandbytes 0.50):
    qlora  tokens/s:    278.3 per wall second (191.2-294.3),    410.5 per CPU-second (380.8-421.9)
    lora   tokens/s:    265.4 per wall second (220.7-324.1),    446.4 per CPU-second (445.2-454.0)
    QLoRA / LoRA tokens/s per wall second: median 0.976 (range 0.787-1.110 over 6 rounds)
    QLoRA / LoRA tokens/s per CPU second: median 0.913 (range 0.855-0.944 over 6 rounds)
Per CPU-second is the figure to read on a loaded machine (the wall clock counts the waits for a
core): QLoRA's 4-bit experts cost ~9% of LoRA's throughput on the CPU.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import resource
import statistics
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).resolve().parent))
import memory  # noqa: E402 - bench/memory.py: MOE_CONFIG, the model and the recipe

os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

METHODS = ("qlora", "lora")


def _cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def build_session(method: str, model_dir: Path, args) -> SimpleNamespace:
    """The trainer's model and optimizer for `method`, as bench/memory.py builds them."""
    import torch

    from homelab_ft.distributed import comm
    from homelab_ft.rung import rung_for
    from homelab_ft.train import optim
    from homelab_ft.train.build import build_model

    recipe = memory._recipe(model_dir, method=method, train={}, args=args)
    if method == "lora" and args.lora_dtype != "auto":
        recipe = dataclasses.replace(recipe, model=dataclasses.replace(recipe.model, dtype=args.lora_dtype))
    env = comm.setup(device_pref="cpu")
    torch.manual_seed(0)
    model = build_model(recipe, model_dir=model_dir, rung=rung_for(recipe), env=env)
    optimizer = optim.build_optimizer(model, recipe.train)
    return SimpleNamespace(env=env, model=model, recipe=recipe, rung=rung_for(recipe), optimizer=optimizer,
                           scheduler=optim.build_scheduler(optimizer, recipe.train))


def timed_step(session, batch: dict) -> tuple[float, float]:
    """(wall seconds, CPU seconds) of one train_step."""
    from homelab_ft.train.trainer import train_step

    wall, cpu = time.perf_counter(), _cpu_seconds()
    train_step(session, [batch])
    return time.perf_counter() - wall, _cpu_seconds() - cpu


def run(args) -> dict[str, list[tuple[float, float]]]:
    """Each method's (wall, CPU) seconds per measured step, QLoRA and LoRA alternating."""
    import torch

    with tempfile.TemporaryDirectory() as tmp:
        model_dir = Path(tmp) / "model"
        print(memory._save_model(model_dir, args))
        sessions = {m: build_session(m, model_dir, args) for m in METHODS}
    ids = torch.randint(0, args.vocab, (args.batch, args.seq_len), generator=torch.Generator().manual_seed(0))
    batch = {"input_ids": ids, "labels": ids.clone()}
    for session in sessions.values():
        timed_step(session, batch)  # warm-up: optimizer state, workspaces
    times: dict[str, list[tuple[float, float]]] = {m: [] for m in METHODS}
    for _ in range(args.rounds):
        for method in METHODS:
            times[method].append(timed_step(sessions[method], batch))
    return times


def report(times: dict[str, list[tuple[float, float]]], *, tokens: int) -> None:
    for method in METHODS:
        wall = [tokens / w for w, _ in times[method]]
        cpu = [tokens / c for _, c in times[method]]
        print(f"{method:6s} tokens/s: {statistics.median(wall):8.1f} per wall second "
              f"({min(wall):.1f}-{max(wall):.1f}), {statistics.median(cpu):8.1f} per CPU-second "
              f"({min(cpu):.1f}-{max(cpu):.1f})")
    for i, name in ((0, "wall"), (1, "CPU")):
        ratios = [lo[i] / q[i] for q, lo in zip(times["qlora"], times["lora"], strict=True)]
        print(f"QLoRA / LoRA tokens/s per {name} second: median {statistics.median(ratios):.3f} "
              f"(range {min(ratios):.3f}-{max(ratios):.3f} over {len(ratios)} rounds)")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--family", default="qwen3_moe", help="qwen3_moe, mixtral or gpt_oss (MOE_CONFIG sizes)")
    parser.add_argument("--seq-len", type=int, default=1024)
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--lora-dtype", default="auto", choices=["auto", "bfloat16", "float32"],
                        help="LoRA's base dtype (auto: the trainer's, fp32 on the CPU)")
    args = parser.parse_args()
    args = SimpleNamespace(**vars(args), moe=True, device="cpu", batch=1, vocab=0, hidden=0)
    times = run(args)
    print(f"{args.rounds} rounds, 1 x {args.seq_len} tokens per step, OMP_NUM_THREADS="
          f"{os.environ.get('OMP_NUM_THREADS', 'unset')}, load average {Path('/proc/loadavg').read_text().split()[:3]}")
    report(times, tokens=args.batch * args.seq_len)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
