"""`make test-gpu`: one GPU, at most 10 minutes, one report (runs/gpu-report.md and .json).

Parts, each with its own step and time budget; a part that would pass its budget is cut there and
reported as cut, the rest still run:
- `cuda_tests`: pytest -m cuda (tests/gpu), counts and every skip reason;
- `memory`: one training step's peak (torch.cuda.max_memory_allocated and _reserved) of each rung
  and memory saver on a ~1B-shaped random Llama (Llama 3.2 1B's shape), against the plan's device
  total minus its CUDA-context item (which the allocator does not see), as measured/planned;
- `throughput`: tokens/s and MFU of full, LoRA and QLoRA fine-tuning with homelab-ft's own
  train_step, a plain PyTorch loop and HF Trainer, on the same model object and batch, run in
  interleaved rounds (ours, plain, Trainer, ours, ...) so clock and thermal drift hit all three;
- `bitsandbytes`: its 4-bit matmul kernels (the inference gemv and the training matmul, forward
  and backward) against x @ dequantize_4bit(W).T, the counterpart of the CPU guard (quant.py);
- `skipped`: what did not run and why (no Triton, bitsandbytes without CUDA, one GPU only, ...).

MFU = model FLOPs per token x tokens/s / the GPU's peak dense bf16 FLOPs (plan/gpus.py's table and
its sources; None for a GPU not in it). FLOPs per token, without the attention-score term
(PaLM's 6N, as nanoGPT's estimate_mfu): full fine-tuning 6 N (forward 2N, backward 4N: gradients of
activations and of every weight); LoRA and QLoRA 4 N + 6 N_adapter (the frozen base weights get no
weight gradient, so backward is 2N for activation gradients; the adapters are trained as in full).

Without CUDA it prints one line and exits 0. `--device cpu --tiny` runs every part's code on a tiny
model on the CPU (the tests' dry run; MFU None there) so the report builder is tested here.

    .venv/bin/python bench/gpu_report.py                      # make test-gpu
    .venv/bin/python bench/gpu_report.py --device cpu --tiny --out /tmp/r
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from dataclasses import asdict, dataclass, field
from pathlib import Path
from types import SimpleNamespace

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

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
    "lora compile": ("lora", {"compile": True}),
    "qlora": ("qlora", {}),
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

    def cut(self, what: str) -> None:
        self.status = "cut"
        self.note = "; ".join(filter(None, [self.note, f"{what}: {self.budget_s:g} s budget spent"]))


@dataclass
class Context:
    args: argparse.Namespace
    device: str
    model_dir: Path
    gpu_name: str
    peak_tflops: float | None
    peak_source: str
    skipped: list = field(default_factory=list)


def _recipe(ctx: Context, method: str, train: dict):
    from homelab_ft.config import recipe_from_dict

    return recipe_from_dict({
        "method": method, "model": {"path": str(ctx.model_dir)}, "data": {"max_length": ctx.args.seq_len},
        "lora": {"r": 16, "dropout": 0.0},
        "train": {"device": ctx.device, "micro_batch_size": ctx.args.batch, "lr": 1e-4, **train},
    })


def _session(ctx: Context, recipe):
    import torch

    from homelab_ft.distributed import comm
    from homelab_ft.rung import rung_for
    from homelab_ft.train import optim
    from homelab_ft.train.build import build_model

    env = comm.setup(device_pref=ctx.device)
    torch.manual_seed(0)
    model = build_model(recipe, model_dir=ctx.model_dir, rung=rung_for(recipe), env=env)
    optimizer = optim.build_optimizer(model, recipe.train)
    return SimpleNamespace(env=env, model=model, recipe=recipe, rung=rung_for(recipe), optimizer=optimizer,
                           scheduler=optim.build_scheduler(optimizer, recipe.train))


def _batch(ctx: Context) -> dict:
    import torch

    vocab = (TINY if ctx.args.tiny else LLAMA_1B)["vocab_size"]
    ids = torch.randint(0, vocab, (ctx.args.batch, ctx.args.seq_len), generator=torch.Generator().manual_seed(0))
    return {"input_ids": ids, "labels": ids.clone()}


def _planned_bytes(ctx: Context, recipe) -> int:
    from homelab_ft.config import ClusterConfig
    from homelab_ft.locate import read_model_config
    from homelab_ft.plan.hardware import detect, resolve_cluster
    from homelab_ft.plan.ladder import option_rung
    from homelab_ft.plan.memory import estimate
    from homelab_ft.plan.planner import request_from_recipe
    from homelab_ft.plan.shapes import model_shape

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

    part = Part("memory", ctx.args.memory_budget_s)
    steps = 1 + ctx.args.memory_steps  # a warm-up step creates the optimizer state
    for name, (method, train) in MEMORY_ROWS.items():
        if part.left() <= 0:
            part.cut(f"rows from {name!r} on not run")
            part.rows += [{"row": n, "status": "cut"} for n in list(MEMORY_ROWS)[list(MEMORY_ROWS).index(name):]]
            break
        row = {"row": name, "method": method}
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
        part.rows.append(row)
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
        for rnd in range(ctx.args.rounds):
            if part.left() <= 0:
                part.cut(f"{method}: {rnd} of {ctx.args.rounds} rounds")
                break
            for name, fn in loops.items():
                times[name] += _timed(fn, ctx.device, ctx.args.steps)
            times["hf_trainer"] += _hf_times(model, batch, steps=ctx.args.steps, device=ctx.device, out_dir=hf_dir)
    tokens = ctx.args.batch * ctx.args.seq_len
    n_all = sum(p.numel() for p in model.parameters())  # 4-bit weights: numel of the packed bytes, x2 below
    if method == "qlora":
        n_all = sum(p.numel() * (2 if p.dtype == torch.uint8 else 1) for p in model.parameters())
    per_token = flops_per_token(method, num_params=n_all, num_trainable=sum(p.numel() for p in trainable))
    row = {"method": method, "tokens_per_step": tokens, "flops_per_token": per_token, "steps": {}}
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
    part = Part("throughput", ctx.args.throughput_budget_s)
    for method in METHODS:
        if part.left() <= 0:
            part.cut(f"{method} not run")
            part.rows.append({"method": method, "status": "cut"})
            continue
        _free(ctx.device)
        part.rows.append(_throughput_row(ctx, method, part))
        gc.collect()
    return part


def bnb_part(ctx: Context) -> Part:
    """bitsandbytes' 4-bit kernels against the dequantized reference, relative error per path."""
    import torch

    part = Part("bitsandbytes", ctx.args.bnb_budget_s)
    import bitsandbytes as bnb
    import bitsandbytes.functional as F

    dims = (64, 128) if ctx.args.tiny else (4096, 4096)
    dtype = torch.bfloat16
    torch.manual_seed(0)
    weight = torch.randn(*dims, dtype=dtype, device=ctx.device)
    packed, state = F.quantize_4bit(weight, quant_type="nf4", compress_statistics=True)
    reference = F.dequantize_4bit(packed, state).to(dtype)
    for path, tokens in (("gemv (1 token, inference)", 1), ("matmul fwd+bwd (training)", 256)):
        x = torch.randn(tokens, dims[1], dtype=dtype, device=ctx.device, requires_grad=True)
        x_ref = x.detach().clone().requires_grad_(True)
        y = bnb.matmul_4bit(x, packed.t(), quant_state=state)
        y_ref = x_ref @ reference.t()
        row = {"path": path, "forward_rel_error": _rel(y, y_ref)}
        if tokens > 1:
            y.float().pow(2).sum().backward()
            y_ref.float().pow(2).sum().backward()
            row["input_grad_rel_error"] = _rel(x.grad, x_ref.grad)
        row["status"] = "ok" if max(v for k, v in row.items() if k.endswith("error")) <= BNB_TOLERANCE else "failed"
        part.rows.append(row)
    if any(r["status"] == "failed" for r in part.rows):
        part.status = "failed"
    return part


