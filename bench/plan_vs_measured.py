"""The planner's memory model against real training steps: predicted vs measured bytes per rank.

For each rung (QLoRA, LoRA, full) on a small Llama (dims multiples of 32), this builds the model
through the project's own `build_model` (train/build.py) and optimizer, trains a few steps on random tokens, and
counts what the process actually holds after a step:
- parameters: bytes of every distinct parameter storage (for 4-bit layers also the quantization
  state: absmax, the nested absmax of double quantization and its offset),
- gradients: bytes of every `.grad` after backward,
- optimizer: bytes of every tensor in the optimizer state,
- saved activations: bytes of the distinct tensors autograd saves for backward in one forward
  (through `torch.autograd.graph.saved_tensors_hooks`, parameters excluded),
and prints them beside `memory.estimate(...)` with the ratio measured / predicted. On CPU the
model-state bytes (parameters, gradients, optimizer) must agree within 2%; the activation line is
informative (the planner also counts transient peaks, such as the fp32 logits copies, that are
never saved). On CUDA it also prints `torch.cuda.max_memory_allocated` against the planner's
device total (minus its fixed CUDA overhead, which the allocator does not see).

    OMP_NUM_THREADS=1 .venv/bin/python bench/plan_vs_measured.py          # ~1 minute on one core
    .venv/bin/python bench/plan_vs_measured.py --device cuda --hidden 1024 --layers 8
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

RUNGS = ("qlora", "lora", "full")
TOLERANCE = 0.02


def measure(method: str, model_dir: Path, *, device: str, batch: int, seq_len: int, num_steps: int) -> dict:
    import torch

    from homelab_ft.distributed import comm
    from homelab_ft.recipe.config import recipe_from_dict
    from homelab_ft.rung import rung_for
    from homelab_ft.train import optim
    from homelab_ft.train.build import build_model

    torch.manual_seed(0)
    recipe = recipe_from_dict({
        "method": method,
        "model": {"path": str(model_dir)},
        "data": {"max_length": seq_len},
        # this bench runs transformers' own loss (full logits): price that, not the chunked loss
        "train": {"device": device, "micro_batch_size": batch, "lr": 1e-4, "loss_chunk_tokens": 0},
    })
    env = comm.setup(device_pref=device)
    model = build_model(recipe, model_dir=model_dir, rung=rung_for(recipe),
                        env=env)
    optimizer = optim.build_optimizer(model, recipe.train)
    vocab = model.config.vocab_size
    ids = torch.randint(0, vocab, (batch, seq_len), generator=torch.Generator().manual_seed(0)).to(env.device)
    model.train()
    if env.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    for _ in range(num_steps):
        optimizer.zero_grad(set_to_none=True)
        model(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
    measured = {
        "weights": _param_bytes(model),
        "gradients": sum(p.grad.untyped_storage().nbytes() for p in model.parameters() if p.grad is not None),
        "optimizer": sum(t.untyped_storage().nbytes() for state in optimizer.state.values()
                         for t in state.values() if torch.is_tensor(t)),
        "saved": _saved_activation_bytes(model, ids),
    }
    if env.device.type == "cuda":
        measured["cuda_peak"] = torch.cuda.max_memory_allocated()
    return {"recipe": recipe, "measured": measured}


def _param_bytes(model) -> int:
    seen, total = set(), 0
    for p in model.parameters():
        storage = p.untyped_storage()
        if storage.data_ptr() not in seen:
            seen.add(storage.data_ptr())
            total += storage.nbytes()
        state = getattr(p, "quant_state", None)
        if state is not None:
            total += state.absmax.untyped_storage().nbytes()
            if state.nested:
                total += state.state2.absmax.untyped_storage().nbytes() + state.offset.untyped_storage().nbytes()
    return total


def _saved_activation_bytes(model, ids) -> int:
    import torch

    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: dict[int, int] = {}

    def pack(t):
        ptr = t.untyped_storage().data_ptr()
        if ptr not in params and t.device.type != "meta":
            seen[ptr] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = model(input_ids=ids, labels=ids).loss
    del loss
    return sum(seen.values())


def predict(method: str, recipe, model_dir: Path, *, device: str):
    from homelab_ft.locate import read_model_config
    from homelab_ft.plan.hardware import detect, resolve_cluster
    from homelab_ft.plan.ladder import option_rung
    from homelab_ft.plan.planner import request_from_recipe
    from homelab_ft.plan.price.memory import estimate
    from homelab_ft.plan.shape.shapes import model_shape
    from homelab_ft.recipe.config import ClusterConfig

    shape = model_shape(read_model_config(str(model_dir)))
    cluster = resolve_cluster(ClusterConfig(device=device, vram_gib=80 if device == "cuda" else None), detected=detect())
    return estimate(shape, rung=option_rung(method, "no_shard", False, request=request_from_recipe(recipe), cluster=cluster), request=request_from_recipe(recipe), cluster=cluster)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--intermediate", type=int, default=512)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--steps", type=int, default=2)
    args = parser.parse_args()

    from tiny import make_llama

    failures = 0
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = make_llama(Path(tmp) / "model", hidden_size=args.hidden, intermediate_size=args.intermediate,
                               num_hidden_layers=args.layers, num_attention_heads=args.hidden // 64,
                               num_key_value_heads=max(args.hidden // 128, 1))
        print(f"tiny Llama: hidden {args.hidden}, intermediate {args.intermediate}, {args.layers} layers; "
              f"batch {args.batch} x {args.seq_len} tokens, {args.steps} steps, {args.device}, 1 rank")
        print(f"{'rung':6s} {'item':18s} {'predicted':>12s} {'measured':>12s} {'ratio':>7s}")
        for method in RUNGS:
            run = measure(method, model_dir, device=args.device, batch=args.batch, seq_len=args.seq_len,
                          num_steps=args.steps)
            est = predict(method, run["recipe"], model_dir, device=args.device)
            got = run["measured"]
            rows = [("weights", est.memory.weights, got["weights"], True),
                    ("gradients", est.memory.gradients, got["gradients"], True),
                    ("optimizer", est.memory.optimizer, got["optimizer"], True),
                    ("model state", est.memory.model_state, got["weights"] + got["gradients"] + got["optimizer"], True),
                    ("saved activations", est.memory.activations + est.memory.logits, got["saved"], False)]
            if "cuda_peak" in got:
                rows.append(("cuda peak alloc", est.memory.total - est.memory.overhead, got["cuda_peak"], False))
            for item, predicted, measured, checked in rows:
                ratio = measured / predicted if predicted else float("nan")
                bad = checked and args.device == "cpu" and abs(ratio - 1) > TOLERANCE
                failures += bad
                note = "  <-- off by more than 2%" if bad else ("" if checked else "  (informative)")
                print(f"{method:6s} {item:18s} {predicted:>12,d} {measured:>12,d} {ratio:>7.3f}{note}")
    if args.device == "cpu":
        print("model-state bytes within 2% on every rung" if not failures else f"{failures} item(s) off by more than 2%")
    return 1 if failures else 0


if __name__ == "__main__":
    raise SystemExit(main())
