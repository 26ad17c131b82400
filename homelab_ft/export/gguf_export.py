"""A Hugging Face model directory -> one GGUF file for llama.cpp, Ollama and LM Studio.

Written with llama.cpp's own Python library (`gguf`: GGUFWriter, the tensor name map, SpecialVocab,
the q8_0/q4_0/q5_1 quantizers), never by running a C++ build. The design follows llama.cpp's
`convert_hf_to_gguf.py`, reduced to the families homelab-ft trains and transformers' GGUF loader
reads back (so every file we write is checked by reloading it, see `verify_gguf`):

- names: `model.layers.3.self_attn.q_proj.weight` -> `blk.3.attn_q.weight` through gguf's
  TensorNameMap for the architecture; a tensor the map does not know stops the export.
- Llama (and Mistral, which llama.cpp runs as `llama`): q_proj/k_proj rows are permuted from
  Hugging Face's rotate-half layout to llama.cpp's interleaved-pair rope layout.
- Gemma 2/3: HF multiplies by (1 + w) in its RMSNorm, llama.cpp by w, so norms are written as 1 + w.
- tied embeddings: written once, as `token_embd.weight`; llama.cpp reuses it when `output.weight`
  is absent.

Tensors are streamed: pass one reads only the safetensors headers (names, shapes) to lay out the
file, pass two loads one tensor, converts it, writes it and drops it, so host memory stays near the
largest tensor (the embedding: 49152 x 576 x 4 bytes = 113 MB for SmolLM2-135M) instead of the
model.
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from homelab_ft.errors import UserError

logger = logging.getLogger(__name__)

GGUF_TYPES = ("f32", "f16", "bf16", "q8_0", "q4_0", "q5_1")
DEFAULT_GGUF_TYPE = "q8_0"
"""8.5 bits per weight; on SmolLM2-135M greedy replies match the f32 model's (docs/export.md)."""

K_QUANTS = ("q2_k", "q3_k_s", "q3_k_m", "q3_k_l", "q4_k_s", "q4_k_m", "q5_k_s", "q5_k_m", "q6_k")
"""Types gguf-py cannot write (their quantizers exist only in C): we write f16 and print the
`llama-quantize` command instead."""

FORMATS = ("safetensors", "gguf")


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


def check_architecture(model_dir: Path) -> str:
    """The model_type of `model_dir/config.json`, refused when we cannot write it as GGUF."""
    config = json.loads((Path(model_dir) / "config.json").read_text())
    model_type = config.get("model_type")
    if model_type not in FAMILIES:
        raise UserError(f"{model_dir}/config.json: model_type {model_type!r} cannot be exported as GGUF by homelab-ft "
                        f"(supported: {', '.join(FAMILIES)}); export --format safetensors and convert it with llama.cpp")
    rope = _rope_parameters(config)
    if rope.get("rope_type", "default") not in ("default", "linear", "llama3", "yarn"):
        raise UserError(f"{model_dir}/config.json: rope type {rope.get('rope_type')!r} cannot be exported as GGUF by "
                        "homelab-ft; export --format safetensors and convert it with llama.cpp")
    return model_type


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
    model_type = check_architecture(model_dir)
    family = FAMILIES[model_type]
    config = AutoConfig.from_pretrained(model_dir)
    arch = gguf.MODEL_ARCH[family.arch]
    writer = gguf.GGUFWriter(out_path, gguf.MODEL_ARCH_NAMES[arch])
    try:
        writer.add_type(gguf.GGUFType.MODEL)
        writer.add_name(name)
        _write_hparams(writer, config, model_type=model_type, gguf_type=gguf_type)
        _write_vocab(writer, model_dir, vocab_size=config.vocab_size)
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
            qtype = _tensor_qtype(kind, shape, gguf_type)
            seen.add(gguf_name)
            yield _Planned(gguf_name, shape, qtype, _nbytes(shape, qtype),
                           _loader(file, hf_name, gguf_name=gguf_name, config=config, family=family))
    if "token_embd.weight" not in seen:
        raise UserError(f"{model_dir} holds no token embedding; is it a complete model?")
    if not tied and "output.weight" not in seen:
        raise UserError(f"{model_dir}: config.json says the head is untied but there is no lm_head.weight")
    extra = _rope_freqs(config)
    if extra is not None:
        yield _Planned("rope_freqs.weight", extra.shape, gguf.GGMLQuantizationType.F32, extra.nbytes, lambda: extra)


