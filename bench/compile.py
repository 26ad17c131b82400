"""train.compile on and off: tokens/s of the trainer's own step, and the chunked loss's peak memory.

Throughput: the same random ~20M-parameter Llama (bench/lora_step.py's shape, 8 blocks), LoRA r=16
on every linear layer, micro-batches of 4 x 256 tokens, through `trainer.train_step`; one model
eager, one with `train.compile` (blocks compiled in place, the loss chunks' cross-entropy
compiled). Compiling is timed on its own (the first steps), then the two run in alternating
rounds (eager, compiled, compiled, eager, ...), and each reports the median over rounds of tokens
per wall-second and per CPU-second of this process (resource.getrusage: user + system), since wall
time on a shared machine swings with the neighbours.

Loss memory: the peak bytes of the chunked LM head + cross-entropy alone (forward and backward of
loss.chunked_loss_sum on given hidden states, Llama 3's 128,256-entry vocabulary, one chunk of
128 x 128,256 logits), eager and compiled, each in a fresh process, measured as bench/memory.py
does (VmHWM reset through /proc/self/clear_refs, glibc told to mmap large blocks).

    OMP_NUM_THREADS=1 .venv/bin/python bench/compile.py      # ~3 minutes on one core, compiling included
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "bench"))

os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

SEQ = 256
MICRO_BATCH = 4
WARMUP = 2
ROUNDS = 4
STEPS_PER_ROUND = 3
VOCAB = 128256
LOSS_TOKENS = 2048
LOSS_HIDDEN = 256


def _cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def _session(model_dir: Path, *, compile: bool):
    import torch

    from homelab_ft.distributed import comm
    from homelab_ft.model import compiling
    from homelab_ft.recipe.config import recipe_from_dict
    from homelab_ft.rung import rung_for
    from homelab_ft.train import optim
    from homelab_ft.train.build import build_model

    recipe = recipe_from_dict({
        "method": "lora", "model": {"path": str(model_dir), "dtype": "float32"},
        "lora": {"r": 16, "alpha": 32, "dropout": 0.0},
        "train": {"device": "cpu", "micro_batch_size": MICRO_BATCH, "lr": 1e-4, "warmup_steps": 0, "compile": compile,
                  "max_steps": 1000}})
    env = comm.DistEnv(0, 0, 1, 1, torch.device("cpu"), None, True)
    torch.manual_seed(0)
    model = build_model(recipe, model_dir=model_dir, rung=rung_for(recipe), env=env)
    if compile:
        compiling.compile_blocks(model)
    optimizer = optim.build_optimizer(model, recipe.train)
    return SimpleNamespace(env=env, model=model, recipe=recipe, rung=rung_for(recipe), optimizer=optimizer,
                           scheduler=optim.build_scheduler(optimizer, recipe.train))


def _run(session, batches) -> tuple[float, float, int]:
    from homelab_ft.train.trainer import train_step

    wall, cpu = time.perf_counter(), _cpu_s()
    tokens = 0
    for mb in batches:
        train_step(session, [mb])
        tokens += mb["input_ids"].numel()
    return time.perf_counter() - wall, _cpu_s() - cpu, tokens


def throughput() -> None:
    import torch
    from tiny import make_llama

    with tempfile.TemporaryDirectory() as tmp:
        model_dir = make_llama(Path(tmp) / "model", hidden_size=384, intermediate_size=1024, num_hidden_layers=8,
                               num_attention_heads=6, num_key_value_heads=2)
        vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
        g = torch.Generator().manual_seed(0)
        batches = [{"input_ids": (ids := torch.randint(0, vocab, (MICRO_BATCH, SEQ), generator=g)), "labels": ids.clone(),
                    "attention_mask": torch.ones_like(ids)} for _ in range(WARMUP + ROUNDS * STEPS_PER_ROUND)]
        sessions = {"eager": _session(model_dir, compile=False), "compiled": _session(model_dir, compile=True)}
        print(f"Llama: hidden 384, 8 blocks, LoRA r=16 all-linear, fp32, {MICRO_BATCH} x {SEQ} tokens per step, "
              f"torch threads {torch.get_num_threads()}")
        for name, session in sessions.items():
            wall, cpu, _ = _run(session, batches[:WARMUP])
            print(f"{name:9s} first {WARMUP} steps (compiling included): {wall:6.1f} s wall, {cpu:6.1f} s CPU")
        rates = {name: {"wall": [], "cpu": []} for name in sessions}
        for r in range(ROUNDS):
            order = list(sessions) if r % 2 == 0 else list(reversed(sessions))
            chunk = batches[WARMUP + r * STEPS_PER_ROUND: WARMUP + (r + 1) * STEPS_PER_ROUND]
            for name in order:
                wall, cpu, tokens = _run(sessions[name], chunk)
                rates[name]["wall"].append(tokens / wall)
                rates[name]["cpu"].append(tokens / cpu)
        med = {name: {k: statistics.median(v) for k, v in r.items()} for name, r in rates.items()}
        for name, m in med.items():
            print(f"{name:9s} {m['wall']:8.0f} tokens/wall-s {m['cpu']:8.0f} tokens/CPU-s  "
                  f"(median of {ROUNDS} interleaved rounds of {STEPS_PER_ROUND} steps)")
        print(f"compiled / eager: {med['compiled']['wall'] / med['eager']['wall']:.3f} per wall-second, "
              f"{med['compiled']['cpu'] / med['eager']['cpu']:.3f} per CPU-second")


def loss_peak(compiled: bool) -> int:
    """Runs in its own process: the peak bytes of one chunked loss forward + backward."""
    import torch
    from memory import PeakMeter

    from homelab_ft.train import loss

    torch.manual_seed(0)
    head = torch.nn.Linear(LOSS_HIDDEN, VOCAB, bias=False).requires_grad_(False)
    hidden = torch.randn(1, LOSS_TOKENS, LOSS_HIDDEN, requires_grad=True)
    labels = torch.randint(0, VOCAB, (1, LOSS_TOKENS))

    def step():
        loss.chunked_loss_sum(hidden, labels, head=head, chunk_tokens=128, compiled=compiled).backward()
        hidden.grad = None

    step()
    step()  # compiled: the first full chunk and then the shorter last one each compile once
    with PeakMeter(torch.device("cpu")) as meter:
        step()
    return meter.peak


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--loss-peak", choices=["eager", "compiled"], help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.loss_peak:
        print(json.dumps({"peak": loss_peak(args.loss_peak == "compiled")}))
        return 0
    throughput()
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="131072", OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
    peaks = {}
    for name in ("eager", "compiled"):
        proc = subprocess.run([sys.executable, __file__, "--loss-peak", name], env=env, capture_output=True, text=True,
                              check=False)
        if proc.returncode != 0:
            print(f"loss peak {name}: failed\n{proc.stderr[-3000:]}")
            return 1
        peaks[name] = json.loads(proc.stdout.strip().splitlines()[-1])["peak"]
    entry = 128 * VOCAB
    for name, peak in peaks.items():
        print(f"chunked loss peak, {name:8s}: {peak / 1e6:7.1f} MB = {peak / entry:5.1f} B per logit of one 128-token chunk")
    print(f"compiled / eager loss peak: {peaks['compiled'] / peaks['eager']:.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
