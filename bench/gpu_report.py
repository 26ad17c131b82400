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
import json
import os
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from dataclasses import asdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from gpu_parts import LLAMA_1B, TINY, Context, Part, bnb_part, flops_per_token, memory_part, throughput_part  # noqa: E402

__all__ = ["flops_per_token", "main"]


def cuda_tests_part(ctx: Context) -> Part:
    """pytest -m cuda, cut by its budget (the summary says how far it got)."""
    part = Part("cuda_tests", ctx.budget(ctx.args.tests_budget_s))
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
    if report["device"] == "cpu":
        lines += ["Dry run: the figures only exercise the code. CPU peaks are the process's resident "
                  "high-water mark, which the plan's step figures do not price.", ""]
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
        return ", ".join(f"{k} {'n/a' if v is None else _cell(v)}" for k, v in value.items())
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
                      peak_tflops=peak, peak_source=source, deadline=start + args.total_budget_s,
                      skipped=environment_skips(device))
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
    # Budgets: 150 + 150 + 200 + 20 s and ~40 s of building the model: under 10 minutes on one
    # GPU; --total-budget-s caps them together whatever each part takes.
    parser.add_argument("--total-budget-s", type=float, default=570)
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
