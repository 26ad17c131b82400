"""Sharded training on CPU: throughput, per-rank memory and collective traffic against FSDP theory.

    OMP_NUM_THREADS=1 .venv/bin/python bench/sharded.py

On a ~20M-parameter Llama, one global batch of 4 x 128 tokens per step, in one run:
  (a) one process, a plain PyTorch loop (model(labels=...) -> backward -> clip -> AdamW);
  (b) one process, our loop's arithmetic (token-sum loss, global token count, sync switch, clip);
  (c) two ranks of (b) with FSDP2 FULL_SHARD over gloo, 2 x 128 tokens each.
Prints tokens/s of each, per-rank model-state bytes (params + grads + AdamW moments) / (total / N),
and bytes moved by FSDP's all-gathers and reduce-scatters per step / the FSDP theory for
FULL_SHARD, 3 x parameter bytes x (N-1)/N (all-gather in forward, again in backward,
reduce-scatter of gradients). Goals: <= 1.02 and <= 1.05. One thread per rank (2-core machine).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

GLOBAL_BATCH, SEQ, WARMUP, STEPS = 4, 128, 2, 8


def make_model(out_dir: Path) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=4096, hidden_size=512, intermediate_size=1376, num_hidden_layers=6,
                         num_attention_heads=8, num_key_value_heads=8, max_position_embeddings=SEQ)
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(out_dir)
    return out_dir


def batches(rank: int, world: int, vocab: int) -> list[torch.Tensor]:
    """The same global batches whatever the world size; rank r takes rows r*B/N .. (r+1)*B/N."""
    gen = torch.Generator().manual_seed(1)
    full = [torch.randint(0, vocab, (GLOBAL_BATCH, SEQ), generator=gen) for _ in range(WARMUP + STEPS)]
    per = GLOBAL_BATCH // world
    return [b[rank * per:(rank + 1) * per] for b in full]


class CommCounter:
    """Counts bytes this rank sends in FSDP2's all-gathers and reduce-scatters ((N-1)/N of the buffer)."""

    def __init__(self, world: int):
        import torch.distributed as dist

        self.bytes, self.world, self.dist = 0, world, dist
        self._ag, self._rs = dist.all_gather_single, dist.reduce_scatter_single
        dist.all_gather_single = self._wrap(self._ag, out=True)
        dist.reduce_scatter_single = self._wrap(self._rs, out=False)

    def _wrap(self, fn, *, out: bool):
        def counted(*args, **kwargs):
            big = (args[0] if args else kwargs["output"]) if out else (args[1] if len(args) > 1 else kwargs["input"])
            self.bytes += big.numel() * big.element_size() * (self.world - 1) / self.world
            return fn(*args, **kwargs)
        return counted


def child(mode: str, model_dir: str) -> dict:
    from torch.distributed.tensor import DTensor
    from transformers import AutoModelForCausalLM

    from homelab_ft import distributed, steps
    from homelab_ft.rung import Rung

    env = distributed.setup(device_pref="cpu", timeout_s=120)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    param_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    if env.distributed:
        model = distributed.parallelize(model, env, rung=Rung("full", "full_shard", False, procs_per_node=env.world_size))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=False)
    counter = CommCounter(env.world_size) if env.distributed else None
    data = batches(env.rank, env.world_size, model.config.vocab_size)
    elapsed, comm = 0.0, 0.0
    for i, ids in enumerate(data):
        if i == WARMUP:
            comm_start = counter.bytes if counter else 0
            t0 = time.perf_counter()
        if mode == "plain":
            model(input_ids=ids, labels=ids).loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        else:
            global_tokens = distributed.all_reduce_sum(steps.trained_tokens(ids), env)
            scale = steps.loss_scale(world_size=env.world_size, global_tokens=int(global_tokens))
            with distributed.accumulation_sync(model, last_micro_batch=True):
                (steps.token_loss_sum(model(input_ids=ids).logits, ids) * scale).backward()
            distributed.clip_grad_norm_(model, 1.0, env)
        if i == len(data) - 1:
            local = lambda t: (t.to_local() if isinstance(t, DTensor) else t)  # noqa: E731
            state = sum(local(p).numel() * 4 for p in model.parameters())
            state += sum(local(p.grad).numel() * 4 for p in model.parameters())
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    elapsed = time.perf_counter() - t0
    state += sum(local(v).numel() * v.element_size() for s in optimizer.state.values()
                 for k, v in s.items() if k in ("exp_avg", "exp_avg_sq"))
    if counter:
        comm = (counter.bytes - comm_start) / STEPS
    result = {
        "tokens_per_s": GLOBAL_BATCH * SEQ * STEPS / elapsed,
        "state_ratio": state / (4 * param_bytes / env.world_size),
        "comm_ratio": comm / (3 * param_bytes * (env.world_size - 1) / env.world_size) if counter else None,
        "params_m": param_bytes / 4 / 1e6,
    }
    distributed.teardown(env)
    return result


def main() -> None:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = str(make_model(Path(tmp) / "model"))
        out = {}
        for name, argv in [
            ("plain 1 proc", [sys.executable, __file__, "--child", "plain", model_dir]),
            ("ours 1 rank", [sys.executable, __file__, "--child", "ours", model_dir]),
            ("ours 2 ranks", [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
                              __file__, "--child", "ours", model_dir]),
        ]:
            proc = subprocess.run(argv, env=env, capture_output=True, text=True, check=True)
            line = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")][0]
            out[name] = json.loads(line.removeprefix("RESULT "))
    plain = out["plain 1 proc"]["tokens_per_s"]
    print(f"model: {out['plain 1 proc']['params_m']:.1f}M params, {GLOBAL_BATCH} x {SEQ} tokens per step, {STEPS} steps")
    for name, r in out.items():
        print(f"{name:13s} tokens/s {r['tokens_per_s']:8.0f}  vs plain {r['tokens_per_s'] / plain:5.2f}")
    two = out["ours 2 ranks"]
    print(f"per-rank model-state bytes / (total / 2): {two['state_ratio']:.4f}   (goal <= 1.02)")
    print(f"collective bytes per step / (3 x param bytes x 1/2): {two['comm_ratio']:.4f}   (goal <= 1.05)")


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        result = child(sys.argv[2], sys.argv[3])
        if int(os.environ.get("RANK", "0")) == 0:
            print("RESULT " + json.dumps(result), flush=True)
        from homelab_ft.distributed import exit_now

        exit_now(0)
    main()
