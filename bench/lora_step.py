"""LoRA step throughput: our loop vs a plain PyTorch loop vs transformers.Trainer, in one process.

The same model (a random ~20M-parameter Llama saved and reloaded with from_pretrained), the same
LoRA config, the same fixed-length rows (every batch holds the same number of tokens, so order
does not matter), the same optimizer and schedule. Each contender runs WARMUP + STEPS steps; the
median tokens/s over the measured steps is reported, each step timed from the end of the step
before to its own end (data fetching, the step, logging: everything a loop does per step). The contenders run in rounds (a, b, c, a,
b, c) and each keeps its best round, so a slow moment of the machine does not decide the result.

    python bench/lora_step.py            # OMP_NUM_THREADS sets the threads of all three
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

from tiny import make_llama  # noqa: E402

from homelab_ft.data import collate, prepare_data  # noqa: E402
from homelab_ft.model.loading import attach_lora, load_model, load_tokenizer  # noqa: E402
from homelab_ft.recipe.config import load_recipe  # noqa: E402

SEQ = 256
MICRO_BATCH = 4
WARMUP = 3
STEPS = 12
ROUNDS = 3
LORA = {"r": 16, "alpha": 32, "dropout": 0.0, "target_modules": "all-linear"}


def setup(tmp: Path) -> tuple[Path, Path]:
    model_dir = make_llama(
        tmp / "model", hidden_size=384, intermediate_size=1024, num_hidden_layers=8,
        num_attention_heads=6, num_key_value_heads=2,
    )
    words = "the quick brown fox jumps over the lazy dog answer yes no paris capital".split()
    with (tmp / "text.jsonl").open("w") as fh:
        for i in range(256):
            fh.write(json.dumps({"text": " ".join(words[(i + j) % len(words)] for j in range(400))}) + "\n")
    recipe = {
        "method": "lora",
        "model": {"path": str(model_dir), "dtype": "float32"},
        "lora": LORA,
        "data": {"sources": [{"path": str(tmp / "text.jsonl"), "format": "text"}], "max_length": SEQ},
        "train": {"max_steps": WARMUP + STEPS, "micro_batch_size": MICRO_BATCH, "lr": 1e-4, "device": "cpu",
                  "warmup_steps": 0, "log_every": 1},
        "output": {"tensorboard": False},
    }
    path = tmp / "bench.yaml"
    path.write_text(yaml.safe_dump(recipe))
    return model_dir, path


def ours(recipe_path: Path, run_dir: Path) -> float:
    from homelab_ft.plan.planner import plan_for_recipe
    from homelab_ft.rung import rung_for
    from homelab_ft.train import trainer
    from homelab_ft.train.metrics import read_metrics

    recipe = load_recipe(recipe_path, [f"output.dir={run_dir}", "output.overwrite=true"])
    trainer.train(recipe, plan=plan_for_recipe(recipe).to_dict(), rung=rung_for(recipe))
    rows = [r for r in read_metrics(run_dir / "metrics.jsonl") if "tokens_per_s" in r]
    # step end to step end (`time_s`), so logging and data fetching count, as for the others
    return statistics.median(
        cur["tokens"] / (cur["time_s"] - prev["time_s"]) for prev, cur in zip(rows[WARMUP - 1 :], rows[WARMUP:], strict=False)
    )


def _model_and_batches(recipe_path: Path):
    recipe = load_recipe(recipe_path)
    tokenizer = load_tokenizer(recipe.model, Path(recipe.model.path))
    data = prepare_data(recipe.data, tokenizer, seed=0)
    torch.manual_seed(0)
    model = attach_lora(load_model(recipe.model, Path(recipe.model.path), dtype=torch.float32, device=torch.device("cpu")), recipe.lora)
    model.config.use_cache = False
    rows = [data.train[i] for i in range(len(data.train))]
    return model, rows, tokenizer.pad_token_id


def plain(recipe_path: Path) -> float:
    """The loop a person writes by hand: model(**batch, labels=...).loss.backward(), AdamW, clip."""
    model, rows, pad = _model_and_batches(recipe_path)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
    rates = []
    t0 = time.perf_counter()
    for step in range(WARMUP + STEPS):
        batch = collate(rows[step * MICRO_BATCH : (step + 1) * MICRO_BATCH], pad_token_id=pad)
        loss = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], labels=batch["labels"]).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        now = time.perf_counter()
        rates.append(int(batch["attention_mask"].sum()) / (now - t0))
        t0 = now
    return statistics.median(rates[WARMUP:])


def hf_trainer(recipe_path: Path, out: Path) -> float:
    from datasets import Dataset
    from transformers import Trainer, TrainerCallback, TrainingArguments

    model, rows, pad = _model_and_batches(recipe_path)
    step_times: list[float] = []

    class Clock(TrainerCallback):
        """Step end to step end: the data loader, the step and Trainer's own bookkeeping."""

        def on_train_begin(self, args, state, control, **kw):
            self.t0 = time.perf_counter()

        def on_step_end(self, args, state, control, **kw):
            now = time.perf_counter()
            step_times.append(now - self.t0)
            self.t0 = now

    args = TrainingArguments(
        output_dir=str(out), per_device_train_batch_size=MICRO_BATCH, max_steps=WARMUP + STEPS,
        learning_rate=1e-4, lr_scheduler_type="cosine", max_grad_norm=1.0, save_strategy="no",
        report_to=[], logging_steps=1000, use_cpu=True, dataloader_num_workers=0,
        remove_unused_columns=False, disable_tqdm=True,
    )
    ds = Dataset.from_list([{"input_ids": r["input_ids"], "labels": r["labels"]} for r in rows])
    trainer = Trainer(model=model, args=args, train_dataset=ds,
                      data_collator=lambda b: collate(b, pad_token_id=pad), callbacks=[Clock()])
    trainer.train()
    tokens = MICRO_BATCH * SEQ
    return statistics.median(tokens / t for t in step_times[WARMUP:])


def main() -> None:
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "2")))
    with tempfile.TemporaryDirectory() as tmp_str:
        tmp = Path(tmp_str)
        _, recipe_path = setup(tmp)
        best = {"ours": 0.0, "plain": 0.0, "trainer": 0.0}
        for r in range(ROUNDS):
            best["ours"] = max(best["ours"], ours(recipe_path, tmp / f"run{r}"))
            best["plain"] = max(best["plain"], plain(recipe_path))
            best["trainer"] = max(best["trainer"], hf_trainer(recipe_path, tmp / f"hf{r}"))
    print(f"lora_step: seq {SEQ} x micro-batch {MICRO_BATCH}, {STEPS} measured steps, threads {torch.get_num_threads()}")
    for name, value in best.items():
        print(f"  {name:8s} {value:10.1f} tokens/s")
    print(f"  ours/plain   = {best['ours'] / best['plain']:.3f}  (goal >= 0.97)")
    print(f"  ours/Trainer = {best['ours'] / best['trainer']:.3f}  (goal >= 1.0)")


if __name__ == "__main__":
    main()
