"""A PEFT LoRA adapter -> llama.cpp's LoRA-adapter GGUF, for `llama-cli -m BASE.gguf --lora adapter.gguf`.

The layout is that of llama.cpp's `convert_lora_to_gguf.py`: `general.type = adapter`,
`adapter.type = lora`, `adapter.lora.alpha`, and for every adapted weight `blk.N.attn_q.weight`
two tensors, `blk.N.attn_q.weight.lora_a` (PEFT's lora_A, r x in) and `.lora_b` (lora_B, out x r).
llama.cpp adds `alpha / r * B @ A` to the base weight, so B's rows are permuted like the base's
q/k rows (A's columns are the input features, which the permutation does not touch).

A weight llama.cpp holds in another layout (gguf_reshape.py) takes its pair along where the rule
moves whole rows (B's rows: Qwen 3.5's value heads, Granite 4 hybrid's fused gate/up halves) or
whole columns (A's: Qwen 3.5's out_proj), and is checked the same way against PEFT's delta.

What llama.cpp's adapter format cannot hold is refused: DoRA (a per-column magnitude, not a
low-rank sum), per-module ranks or alphas, fully trained extra modules (`modules_to_save`), and
LoRA on a weight whose rule mixes rows and columns (MLA's kv_b_proj, which DeepseekV2Model splits
into a transposed k_b and v_b: the adapter GGUF would name a tensor the base GGUF does not have), and
LoRA on a weight llama.cpp's graph multiplies without adapters (gguf_layouts.Layout.lora_ignored: Gemma
4's per-layer model projection, DeepSeek-V3's query and compressed-KV projections).
rsLoRA's scale alpha / sqrt(r) is written as alpha' = alpha * sqrt(r), so alpha' / r equals it.

For an image-text base the adapter is its language model's, named as that model's text GGUF
(text_view.language_model: Qwen2-VL's under `qwen2vl`): llama.cpp applies a LoRA GGUF to the text
GGUF of its own architecture (llama_adapter_lora_init refuses "model arch and LoRA arch mismatch"),
while the mmproj takes none, so LoRA on the vision tower or projector is refused, and so is a
family whose language model llama.cpp's converter writes under another architecture than homelab-ft
(CONVERTER_ARCH), since the base GGUF RUNNING.md has the user convert would not take it.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np

from homelab_ft.errors import UserError
from homelab_ft.export.gguf.arch import permute_heads
from homelab_ft.export.gguf.text_view import image_text_config, language_model
from homelab_ft.locate import gguf_reader

_PREFIX = "base_model.model."
CONVERTER_ARCH = {"Mistral3ForConditionalGeneration": "mistral3"}
"""Image-text classes whose language model llama.cpp's converter writes under another architecture
than homelab-ft's text GGUF (conversion/mistral3.py: Mistral3Model's `mistral3`, where homelab-ft
writes Mistral Small 3.1's Mistral decoder as `llama`, as any Mistral): an adapter of either name
loads onto one of the two base GGUFs only."""


def write_adapter_gguf(adapter_dir: Path, base_dir: Path, out_path: Path, *, name: str) -> None:
    import gguf
    import torch
    from safetensors import safe_open

    adapter_dir, base_dir = Path(adapter_dir), Path(base_dir)
    _check_base(base_dir)
    target, config, names = _language_model(base_dir)
    alpha = adapter_alpha(adapter_dir)
    name_map = gguf.get_tensor_name_map(target.arch, config.num_hidden_layers)
    adapted: dict[str, dict[str, np.ndarray]] = {}
    with safe_open(str(adapter_dir / "adapter_model.safetensors"), framework="pt") as f:
        for key in f.keys():
            module, part = _split(key, adapter_dir)
            adapted.setdefault(module, {})[part] = f.get_tensor(key).to(torch.float32).numpy()
    pairs: dict[str, dict[str, np.ndarray]] = {}
    for module, ab in adapted.items():
        for gguf_name, a, b in _llama_cpp_pairs(module, _text_name(module, names, adapter_dir), ab["lora_a"], ab["lora_b"],
                                                target=target, config=config, name_map=name_map, where=adapter_dir):
            pairs[gguf_name] = {"lora_a": a, "lora_b": b}

    writer = gguf.GGUFWriter(out_path, target.arch_name)
    try:
        writer.add_type(gguf.GGUFType.ADAPTER)
        writer.add_name(name)
        writer.add_string(gguf.Keys.Adapter.TYPE, "lora")
        writer.add_float32(gguf.Keys.Adapter.LORA_ALPHA, alpha)
        for gguf_name in sorted(pairs):
            for part in ("lora_a", "lora_b"):
                writer.add_tensor(f"{gguf_name}.{part}", np.ascontiguousarray(pairs[gguf_name][part]))
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
    finally:
        writer.close()


def _llama_cpp_pairs(module: str, key: str, a: np.ndarray, b: np.ndarray, *, target, config, name_map, where: Path):
    """(GGUF name, A, B) of each base tensor llama.cpp holds for the weight `module` adapts (`key`:
    its name in the causal LM the text GGUF is written from): the
    weight itself, or the parts its reshaping rule (gguf_reshape.py) cuts it into, where the rule
    moves whole rows (B's rows go with them: Qwen 3.5's value heads, Granite's gate/up halves) or
    whole columns (A's: Qwen 3.5's out_proj); B's q/k rows permuted as the base's. A rule that
    mixes rows and columns (MLA's kv_b, transposed experts) cannot hold B @ A as one LoRA pair."""
    import gguf

    rule = target.reshaped(key)
    names = rule.names(key, config) if rule else [key]
    if rule is None:
        parts = [(a, b)]
    elif rule.lora == "rows":
        parts = [(a, part) for part in rule.split(b, config)]
    elif rule.lora == "columns":
        parts = [(part, b) for part in rule.split(a, config)]
    else:
        raise UserError(f"{where}: LoRA on {module} cannot be written as a llama.cpp LoRA GGUF: llama.cpp holds that "
                        f"weight as {', '.join(rule.parts)} in another layout; export the merged model (gguf of the "
                        "merged weights) instead")
    out = []
    for name, (part_a, part_b) in zip(names, parts, strict=True):
        mapped = name_map.get_type_and_name(name, try_suffixes=(".weight",))
        if mapped is None or mapped[0] not in gguf.MODEL_TENSORS[target.arch]:
            raise UserError(f"{where}: LoRA on {module} has no place in llama.cpp's {target.arch_name} layout")
        if mapped[0].name in target.layout.lora_ignored:
            raise UserError(f"{where}: LoRA on {module} cannot be written as a llama.cpp LoRA GGUF: llama.cpp's "
                            f"{target.arch_name} graph multiplies {mapped[1]} without its adapters, so it would run "
                            "without this one; export the merged model, or leave the layer out of lora.target_modules")
        out.append((mapped[1], np.ascontiguousarray(part_a), np.ascontiguousarray(_permuted(mapped[1], part_b, target, config))))
    return out


def _language_model(base_dir: Path):
    """text_view.language_model, with a text model's tensor names mapped to its checkpoint's where
    transformers renames them on load (Nemotron-H's `backbone.layers.*` are `model.layers.*` in the
    model PEFT wraps, as in the adapter's keys; the GGUF is written from the checkpoint's names)."""
    target, config, names = language_model(base_dir)
    if names is not None:
        return target, config, names
    from homelab_ft.model.checkpoint_keys import CheckpointKeys, meta_model

    keys = CheckpointKeys(meta_model(base_dir), base_dir)
    renamed = {name: keys.sources(name)[0] for name in keys.names() if not keys.converted(name)}
    return target, config, None if all(name == key for name, key in renamed.items()) else renamed


def _check_base(base_dir: Path) -> None:
    config = image_text_config(base_dir)
    if config is None:
        return
    from transformers import AutoModelForImageTextToText

    name = AutoModelForImageTextToText._model_mapping[type(config)].__name__
    if name in CONVERTER_ARCH:
        raise UserError(f"{base_dir}: llama.cpp's converter writes the language model of {name} as "
                        f"{CONVERTER_ARCH[name]!r}, homelab-ft as a Mistral decoder ('llama'), and llama.cpp loads a "
                        "LoRA GGUF only onto a base of its own architecture; export the merged model (GGUF + mmproj)")


def _text_name(module: str, names: dict[str, str] | None, adapter_dir: Path) -> str:
    """The adapted weight's name in the causal LM the text GGUF is written from (`names`:
    text_view.text_names of an image-text base, or a renamed checkpoint's names (_language_model);
    None for a text model whose names are those)."""
    if names is None:
        return module + ".weight"
    if module + ".weight" not in names:
        raise UserError(f"{adapter_dir}: LoRA on {module}, outside the language model, cannot be written as a llama.cpp "
                        "LoRA GGUF (llama.cpp applies one to the text GGUF, none to the mmproj); export the merged model")
    return names[module + ".weight"]


def _permuted(gguf_name: str, array: np.ndarray, target, config) -> np.ndarray:
    """llama.cpp's q/k rows (gguf_arch.permute_heads) where the base's are permuted."""
    if not (target.layout.permute_qk and gguf_name.endswith(("attn_q.weight", "attn_k.weight"))):
        return array
    heads = config.num_attention_heads if gguf_name.endswith("attn_q.weight") else config.num_key_value_heads
    return permute_heads(array, heads)


def adapter_alpha(adapter_dir: Path) -> float:
    """The alpha llama.cpp scales by (alpha / r), refusing what its format cannot express."""
    config = json.loads((Path(adapter_dir) / "adapter_config.json").read_text())
    where = f"{adapter_dir}/adapter_config.json"
    if config.get("peft_type", "LORA") != "LORA":
        raise UserError(f"{where}: a {config.get('peft_type')} adapter cannot be written as a llama.cpp LoRA GGUF")
    if config.get("use_dora"):
        raise UserError(f"{where}: DoRA adapters cannot be written as a llama.cpp LoRA GGUF; export the merged model instead")
    if config.get("rank_pattern") or config.get("alpha_pattern"):
        raise UserError(f"{where}: per-module ranks or alphas cannot be written as a llama.cpp LoRA GGUF; export the merged model")
    if config.get("modules_to_save"):
        raise UserError(f"{where}: fully trained modules ({', '.join(config['modules_to_save'])}) cannot be written as a "
                        "llama.cpp LoRA GGUF; export the merged model instead")
    rank, alpha = config["r"], float(config["lora_alpha"])
    return alpha * math.sqrt(rank) if config.get("use_rslora") else alpha


def _split(key: str, adapter_dir: Path) -> tuple[str, str]:
    """`base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight` -> (`model.layers.0.self_attn.q_proj`, `lora_a`)."""
    body = key.removeprefix(_PREFIX)
    for part in ("lora_A", "lora_B"):
        marker = f".{part}.weight"
        if body.endswith(marker):
            return body.removesuffix(marker), part.lower()
    raise UserError(f"{adapter_dir}: adapter tensor {key} is not a LoRA A/B matrix; only plain LoRA can be written as GGUF")


def check_adapter_gguf(path: Path, peft_model, base_dir: Path) -> float:
    """Largest |alpha / r * B @ A - PEFT's delta| over the adapted weights, read back from the file.

    PEFT's `get_delta_weight` is the reference (it applies its own scaling, rsLoRA included); the
    delta is compared in llama.cpp's layout: cut by the weight's reshaping rule where it has one,
    q/k rows permuted. Raises RuntimeError above 1e-5 per unit of the delta's magnitude, or when
    the file's architecture is not the base's text GGUF's.
    """
    import gguf
    import torch

    reader = gguf_reader(path)
    alpha = float(reader.fields[gguf.Keys.Adapter.LORA_ALPHA].contents())
    stored = {t.name: np.array(t.data, dtype=np.float32).reshape([int(d) for d in reversed(t.shape)]) for t in reader.tensors}
    target, config, names = _language_model(base_dir)
    if str(reader.fields["general.architecture"].contents()) != target.arch_name:
        raise RuntimeError(f"adapter GGUF check failed: its architecture is not {target.arch_name!r}, the base's")
    name_map = gguf.get_tensor_name_map(target.arch, config.num_hidden_layers)
    worst, checked = 0.0, 0
    for module_name, module in peft_model.named_modules():
        if not hasattr(module, "get_delta_weight") or "default" not in getattr(module, "lora_A", {}):
            continue
        key = _text_name(module_name.removeprefix(_PREFIX), names, path)
        with torch.no_grad():
            delta = module.get_delta_weight("default").float().numpy()
        rule = target.reshaped(key)
        wants = rule.split(delta, config) if rule else [delta]
        for name, want in zip(rule.names(key, config) if rule else [key], wants, strict=True):
            gguf_name = name_map.get_type_and_name(name, try_suffixes=(".weight",))[1]
            want = _permuted(gguf_name, want, target, config)
            a, b = stored.pop(f"{gguf_name}.lora_a"), stored.pop(f"{gguf_name}.lora_b")
            got = alpha / a.shape[0] * (b @ a)
            diff = float(np.abs(got - want).max()) / max(1e-12, float(np.abs(want).max()))
            if not diff <= 1e-5:
                raise RuntimeError(f"adapter GGUF check failed: {gguf_name} differs from PEFT's delta by {diff:.2e} (relative)")
            worst, checked = max(worst, diff), checked + 1
    if stored or not checked:
        raise RuntimeError(f"adapter GGUF check failed: tensors without a LoRA module: {sorted(stored)[:3]}")
    return worst
