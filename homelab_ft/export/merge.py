"""Merge a LoRA adapter into its base one safetensors file at a time.

PEFT's `merge_and_unload` needs the whole base in memory (141 GB of host RAM for Llama-3.1-70B in
bf16), which is exactly what a homelab machine that trained it with FSDP-QLoRA does not have. The
merge is per weight: W' = W + scale x B @ A for each adapted linear layer, everything else copied.
So the base's own safetensors files are read one at a time (the original full-precision weights,
never the dequantized 4-bit ones), each adapted weight is merged in fp32 and cast once to the
export dtype, and the file is written before the next is read: peak host RAM is about one base
file (<= 5 GB as the Hub shards them) plus the adapter.

Adapters this module does not merge (DoRA's magnitude vectors, per-module ranks or alphas,
`modules_to_save`, fan-in-fan-out layers, a tied LM head with LoRA on it) are reported by
`unsupported_reason`, and export.py then takes PEFT's in-memory merge.
"""

from __future__ import annotations

import json
import logging
import math
import shutil
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

log = logging.getLogger(__name__)

PREFIX = "base_model.model."
INDEX = "model.safetensors.index.json"


def adapter_config(adapter_dir: Path) -> dict:
    return json.loads((Path(adapter_dir) / "adapter_config.json").read_text())


def unsupported_reason(adapter_dir: Path, model_dir: Path) -> str | None:
    """Why this adapter/base pair needs PEFT's in-memory merge, or None when it streams."""
    cfg = adapter_config(adapter_dir)
    if cfg.get("use_dora"):
        return "DoRA scales each merged column by its magnitude vector"
    if cfg.get("rank_pattern") or cfg.get("alpha_pattern"):
        return "per-module ranks or alphas"
    if cfg.get("modules_to_save"):
        return "modules_to_save copies"
    if cfg.get("fan_in_fan_out"):
        return "fan-in-fan-out (Conv1D) layers"
    if not base_files(model_dir):
        return "the base has no safetensors files"
    base_cfg = json.loads((Path(model_dir) / "config.json").read_text())
    adapted = adapted_modules(adapter_dir)
    if base_cfg.get("tie_word_embeddings") and any(m.endswith("lm_head") for m in adapted):
        return "LoRA on a tied LM head (merging unties it)"
    return None


def base_files(model_dir: Path) -> list[str]:
    """The base's safetensors file names, in index order (or the single model.safetensors)."""
    model_dir = Path(model_dir)
    if (model_dir / INDEX).is_file():
        weight_map = json.loads((model_dir / INDEX).read_text())["weight_map"]
        return sorted(set(weight_map.values()))
    return ["model.safetensors"] if (model_dir / "model.safetensors").is_file() else []


def adapted_modules(adapter_dir: Path) -> set[str]:
    with safe_open(str(Path(adapter_dir) / "adapter_model.safetensors"), "pt") as fh:
        return {_module(k) for k in fh.keys() if ".lora_A." in k}


def _module(key: str) -> str:
    name = key[len(PREFIX):] if key.startswith(PREFIX) else key
    return name.split(".lora_")[0]


def scale(cfg: dict) -> float:
    """PEFT's scaling: alpha / r, or alpha / sqrt(r) with rsLoRA."""
    r = cfg["r"]
    return cfg["lora_alpha"] / (math.sqrt(r) if cfg.get("use_rslora") else r)


