"""What llama.cpp expects of each architecture homelab-ft writes as GGUF: the family table, the
hyperparameter keys, rope, and the weight layouts that differ from Hugging Face's.

After llama.cpp's `convert_hf_to_gguf.py`, reduced to the families homelab-ft trains and
transformers' GGUF loader reads back (so every file we write is checked by reloading it):

- names: `model.layers.3.self_attn.q_proj.weight` -> `blk.3.attn_q.weight` through gguf's
  TensorNameMap for the architecture (gguf_export.py); a tensor the map does not know stops the export.
- Llama (and Mistral, which llama.cpp runs as `llama`): q_proj/k_proj rows are permuted from
  Hugging Face's rotate-half layout to llama.cpp's interleaved-pair rope layout (`permute_heads`).
- Gemma 2/3: HF multiplies by (1 + w) in its RMSNorm, llama.cpp by w, so norms are written as 1 + w.
- Llama 3.1+ rope scaling becomes llama.cpp's `rope_freqs` tensor (`rope_freqs`).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from homelab_ft.errors import UserError


@dataclass(frozen=True)
class Family:
    arch: str
    """The gguf MODEL_ARCH member name."""
    permute_qk: bool = False
    """llama.cpp's `llama` graph applies rope to interleaved pairs (GPT-J style); HF to halves."""
    norm_plus_one: bool = False
    """Gemma's RMSNorm computes x * (1 + w); llama.cpp's computes x * w."""


FAMILIES = {
    "llama": Family("LLAMA", permute_qk=True),
    "mistral": Family("LLAMA", permute_qk=True),
    "qwen2": Family("QWEN2"),
    "qwen3": Family("QWEN3"),
    "phi3": Family("PHI3"),
    "gemma2": Family("GEMMA2", norm_plus_one=True),
    "gemma3_text": Family("GEMMA3", norm_plus_one=True),
}
"""model_type -> how llama.cpp lays it out. Only families that transformers' GGUF loader reads
back, so each export is verified; Gemma 1 (`gemma`) is not among them."""


def check_architecture(model_dir: Path) -> str:
    """The model_type of `model_dir/config.json`, refused when we cannot write it as GGUF."""
    config = json.loads((Path(model_dir) / "config.json").read_text())
    model_type = config.get("model_type")
    if model_type not in FAMILIES:
        raise UserError(f"{model_dir}/config.json: model_type {model_type!r} cannot be exported as GGUF by homelab-ft "
                        f"(supported: {', '.join(FAMILIES)}); export --format safetensors and convert it with llama.cpp")
    rope = rope_parameters(config)
    if rope.get("rope_type", "default") not in ("default", "linear", "llama3", "yarn"):
        raise UserError(f"{model_dir}/config.json: rope type {rope.get('rope_type')!r} cannot be exported as GGUF by "
                        "homelab-ft; export --format safetensors and convert it with llama.cpp")
    return model_type


def permute_heads(weights: np.ndarray, num_heads: int) -> np.ndarray:
    """Rows of each head from [first halves | second halves] to interleaved pairs, as
    convert_hf_to_gguf.py's LlamaModel.permute; transformers' GGUF loader undoes it on read."""
    rows = weights.shape[0]
    return (weights.reshape(num_heads, 2, rows // num_heads // 2, *weights.shape[1:])
            .swapaxes(1, 2).reshape(weights.shape))


def rope_parameters(config) -> dict:
    """The rope settings of a config (its dict or object) in one shape, `rope_type` and
    `rope_theta` included, whichever names the transformers version that wrote it used."""
    if isinstance(config, dict):
        rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
        theta = config.get("rope_theta")
    else:
        rope = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
        theta = getattr(config, "rope_theta", None)
    rope = dict(rope)
    if "type" in rope and "rope_type" not in rope:
        rope["rope_type"] = rope["type"]
    if theta is not None:
        rope.setdefault("rope_theta", theta)
    if "full_attention" in rope:  # Gemma 3: one set per layer type
        return dict(rope["full_attention"], swa=rope.get("sliding_attention", {}))
    return rope


def rope_freqs(config) -> np.ndarray | None:
    """Llama 3.1+ frequency scaling as llama.cpp's `rope_freqs` tensor (per-pair divisors), the
    same formula as transformers' `_compute_llama3_parameters`."""
    rope = rope_parameters(config)
    if rope.get("rope_type") != "llama3":
        return None
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    freqs = 1.0 / (rope["rope_theta"] ** (np.arange(0, head_dim, 2, dtype=np.float32) / head_dim))
    factor, low, high = rope["factor"], rope.get("low_freq_factor", 1.0), rope.get("high_freq_factor", 4.0)
    old = rope.get("original_max_position_embeddings", 8192)
    out = []
    for freq in freqs:
        wavelen = 2 * math.pi / freq
        if wavelen < old / high:
            out.append(1.0)
        elif wavelen > old / low:
            out.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            out.append(1.0 / ((1 - smooth) / factor + smooth))
    return np.array(out, dtype=np.float32)


def write_hparams(writer, config, *, model_type: str, gguf_type: str) -> None:
    import gguf

    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_vocab_size(config.vocab_size)
    rope = rope_parameters(config)
    writer.add_rope_freq_base(float(rope["rope_theta"]))
    rotary_dim = int(head_dim * getattr(config, "partial_rotary_factor", 1.0))
    writer.add_rope_dimension_count(rotary_dim)
    if head_dim != config.hidden_size // config.num_attention_heads or model_type.startswith("gemma"):
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
    if rope.get("rope_type") == "linear":
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(rope["factor"])
    elif rope.get("rope_type") == "yarn":
        writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        writer.add_rope_scaling_factor(rope["factor"])
        writer.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
    if model_type == "gemma2":
        writer.add_attn_logit_softcapping(config.attn_logit_softcapping or 0.0)
        writer.add_final_logit_softcapping(config.final_logit_softcapping or 0.0)
        writer.add_sliding_window(config.sliding_window)
    if model_type == "gemma3_text":
        writer.add_sliding_window(config.sliding_window)
        if rope.get("swa"):
            writer.add_rope_freq_base_swa(float(rope["swa"]["rope_theta"]))
    if model_type == "phi3" and getattr(config, "sliding_window", None):
        writer.add_sliding_window(config.sliding_window)
    writer.add_file_type({"f32": gguf.LlamaFileType.ALL_F32, "f16": gguf.LlamaFileType.MOSTLY_F16,
                          "bf16": gguf.LlamaFileType.MOSTLY_BF16, "q8_0": gguf.LlamaFileType.MOSTLY_Q8_0,
                          "q4_0": gguf.LlamaFileType.MOSTLY_Q4_0, "q5_1": gguf.LlamaFileType.MOSTLY_Q5_1}[gguf_type])
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
