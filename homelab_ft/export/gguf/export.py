"""A Hugging Face model directory -> one GGUF file for llama.cpp, Ollama and LM Studio.

Written with llama.cpp's own Python library (`gguf`: GGUFWriter, the tensor name map, SpecialVocab,
the q8_0/q4_0/q5_1 quantizers), never by running a C++ build. This module holds the export's
options and the writer; which llama.cpp architecture a model is and its weight layouts are
gguf_arch.py, the hyperparameter keys gguf_hparams.py, the tokenizer gguf_vocab.py. Every file written is checked by
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
import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from homelab_ft.errors import UserError
from homelab_ft.export.gguf import arch as gguf_arch
from homelab_ft.export.gguf import hparams as gguf_hparams
from homelab_ft.export.gguf import vocab as gguf_vocab
from homelab_ft.export.gguf.arch import Target
from homelab_ft.export.gguf.reshape import Reshaped

logger = logging.getLogger(__name__)

GGUF_TYPES = ("f32", "f16", "bf16", "q8_0", "q4_0", "q5_1", "mxfp4_moe")
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


def check_writable(model_dir: Path) -> Target:
    """How `model_dir` is written as GGUF, from its config and tensor names alone (no weights read);
    GgufUnsupported when it cannot be."""
    from transformers import AutoConfig

    target = gguf_arch.check_architecture(model_dir)
    gguf_vocab.check_tokenizer(model_dir, target=target)
    plan_tensors(model_dir, AutoConfig.from_pretrained(model_dir), target=target, gguf_type="f32")
    return target


def write_gguf(model_dir: Path, out_path: Path, *, gguf_type: str, name: str) -> None:
    """Write `model_dir` (config.json, safetensors, tokenizer) as one GGUF file at `out_path`."""
    import gguf
    from transformers import AutoConfig

    model_dir = Path(model_dir)
    target = gguf_arch.check_architecture(model_dir)
    gguf_vocab.check_tokenizer(model_dir, target=target)
    config = AutoConfig.from_pretrained(model_dir)
    writer = gguf.GGUFWriter(out_path, target.arch_name)
    try:
        writer.add_type(gguf.GGUFType.MODEL)
        writer.add_name(gguf_vocab.general_name(model_dir, name))
        gguf_hparams.write_hparams(writer, config, target=target, gguf_type=gguf_type)
        gguf_vocab.write_vocab(writer, model_dir, vocab_size=config.vocab_size)
        plan = plan_tensors(model_dir, config, target=target, gguf_type=gguf_type)
        for item in plan:
            writer.add_tensor_info(item.gguf_name, item.shape, np.float32, item.nbytes, raw_dtype=item.qtype)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_ti_data_to_file()
        for item in plan:
            writer.write_tensor_data(encode(item.load(), item.qtype))
    finally:
        writer.close()
    logger.info("wrote %s (%s): %d tensors, %s, %.0f MiB", out_path, target.arch_name, len(plan), gguf_type,
                out_path.stat().st_size / 2**20)


@dataclass(frozen=True)
class Planned:
    """One GGUF tensor: its name and type, and where its values come from."""

    gguf_name: str
    kind: object
    """gguf.MODEL_TENSOR."""
    shape: tuple[int, ...]
    """In the GGUF: the checkpoint's (experts stacked; a `Reshaped` part's), less its unit dimensions."""
    hf_shape: tuple[int, ...]
    """In Hugging Face's layout, experts stacked on axis 0 (a `Reshaped` part: the part's own)."""
    qtype: object
    nbytes: int
    sources: tuple[tuple[Path, str], ...]
    """(safetensors file, tensor name) read for it: one, or each expert's, stacked on a new axis 0."""
    config: object
    target: Target
    extra: np.ndarray | None = None
    """Values not in the checkpoint (llama.cpp's rope_freqs)."""
    reshaped: Reshaped | None = None
    """The rule this tensor is part `part` of (gguf_reshape.py), if its checkpoint tensor has one."""
    part: int = 0

    def hf_values(self) -> np.ndarray:
        """Float32 values of the checkpoint tensor in Hugging Face's layout (experts stacked as
        llama.cpp's `*_exps`; the whole tensor a `Reshaped` part is cut from)."""
        if self.extra is not None:
            return self.extra
        import torch
        from safetensors import safe_open

        parts = []
        for file, hf_name in self.sources:
            with safe_open(str(file), framework="pt") as f:
                parts.append(f.get_tensor(hf_name).to(torch.float32).numpy())
        return parts[0] if len(parts) == 1 else np.stack(parts)

    def load(self) -> np.ndarray:
        """Float32 values converted to llama.cpp's layout."""
        if self.extra is not None:
            return self.extra
        values = self.hf_values()
        if self.reshaped is not None:
            values = self.reshaped.split(values, self.config)[self.part]
        return self.target.to_gguf(self.gguf_name, values, self.config).reshape(self.shape)


