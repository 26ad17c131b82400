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

    OMP_NUM_THREADS=1 .venv/bin/python bench/sharded.py --ends

The model's ends as FSDP2 units of their own (parallelize.shard_ends) against the embeddings and
LM head gathered in the root unit for the whole step: a 2-layer Llama with Llama 3's 128,256-entry
vocabulary (hidden 256, fp32: embedding and head 131 MB each), 2 gloo ranks of full_shard, the
trainer's own model build and `train_step` (chunked loss), one row of 256 tokens per rank (two
loss chunks). Per rank, the peak a step adds to what is resident before it, measured as
bench/memory.py measures it (VmHWM reset through /proc/self/clear_refs, glibc serving large
blocks with mmap), after a warm-up step; the larger of the two ranks, the smaller of two runs of
each variant interleaved, next to the planner's figure for the same step (memory.total -
overhead - weights - optimizer). ~10 minutes on a busy 2-core machine.
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

    from homelab_ft.distributed import comm, parallelize
    from homelab_ft.rung import Rung
    from homelab_ft.train import steps

    env = comm.setup(device_pref="cpu", timeout_s=120)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    param_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    if env.distributed:
        model = parallelize.parallelize(model, env, rung=Rung("full", "full_shard", False, procs_per_node=env.world_size))
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
            global_tokens = comm.all_reduce_sum(steps.trained_tokens(ids), env)
            scale = steps.loss_scale(world_size=env.world_size, global_tokens=int(global_tokens))
            with parallelize.accumulation_sync(model, last_micro_batch=True):
                (steps.next_token_loss_sum(model(input_ids=ids).logits, ids) * scale).backward()
            comm.clip_grad_norm_(model, 1.0, env)
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
    comm.teardown(env)
    return result


ENDS_VOCAB, ENDS_SEQ = 128256, 256


def _status_bytes(key: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(key)


def _ends_recipe(model_dir: str, method: str):
    from homelab_ft.recipe.config import recipe_from_dict

    return recipe_from_dict({
        "method": method, "model": {"path": model_dir}, "lora": {"r": 16, "dropout": 0.0},
        "data": {"max_length": ENDS_SEQ}, "cluster": {"gpus_per_node": 2}, "sharding": {"strategy": "full_shard"},
        "train": {"device": "cpu", "micro_batch_size": 1, "lr": 1e-4, "max_grad_norm": 1.0},
    })


def ends_child(variant: str, method: str, model_dir: str) -> dict:
    """One rank: the peak bytes one training step adds, with the ends in the root unit (`root`) or
    as units of their own (`units`)."""
    import gc
    from types import SimpleNamespace

    from homelab_ft.distributed import comm, parallelize
    from homelab_ft.rung import rung_for
    from homelab_ft.train import optim
    from homelab_ft.train.build import build_model
    from homelab_ft.train.trainer import train_step

    if variant == "root":  # before: parallelize without shard_ends keeps both ends in the root unit
        parallelize.shard_ends = lambda model, **fsdp: None
    env = comm.setup(device_pref="cpu", timeout_s=120)
    recipe = _ends_recipe(model_dir, method)
    torch.manual_seed(0)
    model = build_model(recipe, model_dir=Path(model_dir), rung=rung_for(recipe), env=env)
    optimizer = optim.build_optimizer(model, recipe.train)
    session = SimpleNamespace(env=env, model=model, recipe=recipe, rung=rung_for(recipe), optimizer=optimizer,
                              scheduler=optim.build_scheduler(optimizer, recipe.train))
    ids = torch.randint(0, ENDS_VOCAB, (1, ENDS_SEQ), generator=torch.Generator().manual_seed(env.rank))
    batch = {"input_ids": ids, "labels": ids.clone()}
    train_step(session, [batch])  # the optimizer state, kernel workspaces and gloo buffers
    gc.collect()
    comm.barrier(env)
    Path("/proc/self/clear_refs").write_text("5")
    start = _status_bytes("VmRSS")
    train_step(session, [batch])
    peak = torch.tensor([_status_bytes("VmHWM") - start], dtype=torch.float64)
    torch.distributed.all_reduce(peak, op=torch.distributed.ReduceOp.MAX)
    comm.teardown(env)
    return {"peak": float(peak)}


def ends_planned(method: str, model_dir: str) -> int:
    from homelab_ft.locate import read_model_config
    from homelab_ft.plan.hardware import detect, resolve_cluster
    from homelab_ft.plan.ladder import option_rung
    from homelab_ft.plan.planner import request_from_recipe
    from homelab_ft.plan.price.memory import estimate
    from homelab_ft.plan.shape.shapes import model_shape
    from homelab_ft.recipe.config import ClusterConfig

    recipe = _ends_recipe(model_dir, method)
    request = request_from_recipe(recipe)
    cluster = resolve_cluster(ClusterConfig(device="cpu", gpus_per_node=2), detected=detect())
    shape = model_shape(read_model_config(model_dir))
    m = estimate(shape, rung=option_rung(method, "full_shard", False, request=request, cluster=cluster),
                 request=request, cluster=cluster).memory
    return m.total - m.overhead - m.weights - m.optimizer


def ends_main() -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO), MALLOC_MMAP_THRESHOLD_="131072",
               TRANSFORMERS_VERBOSITY="error")
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = Path(tmp) / "model"
        config = LlamaConfig(vocab_size=ENDS_VOCAB, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=ENDS_SEQ)
        torch.manual_seed(0)
        LlamaForCausalLM(config).save_pretrained(model_dir)
        print(f"Llama: vocab {ENDS_VOCAB}, hidden 256, 2 layers, fp32; 2 gloo ranks full_shard, 1 x {ENDS_SEQ} "
              f"tokens per rank; peak a step adds per rank (larger rank), MB")
        measured: dict[tuple[str, str], list[float]] = {}
        for method in ("full", "lora"):
            for _ in range(2):
                for variant in ("root", "units"):  # interleaved: load on the shared machine drifts
                    argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
                            __file__, "--ends-child", variant, method, str(model_dir)]
                    proc = subprocess.run(argv, env=env, capture_output=True, text=True, check=True)
                    line = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")][0]
                    measured.setdefault((method, variant), []).append(json.loads(line.removeprefix("RESULT "))["peak"])
            root, units = min(measured[(method, "root")]), min(measured[(method, "units")])
            planned = ends_planned(method, str(model_dir))
            print(f"{method:5s} ends in root {root / 1e6:7.1f}   own units {units / 1e6:7.1f}   "
                  f"saved {(root - units) / 1e6:6.1f} (embedding {ENDS_VOCAB * 256 * 4 / 1e6:.1f})   "
                  f"planned (units) {planned / 1e6:7.1f}  measured/planned {units / planned:5.3f}")


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
    if len(sys.argv) > 1 and sys.argv[1] == "--ends-child":
        result = ends_child(sys.argv[2], sys.argv[3], sys.argv[4])
        if int(os.environ.get("RANK", "0")) == 0:
            print("RESULT " + json.dumps(result), flush=True)
        from homelab_ft.distributed.comm import exit_now

        exit_now(0)
    if len(sys.argv) > 1 and sys.argv[1] == "--ends":
        ends_main()
        raise SystemExit(0)
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        result = child(sys.argv[2], sys.argv[3])
        if int(os.environ.get("RANK", "0")) == 0:
            print("RESULT " + json.dumps(result), flush=True)
        from homelab_ft.distributed.comm import exit_now

        exit_now(0)
    main()
