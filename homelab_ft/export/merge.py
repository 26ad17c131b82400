"""Merge a LoRA adapter into its base one safetensors file at a time.

PEFT's `merge_and_unload` needs the whole base in memory (141 GB of host RAM for Llama-3.1-70B in
bf16), which is exactly what a homelab machine that trained it with FSDP-QLoRA does not have. The
merge is per weight: W' = W + scale x B @ A for each adapted linear layer, everything else copied.
So the base's own safetensors files are read one at a time (the original full-precision weights,
never the dequantized 4-bit ones), each adapted weight is merged in fp32 and cast once to the
export dtype, and the file is written before the next is read: peak host RAM is about one base
file (<= 5 GB as the Hub shards them) plus the adapter.

The base's files are written back in their own layout (a released MoE's per-expert tensors,
Nemotron-H's `backbone.*`, a Qwen 3.5 image-text checkpoint's `model.language_model.*` and vision
tower), which is what `save_pretrained` writes for a model loaded from them and what llama.cpp's
converters read. Which checkpoint key holds an adapted module's weight is asked of transformers'
own key conversion (model/checkpoint_keys.py), never guessed from the module's name. The adapters on
MoE experts merge there too, and routers trained with `lora.train_router` are written in place of the
base's tensors (expert_adapters.py).

Adapters this module does not merge (DoRA's magnitude vectors, per-module ranks or alphas,
`modules_to_save`, fan-in-fan-out layers, a tied LM head with LoRA on it, LoRA on parameters or on
a weight transformers converts on load, such as stacked experts) are reported by
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

from homelab_ft import fsio
from homelab_ft.errors import UserError
from homelab_ft.export import expert_adapters
from homelab_ft.model import checkpoint_keys

log = logging.getLogger(__name__)

PREFIX = "base_model.model."
INDEX = "model.safetensors.index.json"


def adapter_config(adapter_dir: Path) -> dict:
    return json.loads((Path(adapter_dir) / "adapter_config.json").read_text())


def unsupported_reason(adapter_dir: Path, model_dir: Path, *, trust_remote_code: bool = False,
                       images: bool = False) -> str | None:
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
    if cfg.get("target_parameters"):
        return "LoRA on parameters (target_parameters), not on linear layers"
    if not base_files(model_dir):
        return "the base has no safetensors files"
    keys = base_keys(model_dir, trust_remote_code=trust_remote_code, images=images)
    adapted = {f"{m}.weight" for m in adapted_modules(adapter_dir)}
    if adapted & set(keys.model.get_expanded_tied_weights_keys(all_submodels=True)):
        return "LoRA on a tied LM head (merging unties it)"
    converted = sorted(n for n in adapted & keys.names() if keys.converted(n))
    if converted:
        return f"LoRA on {converted[0]}, which transformers converts on load (from {keys.sources(converted[0])[0]}, ...)"
    return None


def base_keys(model_dir: Path, *, trust_remote_code: bool = False, images: bool = False) -> checkpoint_keys.CheckpointKeys:
    """The base checkpoint's keys as transformers maps them onto the model the run built (the causal
    LM its config builds, the image-text model for an image run: the adapter's names are that model's)."""
    meta = checkpoint_keys.meta_model(model_dir, trust_remote_code=trust_remote_code, images=images)
    return checkpoint_keys.CheckpointKeys(meta,
                                          model_dir)


def adapted_keys(adapter_dir: Path, keys: checkpoint_keys.CheckpointKeys) -> dict[str, str]:
    """Base checkpoint key -> the adapted module whose weight it holds (a one-to-one tensor, as
    `unsupported_reason` ensures; renamed or not)."""
    out = {}
    for module in sorted(adapted_modules(adapter_dir)):
        name = f"{module}.weight"
        if name not in keys.names():
            raise UserError(f"export: the base {keys.model_dir} has no weight for the adapted module {module}; "
                            "export against the model the adapter was trained on")
        out[keys.sources(name)[0]] = module
    return out


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


def merge_files(adapter_dir: Path, model_dir: Path, out: Path, *, dtype: torch.dtype,
                trust_remote_code: bool = False, images: bool = False) -> dict:
    """Write the merged model's safetensors (same file layout as the base) and config into `out`;
    the adapters on MoE experts merge too (expert_adapters.py).

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
    keys = base_keys(model_dir, trust_remote_code=trust_remote_code, images=images)
    owner = adapted_keys(adapter_dir, keys)
    experts = expert_adapters.MergedUnits(adapter_dir, keys, factor=factor)
    routers = expert_adapters.router_keys(adapter_dir, keys)  # lora.train_router: written in place of the base's
    expected = len(owner) + len(experts.owner) + len(routers)
    out.mkdir(parents=True, exist_ok=True)
    files = base_files(model_dir)
    merged, max_delta, weight_map, total = 0, 0.0, {}, 0
    for name in files:
        tensors = {}
        with safe_open(str(model_dir / name), "pt") as fh:
            for key in fh.keys():
                replaced = key in experts or key in routers
                tensor = experts.pop(key) if key in experts else routers.pop(key) if key in routers else fh.get_tensor(key)
                module = owner.get(key)
                if replaced:
                    merged += 1
                elif module is not None:
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
        fsio.as_folder_files(out / name)
        del tensors  # one base file in memory at a time
        log.debug("merged %s", name)
    if merged != expected:
        raise RuntimeError(f"export: merged {merged} of the {expected} adapted weights; the base's files and index disagree")
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


def check_written(adapter_dir: Path, model_dir: Path, out: Path, *, dtype: torch.dtype, samples: int = 4,
                  trust_remote_code: bool = False, images: bool = False) -> float:
    """For a model too big to load twice: read back a few merged weights (first, last and between)
    from the written files and compare them with base + scale x B @ A recomputed here; returns
    the largest difference (0.0 unless the files are wrong)."""
    adapter_dir, model_dir, out = Path(adapter_dir), Path(model_dir), Path(out)
    factor = scale(adapter_config(adapter_dir))
    weights = load_file(str(adapter_dir / "adapter_model.safetensors"))
    keys = base_keys(model_dir, trust_remote_code=trust_remote_code, images=images)
    owner = sorted(adapted_keys(adapter_dir, keys).items(), key=lambda item: item[1])
    picks = sorted({owner[round(i * (len(owner) - 1) / max(samples - 1, 1))] for i in range(samples)}) if owner else []
    worst = 0.0
    for key, module in picks:
        a = next(v for k, v in weights.items() if _module(k) == module and ".lora_A." in k)
        b = next(v for k, v in weights.items() if _module(k) == module and ".lora_B." in k)
        with safe_open(str(keys.files[key]), "pt") as fh:
            expected = (fh.get_tensor(key).float() + factor * (b.float() @ a.float())).to(dtype)
        with safe_open(str(out / keys.files[key].name), "pt") as fh:
            got = fh.get_tensor(key)
        worst = max(worst, float((got.float() - expected.float()).abs().max()))
    return worst


def base_bytes(model_dir: Path) -> int:
    return sum((Path(model_dir) / name).stat().st_size for name in base_files(model_dir))