_LAYER = re.compile(r"^model\.layers\.(\d+)\.")

_EXPERT = re.compile(r"^(?P<head>.*\.experts)\.(?P<index>\d+)\.(?P<tail>.+)$")
"""A per-expert tensor as transformers saves MoE checkpoints (`mlp.experts.3.down_proj.weight`);
llama.cpp holds all of a block's experts in one 3-D tensor, the name gguf-py maps without the index."""


def plan_tensors(model_dir: Path, config, *, target: Target, gguf_type: str) -> list[Planned]:
    """Every GGUF tensor of `model_dir`, in file order; refuses a tensor llama.cpp has no place for."""
    import gguf

    files = sorted(Path(model_dir).glob("*.safetensors"))
    if not files:
        raise UserError(f"{model_dir} holds no safetensors weights to write as GGUF")
    tied = bool(getattr(config, "tie_word_embeddings", False))
    groups: dict[str, list[tuple[int, Path, str]]] = {}
    shapes: dict[str, tuple[int, ...]] = {}
    for file in files:
        for hf_name, shape in _headers(file).items():
            if (tied and hf_name == "lm_head.weight") or hf_name.endswith("rotary_emb.inv_freq"):
                continue  # a tied head holds the embedding's values: llama.cpp reuses token_embd
            layer = _LAYER.match(hf_name)
            beyond = (layer and int(layer[1]) >= config.num_hidden_layers) or hf_name.startswith(("mtp.", "model.mtp."))
            if target.layout.nextn_dropped and beyond:
                continue  # a NextN/MTP layer (gguf_layouts.Layout.nextn_dropped)
            match = _EXPERT.match(hf_name)
            key = f"{match['head']}.{match['tail']}" if match else hf_name
            groups.setdefault(key, []).append((int(match["index"]) if match else 0, file, hf_name))
            shapes[key] = shape
    name_map = gguf.get_tensor_name_map(target.arch, config.num_hidden_layers)
    allowed = set(gguf.MODEL_TENSORS[target.arch])
    plan = []
    for key, parts in groups.items():
        parts.sort()
        sources = tuple((file, name) for _, file, name in parts)
        hf_shape = (len(parts), *shapes[key]) if len(parts) > 1 else shapes[key]
        rule = target.reshaped(key)
        for index, (gguf_key, in_hf) in enumerate(_gguf_parts(key, hf_shape, config, rule=rule)):
            mapped = name_map.get_type_and_name(gguf_key, try_suffixes=(".weight", ".bias", ".scale"))
            if mapped is None or mapped[0] not in allowed:
                raise gguf_arch.GgufUnsupported(
                    f"{model_dir}: tensor {parts[0][2]} has no place in llama.cpp's {target.arch_name} layout, so "
                    f"model_type {target.model_type!r} cannot be written as GGUF by homelab-ft")
            squeeze = rule is None or rule.squeeze  # the converter's squeeze: Qwen2-MoE's (1, H) gate is H
            shape = (tuple(d for d in in_hf if d != 1) or (1,)) if squeeze else in_hf
            qtype = tensor_qtype(mapped[0], shape, gguf_type, gguf_name=mapped[1])
            plan.append(Planned(mapped[1], mapped[0], shape, in_hf, qtype, _nbytes(shape, qtype), sources, config,
                                target, reshaped=rule, part=index))
    names = {item.gguf_name for item in plan}
    if "token_embd.weight" not in names:
        raise UserError(f"{model_dir} holds no token embedding; is it a complete model?")
    if not tied and "output.weight" not in names:
        raise UserError(f"{model_dir}: config.json says the head is untied but there is no lm_head.weight")
    extra = gguf_hparams.rope_freqs(config)
    if extra is not None:
        F32 = gguf.GGMLQuantizationType.F32
        plan.append(Planned("rope_freqs.weight", gguf.MODEL_TENSOR.ROPE_FREQS, extra.shape, extra.shape, F32,
                            extra.nbytes, (), config, target, extra=extra))
    return plan