BNB_TOLERANCE = 0.02
"""bf16 keeps 8 mantissa bits (relative rounding 0.4%); the kernels and the reference round in
different orders over 4096-long dot products: a few tenths of a percent apart, not 2%."""


def _rel(a, b) -> float:
    return round(float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-12)), 5)


def cuda_tests_part(ctx: Context) -> Part:
    """pytest -m cuda, cut by its budget (the summary says how far it got)."""
    part = Part("cuda_tests", ctx.args.tests_budget_s)
    if ctx.device != "cuda":
        part.status, part.note = "skipped", "dry run on the CPU: the cuda tests skip themselves without a GPU"
        return part
    with tempfile.TemporaryDirectory() as tmp:
        xml = Path(tmp) / "junit.xml"
        cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "cuda", "-rs", "tests/gpu",
               f"--junitxml={xml}"]
        try:
            subprocess.run(cmd, cwd=ROOT, timeout=max(part.left(), 1), check=False, capture_output=True)
        except subprocess.TimeoutExpired:
            part.cut("pytest stopped")
        if xml.is_file():
            for case in ET.parse(xml).getroot().iter("testcase"):
                outcome = next((c.tag for c in case if c.tag in ("failure", "error", "skipped")), "passed")
                row = {"test": f"{case.get('classname')}::{case.get('name')}", "outcome": outcome}
                if outcome == "skipped":
                    row["reason"] = next(c.get("message") for c in case if c.tag == "skipped")
                    ctx.skipped.append(f"{row['test']}: {row['reason']}")
                part.rows.append(row)
    if any(r["outcome"] in ("failure", "error") for r in part.rows):
        part.status = "failed"
    return part