def merge_files(adapter_dir: Path, model_dir: Path, out: Path, *, dtype: torch.dtype) -> dict:
    """Write the merged model's safetensors (same file layout as the base) and config into `out`.

    Returns {"files": n, "merged": n_weights, "max_delta": largest |scale x B @ A| entry}; the
    caller checks the result against base + adapter."""
    adapter_dir, model_dir, out = Path(adapter_dir), Path(model_dir), Path(out)
    cfg = adapter_config(adapter_dir)
    factor = scale(cfg)
    weights = load_file(str(adapter_dir / "adapter_model.safetensors"))  # adapters are small
    lora = {}
    for key, tensor in weights.items():
        part = "A" if ".lora_A." in key else "B" if ".lora_B." in key else None
        if part:
            lora.setdefault(_module(key), {})[part] = tensor
    out.mkdir(parents=True, exist_ok=True)
    files = base_files(model_dir)
    merged, max_delta, weight_map, total = 0, 0.0, {}, 0
    for name in files:
        tensors = {}
        with safe_open(str(model_dir / name), "pt") as fh:
            for key in fh.keys():
                tensor = fh.get_tensor(key)
                module = key[: -len(".weight")] if key.endswith(".weight") else None
                if module in lora:
                    delta = factor * (lora[module]["B"].float() @ lora[module]["A"].float())
                    tensor = tensor.float() + delta
                    merged += 1
                    max_delta = max(max_delta, float(delta.abs().max()))
                if tensor.is_floating_point():
                    tensor = tensor.to(dtype)
                tensors[key] = tensor.contiguous()
                weight_map[key] = name
                total += tensor.numel() * tensor.element_size()
        save_file(tensors, str(out / name), metadata={"format": "pt"})
        del tensors  # one base file in memory at a time
        log.debug("merged %s", name)
    missing = set(lora) - {k[: -len(".weight")] for k in weight_map if k.endswith(".weight")}
    if missing:
        raise RuntimeError(f"export: the base has no weight for adapted modules {sorted(missing)[:3]}")
    if len(files) > 1 or (model_dir / INDEX).is_file():
        (out / INDEX).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
    config = json.loads((model_dir / "config.json").read_text())
    config["dtype"] = str(dtype).removeprefix("torch.")
    config.pop("torch_dtype", None)
    config.pop("quantization_config", None)
    config["use_cache"] = True
    (out / "config.json").write_text(json.dumps(config, indent=2))
    if (model_dir / "generation_config.json").is_file():
        shutil.copyfile(model_dir / "generation_config.json", out / "generation_config.json")
    return {"files": len(files), "merged": merged, "max_delta": max_delta}


def check_written(adapter_dir: Path, model_dir: Path, out: Path, *, dtype: torch.dtype, samples: int = 4) -> float:
    """For a model too big to load twice: read back a few merged weights (first, last and between)
    from the written files and compare them with base + scale x B @ A recomputed here; returns
    the largest difference (0.0 unless the files are wrong)."""
    adapter_dir, model_dir, out = Path(adapter_dir), Path(model_dir), Path(out)
    factor = scale(adapter_config(adapter_dir))
    weights = load_file(str(adapter_dir / "adapter_model.safetensors"))
    modules = sorted(adapted_modules(adapter_dir))
    picks = sorted({modules[round(i * (len(modules) - 1) / max(samples - 1, 1))] for i in range(samples)}) if modules else []
    where = _locations(model_dir)
    worst = 0.0
    for module in picks:
        key = f"{module}.weight"
        a = next(v for k, v in weights.items() if _module(k) == module and ".lora_A." in k)
        b = next(v for k, v in weights.items() if _module(k) == module and ".lora_B." in k)
        with safe_open(str(model_dir / where[key]), "pt") as fh:
            expected = (fh.get_tensor(key).float() + factor * (b.float() @ a.float())).to(dtype)
        with safe_open(str(out / where[key]), "pt") as fh:
            got = fh.get_tensor(key)
        worst = max(worst, float((got.float() - expected.float()).abs().max()))
    return worst


def _locations(model_dir: Path) -> dict[str, str]:
    model_dir = Path(model_dir)
    if (model_dir / INDEX).is_file():
        return json.loads((model_dir / INDEX).read_text())["weight_map"]
    with safe_open(str(model_dir / "model.safetensors"), "pt") as fh:
        return dict.fromkeys(fh.keys(), "model.safetensors")


def base_bytes(model_dir: Path) -> int:
    return sum((Path(model_dir) / name).stat().st_size for name in base_files(model_dir))
