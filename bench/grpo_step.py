"""A GRPO step of homelab-ft against TRL's GRPOTrainer on the same tiny job (not a test).

    OMP_NUM_THREADS=2 .venv/bin/python bench/grpo_step.py

The same random ~20M-parameter Llama (saved, reloaded with from_pretrained), LoRA r=16 on every
linear layer, PROMPTS prompts x G generations of up to COMPLETION tokens per step, temperature 1,
beta 0, loss_type dapo, one iteration, a reward that reads the completion's token ids. homelab-ft
runs its trainer's own `grpo_step` (colocated rollouts: transformers' generate, adapters live);
TRL 1.16 runs `GRPOTrainer.train` with the same settings (its per_device_train_batch_size counts
completions: PROMPTS x G), on the CPU, generating with transformers' generate too (no vLLM).

TRL is not a dependency: it is installed for this bench only, into a temporary folder, from the
package index pip is configured with (`pip install --no-deps --target`), and put on that process's
PYTHONPATH. Each contender runs in its own process, ROUNDS times, interleaved (homelab, trl,
homelab, trl ...), each keeping its best round; figures are medians over the measured steps of the
wall time and the process's CPU time (time.process_time: getrusage's user + system) side by side,
with the completion tokens generated per step, so tokens/s per wall and per CPU second compare
work done, not steps. The rollout node (grpo.rollout: node, two processes) is not a contender here.
"""

from __future__ import annotations

import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT))

PROMPTS = 4
G = 8
COMPLETION = 32
WARMUP = 1
STEPS = 4
ROUNDS = 2
LR = 1e-4


def reward(prompts, completions, completion_ids, **columns):
    """The share of a completion's tokens below id 100 (TRL's signature; the same for both)."""
    return [sum(i < 100 for i in ids) / max(len(ids), 1) for ids in completion_ids]


def setup(tmp: Path) -> None:
    from tiny import make_llama

    make_llama(tmp / "model", hidden_size=384, intermediate_size=1024, num_hidden_layers=8,
               num_attention_heads=6, num_key_value_heads=2)
    rng = random.Random(0)
    with (tmp / "prompts.jsonl").open("w") as f:
        for i in range(PROMPTS * (WARMUP + STEPS)):
            words = " ".join(str(rng.randint(1, 999)) for _ in range(rng.randint(8, 16)))
            f.write(json.dumps({"prompt": [{"role": "user", "content": words}], "answer": str(i)}) + "\n")
    (tmp / "rewards.py").write_text("from bench_grpo import reward  # noqa: F401\n")
    (tmp / "bench_grpo.py").write_text(Path(__file__).read_text())


def run_homelab(tmp: Path) -> dict:
    import torch

    from homelab_ft.distributed import comm
    from homelab_ft.plan.planner import recipe_shape
    from homelab_ft.recipe.config import recipe_from_dict
    from homelab_ft.rung import rung_for
    from homelab_ft.train import preflight, session, trainer

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "2")))
    recipe = recipe_from_dict({
        "method": "lora", "objective": "grpo",
        "grpo": {"num_generations": G, "max_completion_length": COMPLETION, "reward_funcs": ["rewards.py:reward"],
                 "log_completions_every": 0},
        "model": {"path": str(tmp / "model"), "dtype": "float32"},
        "lora": {"r": 16, "alpha": 32, "dropout": 0.0, "target_modules": "all-linear"},
        "data": {"sources": [{"path": str(tmp / "prompts.jsonl")}], "max_length": 512, "shuffle": False,
                 "cache_dir": str(tmp / "cache")},
        "train": {"max_steps": WARMUP + STEPS, "micro_batch_size": PROMPTS, "device": "cpu", "lr": LR,
                  "lr_schedule": "constant"},
        "output": {"dir": str(tmp / "run-homelab"), "overwrite": True, "tensorboard": False},
    })
    env = comm.setup(device_pref="cpu")
    sys.path.insert(0, str(tmp))
    rung = rung_for(recipe)
    inputs = preflight.check_inputs(recipe, rung=rung, facts=recipe_shape(recipe)[0].facts, device_type="cpu")
    s = session.setup(recipe, env=env, rung=rung, plan=None, inputs=inputs, base_dir=tmp)
    walls, cpus, tokens, gens = [], [], [], []
    for step in range(1, WARMUP + STEPS + 1):
        def draw():
            return [[s.data.train[i] for i in s.sampler.next_indices()]]

        t0, c0 = time.perf_counter(), time.process_time()
        result = trainer.grpo_step(s, draw, step=step)
        walls.append(time.perf_counter() - t0)
        cpus.append(time.process_time() - c0)
        tokens.append(result.trained_tokens)
        gens.append(result.metrics["generation_s"])
    return _summary(walls, cpus, tokens, generation_s=gens)


