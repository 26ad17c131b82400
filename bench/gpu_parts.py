"""The measuring parts of bench/gpu_report.py (`make test-gpu`): peak memory against the plan,
tokens/s and MFU against a plain PyTorch loop and HF Trainer, and bitsandbytes' 4-bit kernels
against a plain-torch reference. gpu_report.py's docstring says what each measures and how.
"""

from __future__ import annotations

import argparse
import gc
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace

LLAMA_1B = dict(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                num_attention_heads=32, num_key_value_heads=8)
"""Llama 3.2 1B's shape (its config.json), untied here as the planner's other GPU checks are."""
TINY = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2)
# name: (method, train overrides); every rung and saver the issue lists
MEMORY_ROWS = {
    "full": ("full", {}),
    "full optim_in_bwd": ("full", {"optimizer_in_backward": True, "max_grad_norm": 0.0}),
    "lora": ("lora", {}),
    "lora full logits": ("lora", {"loss_chunk_tokens": 0}),
    "lora ckpt": ("lora", {"activation_checkpointing": True}),
    "lora offload": ("lora", {"activation_checkpointing": True, "activation_offload": True}),
    "qlora": ("qlora", {}),
    "lora compile": ("lora", {"compile": True}),  # last: its first step compiles, the longest row
}
METHODS = ("full", "lora", "qlora")
LOOPS = ("ours", "plain", "hf_trainer")


@dataclass
class Part:
    name: str
    budget_s: float
    status: str = "ok"
    """ok, cut (the budget ran out: what was measured is kept), skipped, or failed."""
    note: str = ""
    rows: list = field(default_factory=list)
    started: float = field(default_factory=time.monotonic)

    def left(self) -> float:
        return self.budget_s - (time.monotonic() - self.started)

    def would_exceed(self, unit_s: float) -> bool:
        """Whether one more unit as long as the longest so far would pass the budget."""
        return self.left() < unit_s

    def cut(self, what: str) -> None:
        self.status = "failed" if self.status == "failed" else "cut"
        self.note = "; ".join(filter(None, [self.note, f"{what}: {self.budget_s:g} s budget spent"]))


@dataclass
class Context:
    args: argparse.Namespace
    device: str
    model_dir: Path
    gpu_name: str
    peak_tflops: float | None
    peak_source: str
    deadline: float
    """time.monotonic() by which every part has stopped (--total-budget-s from the start)."""
    skipped: list = field(default_factory=list)

    def budget(self, seconds: float) -> float:
        """A part's own budget, or what is left of the whole run's if that is less."""
        return max(0.0, min(seconds, self.deadline - time.monotonic()))


def _recipe(ctx: Context, method: str, train: dict):
    from homelab_ft.recipe.config import recipe_from_dict

    return recipe_from_dict({
        "method": method, "model": {"path": str(ctx.model_dir)}, "data": {"max_length": ctx.args.seq_len},
        "lora": {"r": 16, "dropout": 0.0},
        "train": {"device": ctx.device, "micro_batch_size": ctx.args.batch, "lr": 1e-4, **train},
    })


def _session(ctx: Context, recipe):
    import torch

    from homelab_ft.distributed import comm
    from homelab_ft.plan.planner import named_rung, plan_for_recipe
    from homelab_ft.train import optim
    from homelab_ft.train.build import build_model

    env = comm.setup(device_pref=ctx.device)
    rung = named_rung(recipe, plan_for_recipe(recipe))  # the embedding table where `train` would keep it
    torch.manual_seed(0)
    model = build_model(recipe, model_dir=ctx.model_dir, rung=rung, env=env)
    optimizer = optim.build_optimizer(model, recipe.train)
    return SimpleNamespace(env=env, model=model, recipe=recipe, rung=rung, optimizer=optimizer,
                           scheduler=optim.build_scheduler(optimizer, recipe.train))


def _batch(ctx: Context) -> dict:
    import torch

    vocab = (TINY if ctx.args.tiny else LLAMA_1B)["vocab_size"]
    ids = torch.randint(0, vocab, (ctx.args.batch, ctx.args.seq_len), generator=torch.Generator().manual_seed(0))
    return {"input_ids": ids, "labels": ids.clone()}


