"""A PEFT LoRA adapter -> llama.cpp's LoRA-adapter GGUF, for `llama-cli -m BASE.gguf --lora adapter.gguf`.

The layout is that of llama.cpp's `convert_lora_to_gguf.py`: `general.type = adapter`,
`adapter.type = lora`, `adapter.lora.alpha`, and for every adapted weight `blk.N.attn_q.weight`
two tensors, `blk.N.attn_q.weight.lora_a` (PEFT's lora_A, r x in) and `.lora_b` (lora_B, out x r).
llama.cpp adds `alpha / r * B @ A` to the base weight, so B's rows are permuted like the base's
q/k rows (A's columns are the input features, which the permutation does not touch).

What llama.cpp's adapter format cannot hold is refused: DoRA (a per-column magnitude, not a
low-rank sum), per-module ranks or alphas, and fully trained extra modules (`modules_to_save`).
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
    target, config, names = language_model(base_dir)
    alpha = adapter_alpha(adapter_dir)
    arch = target.arch
    name_map = gguf.get_tensor_name_map(arch, config.num_hidden_layers)
    pairs: dict[str, dict[str, np.ndarray]] = {}
    with safe_open(str(adapter_dir / "adapter_model.safetensors"), framework="pt") as f:
        for key in f.keys():
            module, part = _split(key, adapter_dir)
            mapped = name_map.get_type_and_name(_text_name(module, names, adapter_dir), try_suffixes=(".weight",))
            if mapped is None or mapped[0] not in gguf.MODEL_TENSORS[arch]:
                raise UserError(f"{adapter_dir}: LoRA on {module} has no place in llama.cpp's {target.arch_name} layout")
            array = f.get_tensor(key).to(torch.float32).numpy()
            gguf_name = mapped[1]
            if part == "lora_b" and target.layout.permute_qk and gguf_name.endswith(("attn_q.weight", "attn_k.weight")):
                heads = config.num_attention_heads if gguf_name.endswith("attn_q.weight") else config.num_key_value_heads
                array = permute_heads(array, heads)
            pairs.setdefault(gguf_name, {})[part] = array

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
    text_view.text_names of an image-text base; None for a text model, whose names are those)."""
    if names is None:
        return module + ".weight"
    if module + ".weight" not in names:
        raise UserError(f"{adapter_dir}: LoRA on {module}, outside the language model, cannot be written as a llama.cpp "
                        "LoRA GGUF (llama.cpp applies one to the text GGUF, none to the mmproj); export the merged model")
    return names[module + ".weight"]


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
    delta is compared in llama.cpp's layout (q/k rows permuted). Raises RuntimeError above 1e-5
    per unit of the delta's magnitude, or when the file's architecture is not the base's text GGUF's.
    """
    import gguf
    import torch

    reader = gguf.GGUFReader(path)
    alpha = float(reader.fields[gguf.Keys.Adapter.LORA_ALPHA].contents())
    stored = {t.name: np.array(t.data, dtype=np.float32).reshape([int(d) for d in reversed(t.shape)]) for t in reader.tensors}
    target, base_config, names = language_model(base_dir)
    if str(reader.fields["general.architecture"].contents()) != target.arch_name:
        raise RuntimeError(f"adapter GGUF check failed: its architecture is not {target.arch_name!r}, the base's")
    permute_qk = target.layout.permute_qk
    name_map = gguf.get_tensor_name_map(target.arch, base_config.num_hidden_layers)
    worst, checked = 0.0, 0
    for module_name, module in peft_model.named_modules():
        if not hasattr(module, "get_delta_weight") or "default" not in getattr(module, "lora_A", {}):
            continue
        hf_name = _text_name(module_name.removeprefix(_PREFIX), names, path)
        gguf_name = name_map.get_type_and_name(hf_name, try_suffixes=(".weight",))[1]
        with torch.no_grad():
            want = module.get_delta_weight("default").float().numpy()
        if permute_qk and gguf_name.endswith(("attn_q.weight", "attn_k.weight")):
            heads = base_config.num_attention_heads if gguf_name.endswith("attn_q.weight") else base_config.num_key_value_heads
            want = permute_heads(want, heads)
        a, b = stored.pop(f"{gguf_name}.lora_a"), stored.pop(f"{gguf_name}.lora_b")
        got = alpha / a.shape[0] * (b @ a)
        diff = float(np.abs(got - want).max()) / max(1e-12, float(np.abs(want).max()))
        if not diff <= 1e-5:
            raise RuntimeError(f"adapter GGUF check failed: {gguf_name} differs from PEFT's delta by {diff:.2e} (relative)")
        worst, checked = max(worst, diff), checked + 1
    if stored or not checked:
        raise RuntimeError(f"adapter GGUF check failed: tensors without a LoRA module: {sorted(stored)[:3]}")
    return worst
