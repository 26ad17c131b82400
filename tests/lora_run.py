"""A LoRA run directory as the trainer leaves it (checkpoint.save: DCP state, adapter, manifest,
run.json, recipe.yaml) with a random, non-zero adapter and no training: what export tests export."""

from __future__ import annotations

from pathlib import Path

import build_recipe
import torch

ATTENTION = ("q_proj", "k_proj", "v_proj")


def make_lora_run(tmp: Path, model_dir: Path, *, system_prompt: str | None = None,
                  target_modules: tuple[str, ...] | str = ATTENTION) -> Path:
    """`tmp/run` for a LoRA (r=4) on `model_dir`'s causal LM (transformers' causal-LM class, an
    image-text class for Gemma 3), adapting `target_modules` (PEFT's names or regex)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from homelab_ft.rung import Rung
    from homelab_ft.store import checkpoint
    from homelab_ft.store.layout import RunDir, RunInfo

    run = tmp / "run"
    torch.manual_seed(1)
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    targets = target_modules if isinstance(target_modules, str) else list(target_modules)
    lora = LoraConfig(r=4, lora_alpha=8, target_modules=targets, init_lora_weights=False)
    model = get_peft_model(base, lora)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad])
    state = checkpoint.TrainerState(step=2, scheduler={}, sampler={}, model_fingerprint="lora", world_size=1)
    checkpoint.save(run, model=model, optimizer=optimizer, state=state, keep_last=2)
    RunDir(run).write_info(RunInfo(rung=Rung(method="lora", strategy="no_shard", cpu_offload=False),
                                   model_dir=str(model_dir), world_size=1, params=sum(p.numel() for p in base.parameters())))
    body = build_recipe.tiny_run(model_dir, lora=None, data={"max_length": None, "system_prompt": system_prompt or None},
                                 train=None, output=None)
    build_recipe.write_recipe(run / "recipe.yaml", body)
    return run