def _tensor_qtype(kind, shape: tuple[int, ...], gguf_type: str):
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
            array = _permute(array, config.num_attention_heads)
        elif family.permute_qk and gguf_name.endswith("attn_k.weight"):
            array = _permute(array, config.num_key_value_heads)
        if family.norm_plus_one and gguf_name.endswith("norm.weight"):
            array = array + 1.0
        return array

    return load


def _permute(weights: np.ndarray, num_heads: int) -> np.ndarray:
    """Rows of each head from [first halves | second halves] to interleaved pairs, as
    convert_hf_to_gguf.py's LlamaModel.permute; transformers' GGUF loader undoes it on read."""
    rows = weights.shape[0]
    return (weights.reshape(num_heads, 2, rows // num_heads // 2, *weights.shape[1:])
            .swapaxes(1, 2).reshape(weights.shape))


def _rope_parameters(config) -> dict:
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


def _rope_freqs(config) -> np.ndarray | None:
    """Llama 3.1+ frequency scaling as llama.cpp's `rope_freqs` tensor (per-pair divisors), the
    same formula as transformers' `_compute_llama3_parameters`."""
    rope = _rope_parameters(config)
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


def _write_hparams(writer, config, *, model_type: str, gguf_type: str) -> None:
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
    rope = _rope_parameters(config)
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


# ---------------------------------------------------------------------------------------- tokenizer

_PRE_TOKENIZERS = {
    "llama-bpe": r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
    "qwen2": r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
}
"""llama.cpp's name for a byte-level BPE split regex (its converter finds the same names by hashing
the ids of a probe text; we read the regex from tokenizer.json instead, which also works for
tokenizers trained from scratch)."""


def _write_vocab(writer, model_dir: Path, *, vocab_size: int) -> None:
    import gguf

    spec = json.loads((model_dir / "tokenizer.json").read_text()) if (model_dir / "tokenizer.json").is_file() else None
    kind = _tokenizer_kind(model_dir, spec)
    if kind == "gpt2":
        tokens, types = _bpe_tokens(model_dir, vocab_size=vocab_size)
        writer.add_tokenizer_model("gpt2")
        writer.add_tokenizer_pre(_bpe_pre(model_dir))
        writer.add_token_list(tokens)
        writer.add_token_types(types)
        _special_vocab(model_dir, load_merges=True, n_vocab=None).add_to_gguf(writer, quiet=True)
        return
    # tokenizer.json first: it is what transformers trained with, added tokens (a chat format's
    # specials) included, which tokenizer.model may lack; llama.cpp's converter prefers the latter.
    vocab = gguf.LlamaHfVocab(model_dir) if spec is not None else gguf.SentencePieceVocab(model_dir)
    tokens, scores, types = [], [], []
    for text, score, token_type in vocab.all_tokens():
        tokens.append(text)
        scores.append(score)
        types.append(token_type)
    for index in range(len(tokens), vocab_size):  # the embedding is padded past the tokenizer
        tokens.append(f"[PAD{index}]".encode())
        scores.append(-1000.0)
        types.append(gguf.TokenType.UNUSED)
    writer.add_tokenizer_model("llama")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens[:vocab_size])
    writer.add_token_scores(scores[:vocab_size])
    writer.add_token_types(types[:vocab_size])
    writer.add_add_space_prefix(_adds_prefix_space(spec))
    _special_vocab(model_dir, load_merges=False, n_vocab=vocab_size).add_to_gguf(writer, quiet=True)