def environment_skips(device: str) -> list[str]:
    """What this machine cannot run, named before the parts start."""
    import torch

    out = []
    if device == "cuda":
        from torch.utils._triton import has_triton

        if not has_triton():
            out.append("torch.compile rows: Triton missing (pip install triton matching this torch)")
        if torch.cuda.device_count() < 2:
            out.append("multi-GPU (FSDP2 across GPUs, NCCL): one GPU only")
    try:
        import bitsandbytes  # noqa: F401
        from bitsandbytes.cextension import BNB_BACKEND, lib

        if device == "cuda" and (BNB_BACKEND not in ("CUDA", "ROCm") or not hasattr(lib, "cquantize_blockwise_fp16_nf4")):
            out.append(f"bitsandbytes without CUDA kernels (backend {BNB_BACKEND}): QLoRA rows fall back or fail")
    except ImportError as err:
        out.append(f"bitsandbytes not importable: {err}")
    return out


def _model(args, out_dir: Path) -> Path:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    shape = TINY if args.tiny else LLAMA_1B
    config = LlamaConfig(**shape, max_position_embeddings=args.seq_len, tie_word_embeddings=False)
    torch.manual_seed(0)
    LlamaForCausalLM(config).to(torch.bfloat16).save_pretrained(out_dir)
    return out_dir


def _gpu(device: str) -> tuple[str, float | None, str]:
    import torch

    from homelab_ft.plan import gpus

    if device != "cuda":
        return "cpu", None, "dry run on the CPU: no peak bf16 figure, MFU not computed"
    name = torch.cuda.get_device_name(0)
    gpu = gpus.lookup(name)
    if gpu is None:
        return name, None, f"{name!r} is not in plan/gpus.py's table: MFU not computed"
    return name, gpu.tflops, f"{gpu.tflops:g} TFLOPS dense bf16 ({gpu.key}, {gpu.source} specifications, plan/gpus.py)"


