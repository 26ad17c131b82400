"""The host's time per block of one `generate` decode step (not a test): what plan/price/rollout.py's
DECODE_HOST_S_PER_BLOCK and ADAPTER_HOST_FACTOR rest on for the CPU.

    OMP_NUM_THREADS=1 .venv/bin/python bench/decode_overhead.py

A Qwen3 shrunk to hidden 64 (4 heads, 2 KV heads, vocabulary 256), so a decode step's time is the
Python, dispatcher and per-op cost of eager generate, not arithmetic: 8 rows of 32-token prompts,
sampled (temperature 1), 16 and then 80 new tokens; the difference over 64 tokens is one decode
step, with 12 and with 36 blocks (the slope is the time per block), plain and with PEFT's LoRA
(r=16, dropout 0.05) on every linear. Best of ROUNDS per contender; wall and CPU seconds side by side.
"""

from __future__ import annotations

import time

ROUNDS = 3
ROWS, PROMPT = 8, 32
SHORT, LONG = 16, 80


def step_seconds(*, layers: int, lora: bool) -> tuple[float, float]:
    """(wall, CPU) seconds of one decode step."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, Qwen3Config

    config = Qwen3Config(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=4096,
                         layer_types=["full_attention"] * layers)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    if lora:
        model = get_peft_model(model, LoraConfig(r=16, target_modules="all-linear", lora_dropout=0.05))
    ids = torch.randint(0, 256, (ROWS, PROMPT))

    def run(new: int) -> tuple[float, float]:
        best = (float("inf"), float("inf"))
        for _ in range(ROUNDS):
            wall, cpu = time.perf_counter(), time.process_time()
            with torch.no_grad():
                model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=new,
                               min_new_tokens=new, do_sample=True, pad_token_id=0)
            best = min(best, (time.perf_counter() - wall, time.process_time() - cpu))
        return best

    (short_wall, short_cpu), (long_wall, long_cpu) = run(SHORT), run(LONG)
    return (long_wall - short_wall) / (LONG - SHORT), (long_cpu - short_cpu) / (LONG - SHORT)


def main() -> None:
    import torch

    torch.set_num_threads(1)
    found = {}
    for lora in (False, True):
        for layers in (12, 36):
            found[lora, layers] = step_seconds(layers=layers, lora=lora)
            wall, cpu = found[lora, layers]
            print(f"lora={str(lora).lower():5s} blocks={layers}: {wall * 1e3:6.2f} ms per decode step ({cpu * 1e3:.2f} CPU ms)")
    per_block = {lora: (found[lora, 36][0] - found[lora, 12][0]) / 24 for lora in (False, True)}
    print(f"per block: {per_block[False] * 1e3:.2f} ms plain, {per_block[True] * 1e3:.2f} ms with LoRA "
          f"(x {per_block[True] / per_block[False]:.2f})")


if __name__ == "__main__":
    main()