def run_trl(tmp: Path) -> dict:
    import torch
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "2")))
    rows = [json.loads(line) for line in (tmp / "prompts.jsonl").read_text().splitlines()]
    walls, cpus, tokens = [], [], []

    class Timer(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            self.t0, self.c0 = time.perf_counter(), time.process_time()

        def on_step_end(self, args, state, control, **kwargs):
            walls.append(time.perf_counter() - self.t0)
            cpus.append(time.process_time() - self.c0)

        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs and "completions/mean_length" in logs:
                tokens.append(int(round(logs["completions/mean_length"] * PROMPTS * G)))

    args = GRPOConfig(output_dir=str(tmp / "run-trl"), per_device_train_batch_size=PROMPTS * G, num_generations=G,
                      max_completion_length=COMPLETION, max_steps=WARMUP + STEPS, learning_rate=LR,
                      lr_scheduler_type="constant", logging_steps=1, report_to="none", use_cpu=True, bf16=False,
                      save_strategy="no", temperature=1.0, beta=0.0, loss_type="dapo", seed=0, shuffle_dataset=False,
                      dataloader_num_workers=0)
    model = AutoModelForCausalLM.from_pretrained(tmp / "model", dtype=torch.float32)
    trainer = GRPOTrainer(model=model, reward_funcs=[reward], args=args, train_dataset=Dataset.from_list(rows),
                          processing_class=AutoTokenizer.from_pretrained(tmp / "model"),
                          peft_config=LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0, target_modules="all-linear"),
                          callbacks=[Timer()])
    trainer.train()
    return _summary(walls, cpus, tokens)


def _summary(walls, cpus, tokens, *, generation_s=None) -> dict:
    out = {"wall_s": statistics.median(walls[WARMUP:]), "cpu_s": statistics.median(cpus[WARMUP:]),
           "tokens": statistics.median(tokens[WARMUP:]) if len(tokens) > WARMUP else statistics.median(tokens)}
    if generation_s is not None:
        out["generation_s"] = statistics.median(generation_s[WARMUP:])
    return out


def _install_trl(folder: Path) -> None:
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(folder), "trl"],
                   check=True, capture_output=True)


def main() -> None:
    if len(sys.argv) == 3:
        which = {"homelab": run_homelab, "trl": run_trl}[sys.argv[2]]
        print(json.dumps(which(Path(sys.argv[1]))))
        return
    with tempfile.TemporaryDirectory() as tmp_str:
        tmp = Path(tmp_str)
        setup(tmp)
        _install_trl(tmp / "trl")
        best: dict[str, dict] = {}
        for _ in range(ROUNDS):
            for name in ("homelab", "trl"):
                path = os.pathsep.join([str(tmp / "trl"), str(tmp)] if name == "trl" else [str(tmp)])
                env = {**os.environ, "HF_DATASETS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", "PYTHONPATH": path}
                out = subprocess.run([sys.executable, __file__, str(tmp), name], capture_output=True, text=True,
                                     env=env)
                if out.returncode:
                    raise SystemExit(f"{name} failed:\n{out.stderr[-4000:]}")
                got = json.loads(out.stdout.strip().splitlines()[-1])
                if name not in best or got["wall_s"] < best[name]["wall_s"]:
                    best[name] = got
    ours, trl = best["homelab"], best["trl"]
    print(f"grpo_step: LoRA r16 on a 20M Llama, {PROMPTS} prompts x {G} generations of <= {COMPLETION} tokens per step, "
          f"{STEPS} measured steps, threads {os.environ.get('OMP_NUM_THREADS', '2')}")
    for name, r in best.items():
        split = (f"  (generation {r['generation_s']:.2f} s, training {r['wall_s'] - r['generation_s']:.2f} s)"
                 if "generation_s" in r else "")
        print(f"  {name:8s} {r['wall_s']:.2f} s/step  {r['cpu_s']:.2f} CPU s/step  {r['tokens']:.0f} completion tokens/step  "
              f"{r['tokens'] / r['wall_s']:.0f} tokens/s  {r['tokens'] / r['cpu_s']:.0f} tokens/CPU s{split}")
    print(f"  homelab/trl: {ours['tokens'] / ours['wall_s'] / (trl['tokens'] / trl['wall_s']):.2f}x tokens/s, "
          f"{ours['tokens'] / ours['cpu_s'] / (trl['tokens'] / trl['cpu_s']):.2f}x tokens per CPU second")


if __name__ == "__main__":
    main()
