"""The three rungs side by side on one model: QLoRA, LoRA and full fine-tuning.

Each rung runs in its own subprocess so its peak resident memory is its own. A rung builds the
model through the project's own `build_model` (train/build.py) (the project's loading, quantization, CPU guard and
LoRA) and its optimizer through `optim.build_optimizer`, then times optimizer steps on fixed
random batches. Printed: seconds per step, the peak RSS while loading and while training (the
peak is reset in between through /proc/self/clear_refs), each beside its ratio to LoRA.

    OMP_NUM_THREADS=1 .venv/bin/python bench/rungs.py            # ~2 minutes on one core
    .venv/bin/python bench/rungs.py --hidden 1024 --layers 12     # a bigger model

What to expect on CPU: QLoRA saves the base's memory (4.1 bits instead of 32 per weight) but
costs time, since every 4-bit weight is dequantized to fp32 in each forward and again in
backward; a GPU hides most of that behind its matmuls, a CPU does not.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

RUNGS = ("qlora", "lora", "full", "qlora_fsdp")
"""qlora_fsdp: the 4-bit base sharded over 2 gloo ranks (sharded_qlora.py), each rank half the batch."""


def rss_mib(field: str) -> float:
    """VmHWM (peak) or VmRSS (now) of this process, in MiB."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"{field} not in /proc/self/status")


def reset_peak_rss() -> None:
    # Writing 5 resets VmHWM to the current RSS (Linux >= 4.0, proc(5)).
    Path("/proc/self/clear_refs").write_text("5")


def tensor_mib(tensors) -> float:
    return sum(t.untyped_storage().nbytes() for t in tensors) / 2**20


def weights_mib(model) -> float:
    """Parameters and buffers as stored, plus bitsandbytes' 4-bit quant state (absmax, codebook),
    which lives outside both."""
    tensors = [*model.parameters(), *model.buffers()]
    for module in model.modules():
        state = getattr(getattr(module, "weight", None), "quant_state", None)
        if state is not None:
            tensors += [t for t in state.as_dict(packed=True).values() if hasattr(t, "untyped_storage")]
    return tensor_mib(tensors)


def run_rung(method: str, model_dir: Path, *, num_steps: int, batch: int, seq_len: int) -> dict:
    """In the child process: build, warm up, time `num_steps` optimizer steps, report JSON."""
    import torch

    from homelab_ft.distributed import comm
    from homelab_ft.recipe.config import recipe_from_dict
    from homelab_ft.rung import rung_for
    from homelab_ft.train import optim
    from homelab_ft.train.build import build_model

    torch.manual_seed(0)
    sharded = method == "qlora_fsdp"
    recipe = recipe_from_dict({
        "method": "qlora" if sharded else method,
        "model": {"path": str(model_dir)},
        "lora": {"r": 16, "alpha": 32, "dropout": 0.0},
        "train": {"device": "cpu", "lr": 1e-4},
        **({"cluster": {"gpus_per_node": 2}, "sharding": {"strategy": "full_shard"}} if sharded else {}),
    })
    env = comm.setup(device_pref="cpu")
    import bitsandbytes  # noqa: F401  (imports are not loading memory)
    import peft  # noqa: F401

    before_load = rss_mib("VmRSS")
    model = build_model(recipe, model_dir=model_dir, rung=rung_for(recipe), env=env)
    load_peak = rss_mib("VmHWM")
    shard_mib = sharded_state_mib(model) if sharded else None
    optimizer = optim.build_optimizer(model, recipe.train)
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    vocab = model.config.vocab_size if hasattr(model, "config") else model.module.config.vocab_size
    ids = torch.randint(0, vocab, (batch, seq_len), generator=torch.Generator().manual_seed(0))
    if sharded:  # the same global batch, half per rank
        ids = ids.chunk(env.world_size)[env.rank]

    def step() -> float:
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss.item()

    model.train()
    reset_peak_rss()
    step()  # first step allocates optimizer state and grads: part of the peak, not of the time
    start, start_cpu = time.perf_counter(), time.process_time()
    losses = [step() for _ in range(num_steps)]
    step_s = (time.perf_counter() - start) / num_steps
    # CPU seconds of this process: with one thread, what the step costs even when other jobs
    # share the cores (wall time then also counts the waits for a core).
    cpu_s = (time.process_time() - start_cpu) / num_steps
    if sharded:
        cpu_s = comm.all_reduce_sum(cpu_s, env)  # CPU seconds of both ranks per step
        return {"method": method, "step_s": step_s, "cpu_s": cpu_s, "tokens_per_s": batch * seq_len / step_s,
                "before_load_mib": before_load, "load_peak_mib": load_peak, "train_peak_mib": rss_mib("VmHWM"),
                "trainable": trainable, "loss_first": losses[0], "loss_last": losses[-1], **shard_mib,
                "block_mib": block_mib(model_dir), "world_size": env.world_size}
    for p in model.parameters():  # grads as they are between backward and step
        if p.requires_grad:
            p.grad = torch.zeros_like(p)
    return {
        "weights_mib": weights_mib(model),
        "grads_optim_mib": tensor_mib([p.grad for p in model.parameters() if p.grad is not None])
        + tensor_mib([t for state in optimizer.state.values() for t in state.values() if torch.is_tensor(t)]),
        "method": method,
        "step_s": step_s,
        "cpu_s": cpu_s,
        "tokens_per_s": batch * seq_len / step_s,
        "before_load_mib": before_load,
        "load_peak_mib": load_peak,
        "train_peak_mib": rss_mib("VmHWM"),
        "trainable": trainable,
        "loss_first": losses[0],
        "loss_last": losses[-1],
    }


