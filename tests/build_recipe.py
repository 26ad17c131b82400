"""The tests' one recipe builder: a tiny CPU run of the tests' tiny models, as a dict or a YAML file.

Every section a test does not name comes from `tiny_run`'s defaults (LoRA r=4 on the tiny
Llama, 64-token rows, CPU, no TensorBoard); what a test names is merged in, section by section,
so a test says only what it is about. A key given as `None` is dropped (`lora=None` for a full
fine-tune that names no LoRA section, `train={"device": None}`).
"""

from __future__ import annotations

from pathlib import Path

import yaml


def merged(base: dict, overrides: dict) -> dict:
    """`base` with `overrides` laid over it: dict sections merged key by key, a `None` dropping its
    key, anything else replaced."""
    out = dict(base)
    for key, value in overrides.items():
        if value is None:
            out.pop(key, None)
        elif isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = merged(out[key], value)
        else:
            out[key] = value
    return out


def tiny_run(model_dir: Path, *, method: str = "lora", rows: str | Path = "train.jsonl", **sections) -> dict:
    """A recipe body for a short CPU run of `model_dir` on the rows at `rows`; `sections`
    (`train={...}`, `output={...}`, `objective="dpo"`, ...) are merged over the defaults."""
    base = {
        "method": method,
        "model": {"path": str(model_dir)},
        "lora": {"r": 4, "alpha": 8, "dropout": 0.0},
        "data": {"sources": [{"path": str(rows)}], "max_length": 64},
        "train": {"max_steps": 2, "micro_batch_size": 2, "device": "cpu"},
        "output": {"tensorboard": False},
    }
    return merged(base, sections)


def write_recipe(path: Path, body: dict | str) -> Path:
    """`body` (a dict, or YAML text as a user would write it) saved at `path`."""
    path = Path(path)
    path.write_text(body if isinstance(body, str) else yaml.safe_dump(body))
    return path


def lora_run(tmp: Path, model_dir: Path, *, system_prompt: str | None = None,
             targets: tuple[str, ...] | str = ("q_proj", "k_proj", "v_proj")) -> Path:
    """A LoRA run directory as the trainer leaves it (checkpoint.save: DCP state, adapter,
    manifest) in `tmp / "run"`, with a random (non-zero) adapter on `targets` (PEFT's module names,
    or one regex: an image-text model's language-model layers) and no training, and a recipe for
    `model_dir` (export reads both). The base is transformers' causal-LM class (an image-text class
    for Gemma 3)."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from homelab_ft.rung import Rung
    from homelab_ft.store import checkpoint
    from homelab_ft.store.layout import RunDir, RunInfo

    run = tmp / "run"
    torch.manual_seed(1)
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    lora = LoraConfig(r=4, lora_alpha=8, target_modules=targets if isinstance(targets, str) else list(targets),
                      init_lora_weights=False)
    model = get_peft_model(base, lora)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad])
    state = checkpoint.TrainerState(step=2, scheduler={}, sampler={}, model_fingerprint="lora", world_size=1)
    checkpoint.save(run, model=model, optimizer=optimizer, state=state, keep_last=2)
    RunDir(run).write_info(RunInfo(rung=Rung(method="lora", strategy="no_shard", cpu_offload=False),
                                   model_dir=str(model_dir), world_size=1, params=sum(p.numel() for p in base.parameters())))
    body = tiny_run(model_dir, lora=None, data={"max_length": None, "system_prompt": system_prompt or None},
                    train=None, output=None)
    write_recipe(run / "recipe.yaml", body)
    return run
