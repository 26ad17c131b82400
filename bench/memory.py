"""Peak memory of one training step, measured, for each memory switch on and off, next to the planner.

A small Llama with Llama 3's 128,256-entry vocabulary reads 2048-token rows. Every row of the table
runs in a fresh process (so one row's freed memory cannot hide another's peak) and measures the
trainer's own `train_step` after a warm-up step has created the optimizer state:
- on CPU, the process's resident high-water mark: `/proc/self/clear_refs` is written "5" to reset
  VmHWM to the current RSS just before the step, and VmHWM - RSS before the step is the step's
  peak. glibc is told to serve every allocation above 128 KiB with mmap
  (MALLOC_MMAP_THRESHOLD_), so freed tensors leave the RSS at once and do not pad later peaks;
- on CUDA (`--device cuda`), torch.cuda.max_memory_allocated() - memory_allocated() before the step.
The planner's figure for the same shapes is what the step adds to weights and optimizer state:
`memory.total - overhead - weights - optimizer`. The `loss only` rows time the LM head and
cross-entropy alone on given hidden states (the head frozen), against the planner's `logits` item.

    OMP_NUM_THREADS=1 .venv/bin/python bench/memory.py                 # ~2 minutes on one core
    OMP_NUM_THREADS=1 .venv/bin/python bench/memory.py --optim-in-bwd-shape
    OMP_NUM_THREADS=1 .venv/bin/python bench/memory.py --family qwen3_5_text --seq-len 512 --rows "lora chunked,full chunked"

`--family MODEL_TYPE` measures tests/families.py's tiny random model of that transformers family
instead (its default config with tiny sizes; --hidden/--intermediate/--layers/--vocab do not apply),
so the planner's derived shape (plan/shape/derive.py) is checked on families it has no formula for.
    .venv/bin/python bench/memory.py --device cuda --hidden 1024 --layers 4

MoE (issue 21): `--moe-shape` is a scaled-down Qwen3-30B-A3B (MOE_CONFIG: 4 layers of 64 experts,
top-8, hidden 512, moe_intermediate 384, vocab 8192; 1024 tokens), LoRA on an fp32 base and QLoRA
with packed 4-bit experts (the CPU's compute dtype for both), adapters on every expert
(all-linear). A step row also prints the whole resident footprint the planner accounts for
(`<row> resident`: what the build and the warm-up step left resident, anonymous memory plus the
weights still mapped from the safetensors file, and the step's peak, against `memory.total -
overhead`) and the planner's items, so a miss can be located. `--moe --family mixtral` (or
gpt_oss) sizes those families the same way.
    OMP_NUM_THREADS=1 .venv/bin/python bench/memory.py --moe-shape                  # ~1 minute
    OMP_NUM_THREADS=1 .venv/bin/python bench/memory.py --moe --family mixtral --seq-len 1024 --rows "lora chunked,qlora chunked"
Measured (2-core shared CPU, torch 2.13, transformers 5.24, bitsandbytes 0.50), MB planned / measured:
    qwen3_moe lora chunked    381.1 /  363.4 (0.953)    resident 1139.2 / 1155.7 (1.014)
    qwen3_moe qlora chunked   381.1 /  361.9 (0.950)    resident  606.1 /  631.5 (1.042)
    mixtral   lora chunked    561.4 /  533.7 (0.951)    resident 1319.5 / 1338.1 (1.014)
    mixtral   qlora chunked   561.4 /  532.0 (0.948)    resident  785.9 /  807.2 (1.027)
    gpt_oss   lora chunked    858.4 /  808.8 (0.942)    resident 1617.8 / 1644.3 (1.016)
    gpt_oss   qlora chunked   858.4 /  806.6 (0.940)    resident 1084.2 / 1113.4 (1.027)
    qwen3_moe lora chunked+ckpt   113.2 / 111.0 (0.980)    resident  871.3 /  899.8 (1.033)
    qwen3_moe qlora chunked+ckpt  113.2 / 110.9 (0.979)    resident  338.3 /  365.1 (1.079)
    (qwen3_moe rows: with the expert loop that keeps no hidden-wide tensor per routed token, idle
    machine; the mixtral and gpt_oss rows are from before that change)
The resident rows' excess is process memory, not the model's: ~20 MB the warm-up step leaves in
the heap, and for QLoRA ~10-25 MB that quantizing 512 expert matrices leaves (QuantState objects,
freed small tensors; malloc_trim returns ~5 MB of it), which the planner counts in
CPU_PROCESS_BYTES.
Before activations.expert_loop_bytes the step was planned at 383.2 MB (measured/planned 1.43): the
planner priced the activations of transformers' grouped_mm experts, not of moe_experts' loop.
Before Memory.gradients_at_recompute the checkpointed step was planned at 125.2 MB (1.19-1.21): the
first block is recomputed beside every later block's adapter gradients.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from types import SimpleNamespace

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

VOCAB = 128256
# name: (what it measures, recipe train overrides, method)
ROWS = {
    "loss full logits": ("loss", {"loss_chunk_tokens": 0}, "lora"),
    "loss chunked": ("loss", {}, "lora"),
    "lora full logits": ("step", {"loss_chunk_tokens": 0}, "lora"),
    "lora chunked": ("step", {}, "lora"),
    "lora chunked+ckpt": ("step", {"activation_checkpointing": True}, "lora"),
    "qlora chunked": ("step", {}, "qlora"),
    "qlora chunked+ckpt": ("step", {"activation_checkpointing": True}, "qlora"),
    "full chunked": ("step", {}, "full"),
    "full chunked+optim_in_bwd": ("step", {"optimizer_in_backward": True, "max_grad_norm": 0.0}, "full"),
    "full ckpt": ("step", {"activation_checkpointing": True}, "full"),
    "full ckpt+optim_in_bwd": ("step", {"activation_checkpointing": True, "optimizer_in_backward": True,
                                        "max_grad_norm": 0.0}, "full"),
}
DEFAULT_ROWS = [n for n in ROWS if not n.startswith(("full ckpt", "qlora"))]
# A scaled-down Qwen3-30B-A3B (48 layers, hidden 2048, 128 experts, top-8, moe_intermediate 768,
# vocab 151,936): experts are ~97% of the block weights and ~80% of the saved activations as in
# the real model, the vocabulary small enough not to dominate. Keys a family's config lacks are
# skipped; mixtral and gpt_oss name their experts num_local_experts and their width intermediate_size.
MOE_CONFIG = {"hidden_size": 512, "num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 64,
              "num_experts": 64, "num_local_experts": 64, "num_experts_per_tok": 8, "experts_per_token": 8,
              "moe_intermediate_size": 384, "num_hidden_layers": 4, "vocab_size": 8192, "decoder_sparse_step": 1,
              "mlp_only_layers": []}
MOE_INTERMEDIATE = {"mixtral": 384, "gpt_oss": 384}
"""Families whose expert width is `intermediate_size` (they have no moe_intermediate_size)."""
MOE_SHAPE = ["--family", "qwen3_moe", "--seq-len", "1024", "--rows", "lora chunked,qlora chunked"]
# The optimizer step in backward can only save gradient bytes where the optimizer phase is the
# step's peak: many equal-sized tensors, and activations small next to the gradients.
OPTIM_IN_BWD_SHAPE = ["--vocab", "4096", "--hidden", "512", "--intermediate", "1376", "--layers", "32",
                      "--seq-len", "128", "--rows", "full ckpt,full ckpt+optim_in_bwd"]


def _recipe(model_dir: Path, *, method: str, train: dict, args):
    from homelab_ft.recipe.config import recipe_from_dict

    return recipe_from_dict({
        "method": method,
        "model": {"path": str(model_dir)},
        "lora": {"r": 16, "dropout": 0.0},
        "data": {"max_length": args.seq_len},
        "train": {"device": args.device, "micro_batch_size": args.batch, "lr": 1e-4, "max_grad_norm": 1.0, **train},
    })


def _status_bytes(key: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(key)


class PeakMeter:
    """The peak bytes a block of code adds on top of what is allocated when it starts."""

    def __init__(self, device):
        self.device = device

    def __enter__(self):
        import torch

        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.synchronize()
            self.start = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
        else:
            Path("/proc/self/clear_refs").write_text("5")
            self.start, self.anon = _status_bytes("VmRSS"), _status_bytes("RssAnon")
        return self

    def __exit__(self, *exc):
        import torch

        if self.device.type == "cuda":
            torch.cuda.synchronize()
            self.peak = torch.cuda.max_memory_allocated() - self.start
        else:
            self.peak = _status_bytes("VmHWM") - self.start


def measure_row(name: str, model_dir: Path, args) -> dict:
    """Runs in its own process: the peak bytes of one step (or of the loss alone), and for a step
    the resident bytes before it above the process with its libraries imported: `weights` after the
    build (base, adapters), `state` after the warm-up step (optimizer state added). Those count
    anonymous memory only (RssAnon): from_pretrained keeps the safetensors file mapped after it has
    copied the weights out, and its clean page-cache pages (RssFile, the file's size) are the
    kernel's to drop, not the model's; the parameters it did not copy (the file's dtype already:
    embeddings, head) are views into that mapping and are added (_file_backed_bytes)."""
    import torch

    from homelab_ft.distributed import comm
    from homelab_ft.rules.loss_chunks import chunk_rows
    from homelab_ft.rung import rung_for
    from homelab_ft.train import loss, optim, steps
    from homelab_ft.train.build import build_model
    from homelab_ft.train.trainer import train_step

    kind, train, method = ROWS[name]
    recipe = _recipe(model_dir, method=method, train=train, args=args)
    env = comm.setup(device_pref=args.device)
    _import_libraries(model_dir, quantized=method == "qlora")
    gc.collect()
    baseline = _status_bytes("RssAnon")
    torch.manual_seed(0)
    model = build_model(recipe, model_dir=model_dir, rung=rung_for(recipe),
                        env=env)
    gc.collect()
    weights = _status_bytes("RssAnon") - baseline + _file_backed_bytes(model)
    ids = torch.randint(0, args.vocab, (args.batch, args.seq_len), generator=torch.Generator().manual_seed(0))
    batch = {"input_ids": ids, "labels": ids.clone()}
    if kind == "loss":
        head = loss.causal_lm(model).get_output_embeddings()
        head.requires_grad_(False)
        hidden = torch.randn(args.batch, args.seq_len, args.hidden, device=env.device, requires_grad=True)
        labels = batch["labels"].to(env.device)
        chunk = chunk_rows(recipe.train.loss_chunk_tokens, vocab_size=head.out_features)

        def loss_step():
            if chunk:
                summed = loss.chunked_loss_sum(hidden, labels, head=head, chunk_tokens=chunk)
            else:
                summed = steps.next_token_loss_sum(head(hidden), labels)
            summed.backward()
            hidden.grad = None

        loss_step()  # first calls allocate kernel workspaces and thread buffers, as the warm-up step below
        with PeakMeter(env.device) as meter:
            loss_step()
        return {"peak": meter.peak}
    optimizer = optim.build_optimizer(model, recipe.train)
    session = SimpleNamespace(env=env, model=model, recipe=recipe, rung=rung_for(recipe), optimizer=optimizer,
                              scheduler=optim.build_scheduler(optimizer, recipe.train))
    train_step(session, [batch])  # creates the optimizer state
    with PeakMeter(env.device) as meter:
        train_step(session, [batch])
    state = meter.anon - baseline + _file_backed_bytes(model) if env.device.type == "cpu" else None
    return {"peak": meter.peak, "weights": weights, "state": state}


def _file_backed_bytes(model) -> int:
    """Bytes of the model's tensors whose storage lies in a file mapping (/proc/self/maps): the
    zero-copy views from_pretrained leaves into the mmapped safetensors."""
    spans = []
    for line in Path("/proc/self/maps").read_text().splitlines():
        fields = line.split()
        if len(fields) >= 6 and fields[5].endswith(".safetensors"):
            start, end = (int(x, 16) for x in fields[0].split("-"))
            spans.append((start, end))
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
                for t in (*model.parameters(), *model.buffers())}
    return sum(n for ptr, n in storages.items() if any(a <= ptr < b for a, b in spans))


def _import_libraries(model_dir: Path, *, quantized: bool) -> None:
    """Import what the build imports (peft, the model's transformers module, bitsandbytes) before
    the baseline: their code and tables are the planner's CPU_PROCESS_BYTES, not the model's."""
    import peft  # noqa: F401
    from transformers import AutoConfig
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    MODEL_FOR_CAUSAL_LM_MAPPING[type(AutoConfig.from_pretrained(model_dir))]  # its lazy module import
    if quantized:
        import bitsandbytes  # noqa: F401


def predict_row(name: str, model_dir: Path, args):
    """The planner's Memory for the row's recipe on this machine (plan/ with the derived shape)."""
    from homelab_ft.locate import read_model_config
    from homelab_ft.plan.hardware import detect, resolve_cluster
    from homelab_ft.plan.ladder import option_rung
    from homelab_ft.plan.planner import request_from_recipe
    from homelab_ft.plan.price.memory import estimate
    from homelab_ft.plan.shape.shapes import model_shape
    from homelab_ft.recipe.config import ClusterConfig

    kind, train, method = ROWS[name]
    recipe = _recipe(model_dir, method=method, train=train, args=args)
    shape = model_shape(read_model_config(str(model_dir)))
    cluster = resolve_cluster(ClusterConfig(device=args.device, vram_gib=80 if args.device == "cuda" else None),
                              detected=detect())
    request = request_from_recipe(recipe)
    rung = option_rung(method, "no_shard", False, request=request, cluster=cluster)
    return estimate(shape, rung=rung, request=request, cluster=cluster).memory


def planned_step(kind: str, m) -> int:
    """What the step adds to weights and optimizer state (or the loss alone: the `logits` item)."""
    return m.logits if kind == "loss" else m.total - m.overhead - m.weights - m.optimizer


def _num_params(args) -> int:
    heads, kv = max(args.hidden // 64, 1), max(args.hidden // 128, 1)
    head_dim = args.hidden // heads
    attention = args.hidden * head_dim * (2 * heads + 2 * kv)
    block = attention + 3 * args.hidden * args.intermediate + 2 * args.hidden
    return 2 * args.vocab * args.hidden + args.layers * block + args.hidden


def family_overrides(family: str, moe: bool) -> dict:
    """Config overrides for `family`'s tiny model: with `moe`, MOE_CONFIG's keys that its config has."""
    if not moe:
        return {}
    from families import tiny_config

    present = tiny_config(family).get_text_config().to_dict()
    out = {k: v for k, v in MOE_CONFIG.items() if k in present}
    if family in MOE_INTERMEDIATE:
        out["intermediate_size"] = MOE_INTERMEDIATE[family]
    return out


def _save_model(model_dir: Path, args) -> str:
    """The measured model, saved: the Llama of the command line, or a family's tiny model (then
    args.vocab becomes its vocabulary, which the rows' token ids are drawn from)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    if args.family:
        from families import save_tiny, tiny_config

        overrides = family_overrides(args.family, args.moe)
        save_tiny(model_dir, args.family, with_tokenizer=False, max_position_embeddings=max(512, args.seq_len),
                  **overrides)
        text = tiny_config(args.family, **overrides).get_text_config()
        args.vocab, args.hidden = text.vocab_size, text.hidden_size
        sized = ", ".join(f"{k} {v}" for k, v in overrides.items()) or "tiny sizes"
        return f"{args.family} (tests/families.py model: {sized})"
    config = LlamaConfig(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.intermediate,
                         num_hidden_layers=args.layers, num_attention_heads=max(args.hidden // 64, 1),
                         num_key_value_heads=max(args.hidden // 128, 1), max_position_embeddings=args.seq_len,
                         tie_word_embeddings=False)
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(model_dir)
    return f"Llama: vocab {args.vocab}, hidden {args.hidden}, intermediate {args.intermediate}, {args.layers} layers"


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--vocab", type=int, default=VOCAB)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--intermediate", type=int, default=512)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--rows", default=",".join(DEFAULT_ROWS), help="comma-separated row names")
    parser.add_argument("--optim-in-bwd-shape", action="store_true",
                        help="the deep narrow model with short rows where the optimizer phase is the peak: "
                             + " ".join(OPTIM_IN_BWD_SHAPE))
    parser.add_argument("--family", help="a transformers model_type: its tiny model from tests/families.py")
    parser.add_argument("--moe", action="store_true",
                        help="with --family: the scaled-down MoE sizes of MOE_CONFIG instead of tiny ones")
    parser.add_argument("--moe-shape", action="store_true", help="the scaled-down Qwen3-30B-A3B: " + " ".join(MOE_SHAPE))
    parser.add_argument("--row", help=argparse.SUPPRESS)
    parser.add_argument("--model-dir", help=argparse.SUPPRESS)
    return parser


def _child_argv(name: str, model_dir: Path, args) -> list[str]:
    return [sys.executable, __file__, "--row", name, "--model-dir", str(model_dir), "--device", args.device,
            "--vocab", str(args.vocab), "--hidden", str(args.hidden), "--intermediate", str(args.intermediate),
            "--layers", str(args.layers), "--batch", str(args.batch), "--seq-len", str(args.seq_len)]


def _print_items(m, measured: dict) -> None:
    """The planner's items next to what the child measured before the step, to locate a miss."""
    mb = 1e6
    print(f"{'':24s}planned: weights {m.weights / mb:.1f} (adapters, scratch included) optimizer {m.optimizer / mb:.1f} "
          f"gradients {m.gradients / mb:.1f} activations {m.activations / mb:.1f} logits {m.logits / mb:.1f} "
          f"step temporaries {m.step_temporary / mb:.1f}")
    print(f"{'':24s}measured: after the build {measured['weights'] / mb:.1f}, before the step (optimizer state "
          f"made) {measured['state'] / mb:.1f}, step peak {measured['peak'] / mb:.1f}")


def main() -> int:
    parser = _parser()
    args = parser.parse_args()
    if args.optim_in_bwd_shape:
        args = parser.parse_args([*sys.argv[1:], *OPTIM_IN_BWD_SHAPE])
    if args.moe_shape:
        args = parser.parse_args([*MOE_SHAPE, "--moe", *sys.argv[1:]])  # the command line's own flags win
    if args.row:  # a child: one measurement
        print(json.dumps(measure_row(args.row, Path(args.model_dir), args)))
        return 0

    names = [n.strip() for n in args.rows.split(",") if n.strip()]
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = Path(tmp) / "model"
        described = _save_model(model_dir, args)
        env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="131072", OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
        print(f"{described}; {args.batch} x {args.seq_len} tokens, {args.device}, one step after a warm-up step")
        print(f"{'row':24s} {'planned MB':>11s} {'measured MB':>12s} {'measured/planned':>17s}")
        for name in names:
            proc = subprocess.run(_child_argv(name, model_dir, args), env=env, capture_output=True, text=True, check=False)
            if proc.returncode != 0:
                print(f"{name}: failed\n{proc.stderr[-3000:]}")
                return 1
            measured = json.loads(proc.stdout.strip().splitlines()[-1])
            m = predict_row(name, model_dir, args)
            kind = ROWS[name][0]
            results[name] = (planned_step(kind, m), measured["peak"])
            print(f"{name:24s} {results[name][0] / 1e6:>11.1f} {measured['peak'] / 1e6:>12.1f} "
                  f"{measured['peak'] / results[name][0]:>17.3f}")
            if kind == "step" and measured.get("state") is not None:
                resident, planned = measured["state"] + measured["peak"], m.total - m.overhead
                results[f"{name} resident"] = (planned, resident)
                print(f"{name + ' resident':24s} {planned / 1e6:>11.1f} {resident / 1e6:>12.1f} {resident / planned:>17.3f}")
                _print_items(m, measured)
    _print_summaries(results, args)
    return 0


def _print_summaries(results: dict, args) -> None:
    if {"loss full logits", "loss chunked"} <= results.keys():
        ratio = results["loss chunked"][1] / results["loss full logits"][1]
        print(f"loss peak, chunked / full logits: {ratio:.3f} (goal <= 0.125)")
    for plain in ("full chunked", "full ckpt"):
        lean = f"{plain}+optim_in_bwd"
        if {plain, lean} <= results.keys():
            saved = results[plain][1] - results[lean][1]
            planned = results[plain][0] - results[lean][0]
            grads = 4 * _num_params(args)
            print(f"{plain}: peak saved by optimizer_in_backward {saved / 1e6:.1f} MB = {saved / grads:.2f} x the "
                  f"{grads / 1e6:.1f} MB of fp32 gradients (planned {planned / grads:.2f} x; goal >= 0.9 where the "
                  "optimizer phase is the peak)")
    off = [n for n, (p, m) in results.items() if abs(m / p - 1) > 0.10]
    print("planner within 10% on every row" if not off else f"planner off by more than 10%: {', '.join(off)}")


if __name__ == "__main__":
    raise SystemExit(main())
