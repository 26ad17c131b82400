"""A Hugging Face model directory -> one GGUF file for llama.cpp, Ollama and LM Studio.

Written with llama.cpp's own Python library (`gguf`: GGUFWriter, the tensor name map, SpecialVocab,
the q8_0/q4_0/q5_1 quantizers), never by running a C++ build. This module holds the export's
options and the writer; what differs per architecture (families, hyperparameters, rope, weight
layouts) is gguf_arch.py, the tokenizer gguf_vocab.py. Every file written is checked by
reloading it (gguf_check.verify_gguf). Tied embeddings are written once, as `token_embd.weight`;
llama.cpp reuses it when `output.weight` is absent.

Tensors are streamed: pass one reads only the safetensors headers (names, shapes) to lay out the
file, pass two loads one tensor, converts it, writes it and drops it, so host memory stays near the
largest tensor (the embedding: 49152 x 576 x 4 bytes = 113 MB for SmolLM2-135M) instead of the
model.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from homelab_ft.errors import UserError
from homelab_ft.export import gguf_arch, gguf_vocab
from homelab_ft.export.gguf_arch import Family

logger = logging.getLogger(__name__)

GGUF_TYPES = ("f32", "f16", "bf16", "q8_0", "q4_0", "q5_1")
DEFAULT_GGUF_TYPE = "q8_0"
"""8.5 bits per weight; on SmolLM2-135M greedy replies match the f32 model's (docs/export.md)."""

K_QUANTS = ("q2_k", "q3_k_s", "q3_k_m", "q3_k_l", "q4_k_s", "q4_k_m", "q5_k_s", "q5_k_m", "q6_k")
"""Types gguf-py cannot write (their quantizers exist only in C): we write f16 and print the
`llama-quantize` command instead."""

FORMATS = ("safetensors", "gguf")


def parse_formats(text: str) -> tuple[str, ...]:
    formats = tuple(dict.fromkeys(part.strip() for part in text.split(",") if part.strip()))
    unknown = [f for f in formats if f not in FORMATS]
    if unknown or not formats:
        raise UserError(f"--format {text!r}: choose safetensors, gguf or safetensors,gguf")
    return formats


def check_gguf_type(name: str | None) -> tuple[str, str | None]:
    """(type to write, k-quant to print a llama-quantize command for, or None)."""
    name = (name or DEFAULT_GGUF_TYPE).lower()
    if name in GGUF_TYPES:
        return name, None
    if name in K_QUANTS:
        return "f16", name
    raise UserError(f"--gguf-type {name!r} is not a GGUF type homelab-ft writes; choose one of {', '.join(GGUF_TYPES)} "
                    f"(or a k-quant such as q4_k_m, which needs llama.cpp's llama-quantize)")


def gguf_file_name(gguf_type: str) -> str:
    return f"model-{gguf_type}.gguf"


def quantize_command(f16_path: Path, k_quant: str) -> str:
    target = f16_path.with_name(gguf_file_name(k_quant))
    return f"llama-quantize {f16_path} {target} {k_quant.upper()}"


# ------------------------------------------------------------------------------------------ writing


def write_gguf(model_dir: Path, out_path: Path, *, gguf_type: str, name: str) -> None:
    """Write `model_dir` (config.json, safetensors, tokenizer) as one GGUF file at `out_path`."""
    import gguf
    from transformers import AutoConfig

    model_dir = Path(model_dir)
    model_type = gguf_arch.check_architecture(model_dir)
    family = gguf_arch.FAMILIES[model_type]
    config = AutoConfig.from_pretrained(model_dir)
    arch = gguf.MODEL_ARCH[family.arch]
    writer = gguf.GGUFWriter(out_path, gguf.MODEL_ARCH_NAMES[arch])
    try:
        writer.add_type(gguf.GGUFType.MODEL)
        writer.add_name(name)
        gguf_arch.write_hparams(writer, config, model_type=model_type, gguf_type=gguf_type)
        gguf_vocab.write_vocab(writer, model_dir, vocab_size=config.vocab_size)
        plan = list(_plan_tensors(model_dir, config, family=family, arch=arch, gguf_type=gguf_type))
        for item in plan:
            writer.add_tensor_info(item.gguf_name, item.shape, np.float32, item.nbytes, raw_dtype=item.qtype)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_ti_data_to_file()
        for item in plan:
            writer.write_tensor_data(_encode(item.load(), item.qtype))
    finally:
        writer.close()
    logger.info("wrote %s: %d tensors, %s, %.0f MiB", out_path, len(plan), gguf_type, out_path.stat().st_size / 2**20)