def _planned_bytes(ctx: Context, recipe) -> int:
    from homelab_ft.locate import read_model_config
    from homelab_ft.plan.hardware import detect, resolve_cluster
    from homelab_ft.plan.ladder import option_rung
    from homelab_ft.plan.planner import request_from_recipe
    from homelab_ft.plan.price.memory import estimate
    from homelab_ft.plan.shape.shapes import model_shape
    from homelab_ft.recipe.config import ClusterConfig

    shape = model_shape(read_model_config(str(ctx.model_dir)))
    cluster = resolve_cluster(ClusterConfig(device=ctx.device), detected=detect())
    request = request_from_recipe(recipe)
    rung = option_rung(recipe.method, "no_shard", False, request=request, cluster=cluster)
    memory = estimate(shape, rung=rung, request=request, cluster=cluster).memory
    return memory.total - memory.overhead


def _sync(device: str) -> None:
    import torch

    if device == "cuda":
        torch.cuda.synchronize()


def _free(device: str) -> None:
    import torch

    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def _peaks(device: str) -> tuple[int, int]:
    """(allocated, reserved) high-water marks since the last _free; on CPU both are the
    process's resident high-water mark (VmHWM), a stand-in for the dry run."""
    import torch

    if device == "cuda":
        return torch.cuda.max_memory_allocated(), torch.cuda.max_memory_reserved()
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            hwm = int(line.split()[1]) * 1024
            return hwm, hwm
    return 0, 0


def memory_part(ctx: Context) -> Part:
    from homelab_ft.errors import UserError
    from homelab_ft.train.trainer import train_step

    part = Part("memory", ctx.budget(ctx.args.memory_budget_s))
    steps = 1 + ctx.args.memory_steps  # a warm-up step creates the optimizer state
    longest = 0.0
    for name, (method, train) in MEMORY_ROWS.items():
        if part.would_exceed(longest) or part.left() <= 0:
            part.cut(f"rows from {name!r} on not run")
            part.rows += [{"row": n, "status": "cut"} for n in list(MEMORY_ROWS)[list(MEMORY_ROWS).index(name):]]
            break
        row, row_start = {"row": name, "method": method}, time.monotonic()
        _free(ctx.device)
        try:
            recipe = _recipe(ctx, method, train)
            session = _session(ctx, recipe)
            batch = _batch(ctx)
            for _ in range(steps):
                train_step(session, [batch])
            _sync(ctx.device)
            allocated, reserved = _peaks(ctx.device)
            planned = _planned_bytes(ctx, recipe)
            row.update(status="ok", allocated_bytes=allocated, reserved_bytes=reserved, planned_bytes=planned,
                       ratio=round(allocated / planned, 3))
            del session
        except UserError as err:  # a preflight refusal on this machine (no Triton, no compiler, ...)
            row.update(status="skipped", reason=str(err))
            ctx.skipped.append(f"memory row {name!r}: {err}")
        except Exception as err:  # an out-of-memory or a bug fails this row; the next rows still run
            row.update(status="failed", reason=f"{type(err).__name__}: {err}"[:300])
            part.status = "failed"
        part.rows.append(row)
        longest = max(longest, time.monotonic() - row_start)
    return part


def _plain_step(model, optimizer, batch: dict, device: str) -> None:
    import torch

    with torch.autocast(device_type=device, dtype=torch.bfloat16, enabled=device == "cuda"):
        out = model(input_ids=batch["input_ids"], labels=batch["labels"])
    out.loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def _hf_times(model, batch: dict, *, steps: int, device: str, out_dir: str) -> list[float]:
    """Seconds per step of HF Trainer on `batch`, timed between its step callbacks."""
    from transformers import Trainer, TrainerCallback, TrainingArguments

    times, rows = [], [{"input_ids": batch["input_ids"][i], "labels": batch["labels"][i]}
                       for i in range(batch["input_ids"].shape[0])]

    class Clock(TrainerCallback):
        def on_step_begin(self, *a, **k):
            _sync(device)
            self.t = time.perf_counter()

        def on_step_end(self, *a, **k):
            _sync(device)
            times.append(time.perf_counter() - self.t)

    args = TrainingArguments(output_dir=out_dir, max_steps=steps, per_device_train_batch_size=len(rows),
                             learning_rate=1e-4, report_to=[], save_strategy="no", logging_strategy="no",
                             bf16=device == "cuda", use_cpu=device == "cpu", disable_tqdm=True)
    Trainer(model=model, args=args, train_dataset=rows * steps, callbacks=[Clock()]).train()
    return times