def _gguf_parts(key: str, hf_shape: tuple[int, ...], config, *, rule: Reshaped | None) -> list[tuple[str, tuple]]:
    """(name to look up in gguf-py's map, `Planned.hf_shape`) of each GGUF tensor one checkpoint
    tensor (experts stacked) becomes: itself, or the parts its `Reshaped` rule cuts it into."""
    if rule is None:
        return [(key, hf_shape)]
    return list(zip(rule.names(key, config), rule.shapes(hf_shape, config), strict=True))


def _headers(file: Path) -> dict[str, tuple[int, ...]]:
    from safetensors import safe_open

    with safe_open(str(file), framework="pt") as f:
        return {name: tuple(f.get_slice(name).get_shape()) for name in f.keys()}


ALWAYS_F32 = ("FFN_GATE_INP", "SSM_CONV1D", "POS_EMBD", "TOKEN_TYPES")
"""gguf.MODEL_TENSOR kinds convert_hf_to_gguf.py's prepare_tensors keeps in f32 whatever the type
asked ("conditions should closely match those in llama_model_quantize_internal"): the MoE routers,
whose rounding would move which experts a token takes, and the short convolutions of the
linear-attention and Mamba layers."""


def tensor_qtype(kind, shape: tuple[int, ...], gguf_type: str, *, gguf_name: str):
    """llama.cpp's choices: 1-D tensors, norms, ALWAYS_F32 and whatever is not a `.weight` (biases,
    scales, Mamba's A and D columns) stay f32, as prepare_tensors keeps them; a row length that
    is not a whole number of quant blocks falls back to f16. For q4_0/q5_1 the embedding and the
    head stay q8_0, as llama-quantize keeps them at higher precision (it uses q6_K for the head):
    4 bits there cost far more accuracy than in the blocks' weights. mxfp4_moe is llama-quantize's
    MXFP4_MOE (llama-quant.cpp: a tensor of more than one expert MXFP4, any other Q8_0), the type
    gpt-oss is released and run in: 4.25 bits per expert weight (gpt-oss-20b's experts are 19 of its
    21B parameters)."""
    import gguf

    Q = gguf.GGMLQuantizationType
    if len(shape) <= 1 or not gguf_name.endswith(".weight") or gguf_name.endswith("_norm.weight") or \
            kind.name in ALWAYS_F32:
        return Q.F32
    wanted = {"f32": Q.F32, "f16": Q.F16, "bf16": Q.BF16, "q8_0": Q.Q8_0, "q4_0": Q.Q4_0, "q5_1": Q.Q5_1,
              "mxfp4_moe": Q.MXFP4 if len(shape) == 3 and shape[0] > 1 else Q.Q8_0}[gguf_type]
    if wanted in (Q.Q4_0, Q.Q5_1) and kind in (gguf.MODEL_TENSOR.TOKEN_EMBD, gguf.MODEL_TENSOR.OUTPUT):
        wanted = Q.Q8_0
    block, _ = gguf.GGML_QUANT_SIZES[wanted]
    if shape[-1] % block:
        return Q.F16
    return wanted


def _nbytes(shape: tuple[int, ...], qtype) -> int:
    from gguf.quants import quant_shape_to_byte_shape

    return int(math.prod(quant_shape_to_byte_shape(shape, qtype)))


def encode(array: np.ndarray, qtype) -> np.ndarray:
    import gguf

    Q = gguf.GGMLQuantizationType
    array = np.ascontiguousarray(array, dtype=np.float32)
    if qtype == Q.F32:
        return array
    if qtype == Q.F16:
        return array.astype(np.float16)
    return gguf.quants.quantize(array, qtype)
