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