def _timed(fn, device: str, steps: int) -> list[float]:
    out = []
    for _ in range(steps):
        _sync(device)
        t = time.perf_counter()
        fn()
        _sync(device)
        out.append(time.perf_counter() - t)
    return out


def flops_per_token(method: str, *, num_params: int, num_trainable: int) -> int:
    """Model FLOPs per trained token (module docstring): 6N full, 4N + 6 N_adapter with adapters."""
    return 6 * num_params if method == "full" else 4 * num_params + 6 * num_trainable


def _median(xs: list[float]) -> float:
    xs = sorted(xs)
    return xs[len(xs) // 2]


def _throughput_row(ctx: Context, method: str, part: Part) -> dict:
    import torch

    from homelab_ft.train.trainer import train_step

    session = _session(ctx, _recipe(ctx, method, {}))
    model, batch = session.model, _batch(ctx)
    on_device = {k: v.to(session.env.device) for k, v in batch.items()}
    trainable = [p for p in model.parameters() if p.requires_grad]
    plain_opt = torch.optim.AdamW(trainable, lr=1e-4)
    loops = {"ours": lambda: train_step(session, [batch]),
             "plain": lambda: _plain_step(model, plain_opt, on_device, ctx.device)}
    times = {name: [] for name in LOOPS}
    with tempfile.TemporaryDirectory() as hf_dir:
        for fn in loops.values():  # warm-up: kernels, optimizer state, allocator
            fn()
        _hf_times(model, batch, steps=1, device=ctx.device, out_dir=hf_dir)
        round_s = 0.0
        for rnd in range(ctx.args.rounds):
            if part.would_exceed(round_s) or part.left() <= 0:
                part.cut(f"{method}: {rnd} of {ctx.args.rounds} rounds")
                break
            round_start = time.monotonic()
            for name, fn in loops.items():
                times[name] += _timed(fn, ctx.device, ctx.args.steps)
            times["hf_trainer"] += _hf_times(model, batch, steps=ctx.args.steps, device=ctx.device, out_dir=hf_dir)
            round_s = time.monotonic() - round_start
    tokens = ctx.args.batch * ctx.args.seq_len
    # A 4-bit weight's numel counts its packed bytes, two weights each. The input embedding is a
    # lookup, no FLOPs (PaLM and nanoGPT leave it out of N; the untied LM head stays in).
    n_all = sum(p.numel() * (2 if p.dtype == torch.uint8 else 1) for p in model.parameters())
    n_all -= model.get_input_embeddings().weight.numel()
    per_token = flops_per_token(method, num_params=n_all, num_trainable=sum(p.numel() for p in trainable))
    row = {"method": method, "tokens_per_step": tokens, "flops_per_token": per_token}
    for name in LOOPS:
        if not times[name]:
            row[name] = None
            continue
        tps = tokens / _median(times[name])
        mfu = per_token * tps / (ctx.peak_tflops * 1e12) if ctx.peak_tflops else None
        row[name] = {"tokens_per_s": round(tps, 1), "mfu": None if mfu is None else round(mfu, 4),
                     "steps": len(times[name])}
    if row["ours"] and row["plain"] and row["hf_trainer"]:
        row["ours_over_plain"] = round(row["ours"]["tokens_per_s"] / row["plain"]["tokens_per_s"], 3)
        row["ours_over_hf_trainer"] = round(row["ours"]["tokens_per_s"] / row["hf_trainer"]["tokens_per_s"], 3)
    return row


def throughput_part(ctx: Context) -> Part:
    part = Part("throughput", ctx.budget(ctx.args.throughput_budget_s))
    longest = 0.0
    for method in METHODS:
        if part.would_exceed(longest) or part.left() <= 0:
            part.cut(f"{method} not run")
            part.rows.append({"method": method, "status": "cut"})
            continue
        _free(ctx.device)
        method_start = time.monotonic()
        try:
            part.rows.append(_throughput_row(ctx, method, part))
        except Exception as err:  # one method's failure is its row's; the others still run
            part.rows.append({"method": method, "status": "failed", "reason": f"{type(err).__name__}: {err}"[:300]})
            part.status = "failed"
        longest = max(longest, time.monotonic() - method_start)
        gc.collect()
    return part


def _reference_weight(packed, state):
    """NF4 dequantized in plain torch, independent of bitsandbytes' kernels: two 4-bit codes per
    byte, high nibble first (csrc/kernels.cu kDequantizeBlockwise), each code's value from the
    16-entry table times its block's absmax (no double quantization, so absmax is plain)."""
    import torch

    flat = packed.flatten()
    codes = torch.stack([(flat >> 4) & 0xF, flat & 0xF], dim=1).flatten().long()
    numel = state.shape.numel()
    values = state.code.to(packed.device)[codes][:numel].view(-1, state.blocksize)
    return (values * state.absmax.view(-1, 1)).view(state.shape)


def bnb_part(ctx: Context) -> Part:
    """bitsandbytes' 4-bit kernels against a plain-torch dequantized reference, relative error per
    path: its dequantize kernel, the inference gemv and the training matmul (forward, input grad)."""
    import torch

    part = Part("bitsandbytes", ctx.budget(ctx.args.bnb_budget_s))
    import bitsandbytes as bnb
    import bitsandbytes.functional as F

    dims = (64, 128) if ctx.args.tiny else (4096, 4096)
    torch.manual_seed(0)
    weight = torch.randn(*dims, dtype=torch.bfloat16, device=ctx.device)
    packed, state = F.quantize_4bit(weight, quant_type="nf4", compress_statistics=False)
    reference = _reference_weight(packed, state)
    rows = [{"path": "dequantize_4bit", "rel_error": _rel(F.dequantize_4bit(packed, state), reference)}]
    x1 = torch.randn(1, dims[1], dtype=torch.bfloat16, device=ctx.device)  # no grad: bnb takes gemv_4bit
    rows.append({"path": "gemv_4bit (1 token, inference)",
                 "rel_error": _rel(bnb.matmul_4bit(x1, packed.t(), quant_state=state), x1.float() @ reference.t())})
    x = torch.randn(256, dims[1], dtype=torch.bfloat16, device=ctx.device, requires_grad=True)
    x_ref = x.detach().float().requires_grad_(True)
    y, y_ref = bnb.matmul_4bit(x, packed.t(), quant_state=state), x_ref @ reference.t()
    y.float().pow(2).sum().backward()
    y_ref.pow(2).sum().backward()
    rows.append({"path": "matmul_4bit forward (256 tokens, training)", "rel_error": _rel(y, y_ref)})
    rows.append({"path": "matmul_4bit input gradient", "rel_error": _rel(x.grad, x_ref.grad)})
    for row in rows:
        row["status"] = "ok" if row["rel_error"] <= BNB_TOLERANCE else "failed"
    part.rows = rows
    part.note = f"nf4 vs the bf16 weight it quantizes: {_rel(reference, weight)} (4-bit rounding, not a kernel error)"
    if any(r["status"] == "failed" for r in rows):
        part.status = "failed"
    return part


BNB_TOLERANCE = 0.02
"""bf16 keeps 8 mantissa bits (relative rounding 0.4%); the kernels round in bf16 where the
reference computes in fp32, over 4096-long dot products: a few tenths of a percent apart, not 2%."""


def _rel(a, b) -> float:
    a, b = a.detach().float(), b.detach().float()
    return round(float((a - b).norm() / b.norm().clamp_min(1e-12)), 5)