def sharded_state_mib(model) -> dict:
    """This rank's base weights as stored (its shards of every parameter, plus the quantisation
    states, which every rank keeps whole) and the total over ranks of the shards alone."""
    from torch.distributed.tensor import DTensor

    from homelab_ft.model import quant

    local = total = 0
    for p in model.parameters():
        if not p.requires_grad:
            t = p.to_local() if isinstance(p, DTensor) else p
            local += t.numel() * t.element_size()
            total += p.numel() * p.element_size()
    states = sum(quant.state_nbytes(m.quant_state) for m in model.modules()
                 if isinstance(m, quant.linear4bit_class()))
    return {"shard_mib": (local + states) / 2**20, "state_mib": states / 2**20, "unsharded_mib": (total + states) / 2**20}


def block_mib(model_dir: Path) -> float:
    """One transformer block as stored on disk (bf16 here)."""
    from safetensors import safe_open

    with safe_open(str(model_dir / "model.safetensors"), framework="pt") as fh:
        return sum(math.prod(fh.get_slice(k).get_shape()) * 2 for k in fh.keys() if k.startswith("model.layers.0.")) / 2**20


def build_model_dir(out: Path, *, hidden: int, intermediate: int, layers: int) -> Path:
    """A random Llama saved in bf16, as real checkpoints are. An fp32 file would be loaded
    zero-copy (the weights stay views of the mmapped file), so RSS would count file pages that the
    kernel can drop: for QLoRA all the pages it read to quantize, for LoRA none of the base."""
    import torch
    from transformers import AutoModelForCausalLM

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    from tiny import make_llama

    make_llama(out, hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=layers,
               num_attention_heads=hidden // 64, num_key_value_heads=max(hidden // 128, 1))
    AutoModelForCausalLM.from_pretrained(out, dtype=torch.bfloat16).save_pretrained(out)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=768)
    parser.add_argument("--intermediate", type=int, default=2048)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--child", choices=RUNGS, help=argparse.SUPPRESS)
    parser.add_argument("--model-dir", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        result = run_rung(args.child, args.model_dir, num_steps=args.steps, batch=args.batch, seq_len=args.seq_len)
        if os.environ.get("RANK", "0") == "0":
            print("RESULT " + json.dumps(result))
        sys.stdout.flush()
        os._exit(0)  # FSDP2 processes may abort in interpreter teardown (comm.exit_now)

    with tempfile.TemporaryDirectory(prefix="rungs-") as tmp:
        model_dir = build_model_dir(Path(tmp) / "model", hidden=args.hidden, intermediate=args.intermediate,
                                    layers=args.layers)
        results = {}
        for method in RUNGS:
            launcher = [sys.executable]
            if method == "qlora_fsdp":
                launcher += ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"]
            cmd = [*launcher, __file__, "--child", method, "--model-dir", str(model_dir),
                   "--steps", str(args.steps), "--batch", str(args.batch), "--seq-len", str(args.seq_len)]
            # A fixed mmap threshold turns off glibc's dynamic one, which otherwise keeps freed
            # tensors of up to 32 MiB in the heap, so RSS would count memory the rung no longer uses.
            env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": str(128 * 1024),
                   # this checkout's package, also in torchrun's children (not an installed copy)
                   "PYTHONPATH": os.pathsep.join(filter(None, [str(Path(__file__).resolve().parents[1]),
                                                               os.environ.get("PYTHONPATH")]))}
            proc = subprocess.run(cmd, capture_output=True, text=True, check=False, env=env)
            lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
            if proc.returncode != 0 or not lines:
                sys.exit(f"{method} failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
            results[method] = json.loads(lines[-1].removeprefix("RESULT "))
    report(results, args)


def report(results: dict, args) -> None:
    import torch

    num_params = (args.layers * (2 * args.hidden * args.hidden + 2 * args.hidden * max(args.hidden // 128, 1) * 64
                                 + 3 * args.hidden * args.intermediate))
    print(f"model: Llama, hidden {args.hidden}, intermediate {args.intermediate}, {args.layers} layers, "
          f"{num_params / 1e6:.1f}M block params; batch {args.batch} x {args.seq_len} tokens; "
          f"{args.steps} timed steps; torch threads {torch.get_num_threads()}")
    lora = results["lora"]

    def above(r):
        return r["train_peak_mib"] - r["before_load_mib"]

    print(f"{'rung':6} {'trainable':>10} {'wall s/step':>11} {'cpu s/step':>10} {'x lora':>6} {'weights MiB':>11} {'x lora':>6} "
          f"{'grad+optim MiB':>14} {'peak RSS-start MiB':>18} {'x lora':>6} {'load peak MiB':>13}  loss")
    for method in RUNGS[:3]:
        r = results[method]
        print(f"{method:6} {r['trainable'] / 1e6:9.2f}M {r['step_s']:11.3f} {r['cpu_s']:10.3f} {r['cpu_s'] / lora['cpu_s']:6.2f} "
              f"{r['weights_mib']:11.1f} {r['weights_mib'] / lora['weights_mib']:6.2f} "
              f"{r['grads_optim_mib']:14.1f} {above(r):18.0f} {above(r) / above(lora):6.2f} "
              f"{r['load_peak_mib']:13.0f}  {r['loss_first']:.4f}->{r['loss_last']:.4f}")
    print("x lora of time: of CPU seconds per step (one thread, robust to other jobs on the machine); "
          "weights: parameters + buffers + 4-bit quant state as stored; peak RSS-start: peak resident memory "
          "while training minus resident memory before loading (imports); load peak: whole-process peak while loading.")
    f, q = results["qlora_fsdp"], results["qlora"]
    n = f["world_size"]
    tokens = args.batch * args.seq_len
    print(f"sharded QLoRA, {n} gloo ranks, {tokens // n} tokens each per step:")
    print(f"  per-rank base (4-bit shards + whole quant states) / (total / {n}): {f['shard_mib']:.1f} MiB / "
          f"{f['unsharded_mib'] / n:.1f} MiB = {f['shard_mib'] / (f['unsharded_mib'] / n):.3f} "
          f"(quant states {f['state_mib']:.1f} MiB per rank)")
    load = f["load_peak_mib"] - f["before_load_mib"]
    print(f"  loading peak (RSS above start) / (shard + one block): {load:.0f} MiB / {f['shard_mib'] + f['block_mib']:.0f} MiB "
          f"= {load / (f['shard_mib'] + f['block_mib']):.2f}  [1-process QLoRA: {q['load_peak_mib'] - q['before_load_mib']:.0f} MiB]")
    print(f"  tokens per CPU-second: {tokens / f['cpu_s']:.0f} vs 1-process QLoRA {tokens / q['cpu_s']:.0f} "
          f"= {q['cpu_s'] / f['cpu_s']:.2f}; wall s/step {f['step_s']:.3f} vs {q['step_s']:.3f}")


if __name__ == "__main__":
    main()