@dataclass(frozen=True)
class _Planned:
    gguf_name: str
    shape: tuple[int, ...]
    qtype: object
    nbytes: int
    load: object
    """() -> float32 numpy array, converted to llama.cpp's layout."""


def _plan_tensors(model_dir: Path, config, *, family: Family, arch, gguf_type: str) -> Iterator[_Planned]:
    import gguf
    from safetensors import safe_open

    name_map = gguf.get_tensor_name_map(arch, config.num_hidden_layers)
    allowed = set(gguf.MODEL_TENSORS[arch])
    tied = bool(getattr(config, "tie_word_embeddings", False))
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise UserError(f"{model_dir} holds no safetensors weights to write as GGUF")
    seen: set[str] = set()
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            names = list(f.keys())
            shapes = {n: tuple(f.get_slice(n).get_shape()) for n in names}
        for hf_name in names:
            if tied and hf_name == "lm_head.weight":
                continue  # the same values as the embedding; llama.cpp reuses token_embd
            if hf_name.endswith("rotary_emb.inv_freq"):
                continue
            mapped = name_map.get_type_and_name(hf_name, try_suffixes=(".weight", ".bias"))
            if mapped is None or mapped[0] not in allowed:
                raise UserError(f"{file}: tensor {hf_name} has no place in llama.cpp's {arch.name.lower()} layout; "
                                "export --format safetensors and convert it with llama.cpp")
            kind, gguf_name = mapped
            shape = shapes[hf_name]
            qtype = tensor_qtype(kind, shape, gguf_type)
            seen.add(gguf_name)
            yield _Planned(gguf_name, shape, qtype, _nbytes(shape, qtype),
                           _loader(file, hf_name, gguf_name=gguf_name, config=config, family=family))
    if "token_embd.weight" not in seen:
        raise UserError(f"{model_dir} holds no token embedding; is it a complete model?")
    if not tied and "output.weight" not in seen:
        raise UserError(f"{model_dir}: config.json says the head is untied but there is no lm_head.weight")
    extra = gguf_arch.rope_freqs(config)
    if extra is not None:
        yield _Planned("rope_freqs.weight", extra.shape, gguf.GGMLQuantizationType.F32, extra.nbytes, lambda: extra)


def tensor_qtype(kind, shape: tuple[int, ...], gguf_type: str):
    """llama.cpp's choices: 1-D tensors (norms, biases) stay f32; a row length that is not a
    whole number of quant blocks falls back to f16. For q4_0/q5_1 the embedding and the head stay
    q8_0, as llama-quantize keeps them at higher precision (it uses q6_K for the head): 4 bits there
    cost far more accuracy than in the blocks' weights."""
    import gguf

    Q = gguf.GGMLQuantizationType
    if len(shape) <= 1:
        return Q.F32
    wanted = {"f32": Q.F32, "f16": Q.F16, "bf16": Q.BF16, "q8_0": Q.Q8_0, "q4_0": Q.Q4_0, "q5_1": Q.Q5_1}[gguf_type]
    if wanted in (Q.Q4_0, Q.Q5_1) and kind in (gguf.MODEL_TENSOR.TOKEN_EMBD, gguf.MODEL_TENSOR.OUTPUT):
        wanted = Q.Q8_0
    block, _ = gguf.GGML_QUANT_SIZES[wanted]
    if shape[-1] % block:
        return Q.F16
    return wanted


def _nbytes(shape: tuple[int, ...], qtype) -> int:
    from gguf.quants import quant_shape_to_byte_shape

    return int(math.prod(quant_shape_to_byte_shape(shape, qtype)))


def _encode(array: np.ndarray, qtype) -> np.ndarray:
    import gguf

    Q = gguf.GGMLQuantizationType
    array = np.ascontiguousarray(array, dtype=np.float32)
    if qtype == Q.F32:
        return array
    if qtype == Q.F16:
        return array.astype(np.float16)
    return gguf.quants.quantize(array, qtype)


def _loader(file: Path, hf_name: str, *, gguf_name: str, config, family: Family):
    def load() -> np.ndarray:
        import torch
        from safetensors import safe_open

        with safe_open(str(file), framework="pt") as f:
            tensor = f.get_tensor(hf_name).to(torch.float32)
        array = tensor.numpy()
        if family.permute_qk and gguf_name.endswith("attn_q.weight"):
            array = gguf_arch.permute_heads(array, config.num_attention_heads)
        elif family.permute_qk and gguf_name.endswith("attn_k.weight"):
            array = gguf_arch.permute_heads(array, config.num_key_value_heads)
        if family.norm_plus_one and gguf_name.endswith("norm.weight"):
            array = array + 1.0
        return array

    return load