def _special_vocab(model_dir: Path, *, load_merges: bool, n_vocab: int | None):
    """gguf's SpecialVocab (merges, special ids, chat template), with add_bos/add_eos taken from
    what the tokenizer really does: left unset, llama.cpp and transformers' GGUF reader both add a
    BOS to every SentencePiece prompt, which transformers 5's LlamaTokenizer does not by default."""
    import gguf
    from transformers import AutoTokenizer

    special = gguf.SpecialVocab(model_dir, load_merges=load_merges, n_vocab=n_vocab)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    ids = tokenizer("a")["input_ids"]
    special.add_special_token["bos"] = tokenizer.bos_token_id is not None and ids[:1] == [tokenizer.bos_token_id]
    special.add_special_token["eos"] = tokenizer.eos_token_id is not None and ids[-1:] == [tokenizer.eos_token_id]
    return special


def _tokenizer_kind(model_dir: Path, spec: dict | None) -> str:
    if spec is None:
        if (model_dir / "tokenizer.model").is_file():
            return "llama"
        raise UserError(f"{model_dir} has no tokenizer.json or tokenizer.model to write into the GGUF")
    model = spec.get("model", {})
    if model.get("type") != "BPE":
        raise UserError(f"{model_dir}/tokenizer.json: a {model.get('type')} tokenizer cannot be written as GGUF by "
                        "homelab-ft (BPE and SentencePiece-BPE are supported)")
    return "llama" if model.get("byte_fallback") else "gpt2"


def _adds_prefix_space(spec: dict | None) -> bool:
    """SentencePiece's `add_dummy_prefix`: Llama 2 and Mistral prepend a space, Gemma does not."""
    text = json.dumps(spec or {})
    return '"prepend_scheme": "first"' in text or '"prepend_scheme": "always"' in text or '"Prepend"' in text


def _bpe_tokens(model_dir: Path, *, vocab_size: int) -> tuple[list[str], list[int]]:
    """Token strings and types as llama.cpp's `get_vocab_base`: added tokens that are special
    become CONTROL (never produced from plain text), other added tokens USER_DEFINED, and ids past
    the tokenizer (a padded embedding) UNUSED `[PADn]`."""
    import gguf
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    reverse = {index: token for token, index in tokenizer.get_vocab().items()}
    if max(reverse) >= vocab_size:
        raise UserError(f"{model_dir}: the tokenizer has ids up to {max(reverse)} but config.json's vocab_size is {vocab_size}")
    added = tokenizer.added_tokens_decoder
    tokens, types = [], []
    for index in range(vocab_size):
        if index not in reverse:
            tokens.append(f"[PAD{index}]")
            types.append(gguf.TokenType.UNUSED)
        elif index in added:
            tokens.append(reverse[index])
            types.append(gguf.TokenType.CONTROL if added[index].special else gguf.TokenType.USER_DEFINED)
        else:
            tokens.append(reverse[index])
            types.append(gguf.TokenType.NORMAL)
    return tokens, types


def _bpe_pre(model_dir: Path) -> str:
    """llama.cpp's pre-tokenizer name for the split rules the model was trained with.

    Read from the tokenizer transformers builds, not from tokenizer.json: for some model types
    (Qwen2, Qwen3) transformers 5 imposes the family's own split regex over the file's.
    """
    from transformers import AutoTokenizer

    backend = json.loads(AutoTokenizer.from_pretrained(model_dir).backend_tokenizer.to_str())
    pre = backend.get("pre_tokenizer") or {}
    steps = pre.get("pretokenizers", [pre]) if pre.get("type") == "Sequence" else [pre]
    kinds = [s.get("type") for s in steps]
    regexes = [s.get("pattern", {}).get("Regex") for s in steps if s.get("type") == "Split"]
    for name, regex in _PRE_TOKENIZERS.items():
        if regexes == [regex]:
            return name
    byte_level = [s for s in steps if s.get("type") == "ByteLevel"]
    if not regexes and len(byte_level) == 1 and byte_level[0].get("use_regex", True):
        if kinds == ["ByteLevel"]:
            return "gpt-2"
        if kinds == ["Digits", "ByteLevel"] and steps[0].get("individual_digits"):
            return "smollm"  # SmolLM/SmolLM2: one token per digit, then GPT-2's split
    raise UserError(f"{model_dir}/tokenizer.json: its pre-tokenizer ({', '.join(map(str, kinds))}) has no llama.cpp "
                    "equivalent homelab-ft knows; export --format safetensors and convert it with llama.cpp")