def write_report(report: dict, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "gpu-report.json").write_text(json.dumps(report, indent=1) + "\n")
    lines = [f"# GPU report: {report['gpu']}", "", f"torch {report['torch']}, model {report['model']}, "
             f"peak {report['peak_source']}; {report['wall_s']:.0f} s", ""]
    for part in report["parts"]:
        lines += [f"## {part['name']}: {part['status']}" + (f" ({part['note']})" if part["note"] else ""), ""]
        if part["rows"]:
            keys = list(dict.fromkeys(k for r in part["rows"] for k in r))
            lines += ["| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
            lines += ["| " + " | ".join(_cell(r.get(k)) for k in keys) + " |" for r in part["rows"]]
            lines.append("")
    lines += ["## skipped", ""] + [f"- {s}" for s in report["skipped"] or ["nothing"]]
    (out / "gpu-report.md").write_text("\n".join(lines) + "\n")


def _cell(value) -> str:
    if isinstance(value, dict):
        return ", ".join(f"{k} {_cell(v)}" for k, v in value.items())
    if isinstance(value, int) and value > 10**6:
        return f"{value / 2**20:.0f} MiB"
    return "" if value is None else str(value)


PARTS = {"cuda_tests": cuda_tests_part, "memory": memory_part, "throughput": throughput_part, "bitsandbytes": bnb_part}


def run(args) -> dict:
    import torch

    from homelab_ft.model import compiling

    start = time.monotonic()
    device = args.device
    if args.tiny:  # the dry run: dynamo and AOTAutograd without inductor's minutes of C++ compiling
        compiling.BACKEND = "aot_eager"
    name, peak, source = _gpu(device)
    with tempfile.TemporaryDirectory() as tmp:
        ctx = Context(args=args, device=device, model_dir=_model(args, Path(tmp) / "model"), gpu_name=name,
                      peak_tflops=peak, peak_source=source, skipped=environment_skips(device))
        parts = []
        for part_name in args.parts.split(","):
            try:
                parts.append(PARTS[part_name](ctx))
            except Exception as err:  # one part's crash is reported, the others still run
                parts.append(Part(part_name, 0, status="failed", note=f"{type(err).__name__}: {err}"[:500]))
    return {"gpu": name, "torch": torch.__version__, "device": device, "peak_tflops": peak, "peak_source": source,
            "model": "tiny Llama (dry run)" if args.tiny else "Llama 3.2 1B shape, random weights, bf16",
            "batch": args.batch, "seq_len": args.seq_len, "wall_s": round(time.monotonic() - start, 1),
            "parts": [{k: v for k, v in asdict(p).items() if k != "started"} for p in parts],
            "skipped": ctx.skipped + [f"{p.name}: {p.note}" for p in parts if p.status == "skipped"]}


def parse(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="auto", choices=["auto", "cuda", "cpu"])
    parser.add_argument("--tiny", action="store_true", help="a tiny model and short rows (the CPU dry run)")
    parser.add_argument("--out", type=Path, default=ROOT / "runs")
    parser.add_argument("--parts", default=",".join(PARTS))
    parser.add_argument("--seq-len", type=int, default=None)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--memory-steps", type=int, default=2, help="measured steps per memory row")
    parser.add_argument("--steps", type=int, default=3, help="steps per loop per throughput round")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds of ours, plain, HF Trainer")
    # Budgets: 150 + 150 + 200 + 20 s and ~40 s of model building: under 10 minutes on one GPU.
    parser.add_argument("--tests-budget-s", type=float, default=150)
    parser.add_argument("--memory-budget-s", type=float, default=150)
    parser.add_argument("--throughput-budget-s", type=float, default=200)
    parser.add_argument("--bnb-budget-s", type=float, default=20)
    args = parser.parse_args(argv)
    args.seq_len = args.seq_len or (32 if args.tiny else 2048)
    return args


def main(argv=None) -> int:
    args = parse(argv)
    if args.device == "auto":
        import torch

        if not torch.cuda.is_available():
            print("make test-gpu: no CUDA GPU on this machine (torch.cuda.is_available() is False); nothing run")
            return 0
        args.device = "cuda"
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    report = run(args)
    write_report(report, args.out)
    print(f"wrote {args.out / 'gpu-report.md'} and gpu-report.json: "
          + ", ".join(f"{p['name']} {p['status']}" for p in report["parts"]))
    return 1 if any(p["status"] == "failed" for p in report["parts"]) else 0


if __name__ == "__main__":
    raise SystemExit(main())
