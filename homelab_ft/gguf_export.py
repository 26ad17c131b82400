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


# ------------------------------------------------------------------------------------- verification

GGUF_BOUNDS = {"f32": 1e-5, "f16": 0.01, "bf16": 0.05, "q8_0": 0.1, "q4_0": math.inf, "q5_1": math.inf}
"""Max |logit difference| between the GGUF reloaded by transformers and the model it was written
from, per unit of the largest |logit| (flat when logits stay within +-1). Measured on SmolLM2-135M
(logits up to ~41): f32 0, f16 0.001, bf16 0.007, q8_0 0.036 per unit; so f32 must be identical
and the others have 3-10x margin. 4-bit rounding moves SmolLM2's logits by up to 0.6 per unit, so
q4_0/q5_1 get no logit bound: for them (as for every type) the check that counts is the exact
tensor comparison in `_check_tensors`, and the difference is reported for the user to judge."""

PROBE_CHATS = (
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "Answer in the format ANSWER: <value>."},
     {"role": "user", "content": "Is 2 + 2 = 4? Reply yes or no."},
     {"role": "assistant", "content": "ANSWER: yes"},
     {"role": "user", "content": "and 17 * 3 = 51?  (two  spaces)\nnew line, café"}],
)


@dataclass(frozen=True)
class GgufCheck:
    max_abs_diff: float
    bound: float


def verify_gguf(gguf_path: Path, reference_dir: Path, *, gguf_type: str) -> GgufCheck:
    """Reload the GGUF through transformers' GGUF loader and compare it with `reference_dir`.

    Checked: the hyperparameters transformers reads from the metadata, the tokenizer (same ids on
    chat-formatted prompts with special tokens added as the model adds them, same chat template),
    and the logits on those prompts within GGUF_BOUNDS[gguf_type]. The weights are loaded into the
    reference's config: transformers' GGUF reader does not read rope scaling or Qwen3's head size,
    which llama.cpp does read from the keys written above. Raises RuntimeError on a mismatch.
    """
    import tempfile

    with tempfile.TemporaryDirectory(prefix="gguf-check-") as alone:
        # Alone in its folder: beside tokenizer.json / tokenizer_config.json (a safetensors,gguf
        # export) transformers 5.24 builds the tokenizer from those files and not from the GGUF.
        (Path(alone) / Path(gguf_path).name).symlink_to(Path(gguf_path).resolve())
        return _verify(Path(alone), Path(gguf_path).name, Path(reference_dir), gguf_type=gguf_type)


def _verify(folder: Path, file: str, reference_dir: Path, *, gguf_type: str) -> GgufCheck:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    reference_config = AutoConfig.from_pretrained(reference_dir)
    reference_tok = AutoTokenizer.from_pretrained(reference_dir)
    gguf_tok = AutoTokenizer.from_pretrained(folder, gguf_file=file)
    if reference_tok.chat_template != gguf_tok.chat_template:
        raise RuntimeError("GGUF check failed: the chat template in the GGUF differs from the tokenizer's")
    probes = []
    for chat in PROBE_CHATS:
        text = reference_tok.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
        want, got = reference_tok(text)["input_ids"], gguf_tok(text)["input_ids"]
        if want != got:
            at = next((i for i, (a, b) in enumerate(zip(want, got)) if a != b), min(len(want), len(got)))
            raise RuntimeError(f"GGUF check failed: the GGUF tokenizer gives other ids for a chat prompt "
                               f"(first difference at token {at}: {want[at:at + 3]} vs {got[at:at + 3]})")
        probes.append(torch.tensor([want]))
    expected = _logits(AutoModelForCausalLM.from_pretrained(reference_dir, dtype=torch.float32), probes)

    # transformers' own reader (and its inverse permutation / norm offset), called once for config
    # and tensors: from_pretrained(gguf_file=...) would parse the metadata again for each.
    model = AutoModelForCausalLM.from_config(_as_gguf_arch(reference_config), dtype=torch.float32)
    with _memoized_name_maps():
        parsed = load_gguf_checkpoint(str(folder / file), return_tensors=True, model_to_load=model)
    _check_config(parsed["config"], reference_config)
    tensors = parsed["tensors"]
    _check_tensors(tensors, reference_dir, reference_config, gguf_type=gguf_type)
    missing, unexpected = model.load_state_dict(tensors, strict=False)
    del parsed, tensors
    tied = {"lm_head.weight"} if reference_config.tie_word_embeddings else set()
    if set(missing) - tied or unexpected:
        raise RuntimeError(f"GGUF check failed: transformers reads back missing {sorted(missing)[:3]}, "
                           f"unexpected {sorted(unexpected)[:3]}")
    got = _logits(model, probes)
    diff = max(float((g - e).abs().max()) for g, e in zip(got, expected))
    scale = max(1.0, max(float(e.abs().max()) for e in expected))
    bound = GGUF_BOUNDS[gguf_type] * scale
    if not diff <= bound:
        raise RuntimeError(f"GGUF check failed: {gguf_type} logits differ from the model's by {diff:.3g} > {bound:.3g}")
    return GgufCheck(max_abs_diff=diff, bound=bound)


def _check_config(parsed: dict, reference) -> None:
    """The hyperparameters as transformers reads them from the metadata."""
    for key in ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "intermediate_size",
                "vocab_size", "tie_word_embeddings", "max_position_embeddings"):
        want, got = getattr(reference, key), parsed.get(key)
        if want != got:
            raise RuntimeError(f"GGUF check failed: {key} reads back as {got}, the model has {want}")
    if not math.isclose(parsed.get("rms_norm_eps", 0.0), reference.rms_norm_eps, rel_tol=1e-6):
        raise RuntimeError(f"GGUF check failed: rms_norm_eps reads back as {parsed.get('rms_norm_eps')}")


def _check_tensors(tensors: dict, reference_dir: Path, config, *, gguf_type: str) -> None:
    """Every tensor transformers reads back must equal, bit for bit, the reference tensor rounded
    the way we meant to store it (quantize then dequantize with gguf-py, in HF layout: rounding is
    per row block, so it commutes with llama.cpp's row permutation). This proves the layout, the
    names and the types for every GGUF type, where the logits bound alone is loose for 4-bit."""
    import gguf
    import torch
    from safetensors import safe_open

    family = FAMILIES[config.model_type]
    arch = gguf.MODEL_ARCH[family.arch]
    name_map = gguf.get_tensor_name_map(arch, config.num_hidden_layers)
    for file in sorted(Path(reference_dir).glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():
                if name not in tensors:
                    continue  # a tied head, or rotary buffers: the load_state_dict check covers them
                reference = f.get_tensor(name).to(torch.float32).numpy()
                kind, _ = name_map.get_type_and_name(name, try_suffixes=(".weight", ".bias"))
                qtype = _tensor_qtype(kind, reference.shape, gguf_type)
                stored = reference + np.float32(1.0) if family.norm_plus_one and name.endswith("norm.weight") else reference
                want = _round_trip(stored, qtype)
                if stored is not reference:
                    want = want - np.float32(1.0)
                got = tensors[name].numpy()
                if got.shape != want.shape or not np.array_equal(got, want):
                    raise RuntimeError(f"GGUF check failed: {name} reads back different from what was meant to be written")


def _round_trip(array: np.ndarray, qtype) -> np.ndarray:
    import gguf

    Q = gguf.GGMLQuantizationType
    if qtype == Q.F32:
        return array
    if qtype == Q.F16:
        return array.astype(np.float16).astype(np.float32)
    return gguf.quants.dequantize(gguf.quants.quantize(array, qtype), qtype)


class _memoized_name_maps:
    """transformers builds gguf's TensorNameMap once per module of the model (397 times for
    SmolLM2: 23 of the 55 s its GGUF loader took); the map depends on (arch, layers) only."""

    def __enter__(self):
        import functools

        import gguf

        self.original = gguf.get_tensor_name_map
        gguf.get_tensor_name_map = functools.lru_cache(maxsize=None)(self.original)

    def __exit__(self, *exc):
        import gguf

        gguf.get_tensor_name_map = self.original


def _as_gguf_arch(config):
    """Mistral as llama.cpp runs it: the Llama graph (transformers 5.24 cannot map a `mistral`
    model onto gguf-py's names). The probes are far shorter than any sliding window."""
    if config.model_type != "mistral":
        return config
    from transformers import LlamaConfig

    values = {k: v for k, v in config.to_dict().items() if k not in ("model_type", "sliding_window", "architectures")}
    return LlamaConfig(**values, architectures=["LlamaForCausalLM"])


def _logits(model, probes) -> list:
    import torch

    model.eval()
    with torch.no_grad():
        out = [model(input_ids=ids).logits.float() for ids in probes]
    del model
    return out


# ------------------------------------------------------------------------------- runtime files

_CHATML_TEMPLATE = (
    '{{- range .Messages }}<|im_start|>{{ .Role }}\n{{ .Content }}<|im_end|>\n{{ end }}<|im_start|>assistant\n'
)
"""Ollama's own ChatML template (Go text/template): Ollama cannot run the Jinja template itself."""


def modelfile(model_dir: Path, *, file_name: str, system_prompt: str | None) -> str:
    """An Ollama Modelfile for the GGUF: its stop tokens, and the recipe's system prompt if set.

    For a ChatML model (SmolLM2, Qwen) the template is written out; for others Ollama picks the
    template matching the chat template stored in the GGUF (it knows Llama 3, Mistral, Gemma, Phi-3).
    """
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    stops = list(dict.fromkeys(_stop_tokens(model_dir, tokenizer)))
    lines = [f"FROM ./{file_name}", ""]
    if "<|im_start|>" in (tokenizer.chat_template or ""):
        lines += [f'TEMPLATE """{_CHATML_TEMPLATE}"""', ""]
    if system_prompt:
        lines += [f'SYSTEM """{system_prompt}"""', ""]
    lines += [f'PARAMETER stop "{token}"' for token in stops]
    return "\n".join(lines) + "\n"


def _stop_tokens(model_dir: Path, tokenizer) -> list[str]:
    ids = []
    generation = Path(model_dir) / "generation_config.json"
    if generation.is_file():
        eos = json.loads(generation.read_text()).get("eos_token_id")
        ids += eos if isinstance(eos, list) else [eos] if eos is not None else []
    if tokenizer.eos_token_id is not None:
        ids.append(tokenizer.eos_token_id)
    for token in ("<|im_end|>", "<|eot_id|>", "<end_of_turn>", "<|end|>"):
        if token in (tokenizer.chat_template or "") and token in tokenizer.get_vocab():
            ids.append(tokenizer.convert_tokens_to_ids(token))
    return [tokenizer.convert_ids_to_tokens(i) for i in ids]


def running_notes(name: str, *, gguf_name: str, k_quant_hint: str | None) -> str:
    """The RUNNING.md section for the GGUF: exact llama.cpp, Ollama and LM Studio commands."""
    text = (
        f"GGUF ({gguf_name}) with the chat template and stop tokens in its metadata:\n\n"
        "llama.cpp (chat in the terminal, or an OpenAI-compatible server on port 8080):\n\n"
        f"    llama-cli -m {name}/{gguf_name} -cnv\n"
        f"    llama-server -m {name}/{gguf_name} --port 8080\n\n"
        "Ollama (the Modelfile in this folder sets the stop tokens and the system prompt):\n\n"
        f"    cd {name} && ollama create {_ollama_name(name)} -f Modelfile\n"
        f"    ollama run {_ollama_name(name)}\n\n"
        "LM Studio:\n\n"
        f"    lms import {name}/{gguf_name}\n"
        f"    lms load {Path(gguf_name).stem}\n\n"
    )
    if k_quant_hint:
        text += f"A k-quant needs llama.cpp's llama-quantize (gguf-py cannot write one):\n\n    {k_quant_hint}\n\n"
    return text


def adapter_running_notes(name: str, *, base: str) -> str:
    return (
        "# Running this adapter\n\n"
        f"adapter.gguf is a LoRA adapter in llama.cpp's format for the base model {base}; it needs that base\n"
        "as a GGUF (any type): write it with llama.cpp's convert_hf_to_gguf.py from the base's folder.\n\n"
        "llama.cpp:\n\n"
        f"    llama-cli -m BASE.gguf --lora {name}/adapter.gguf -cnv\n"
        f"    llama-server -m BASE.gguf --lora {name}/adapter.gguf --port 8080\n\n"
        "Ollama (a Modelfile next to BASE.gguf):\n\n"
        f"    FROM ./BASE.gguf\n    ADAPTER ./{name}/adapter.gguf\n"
    )


def _ollama_name(name: str) -> str:
    return "".join(c if c.isalnum() or c in "-_." else "-" for c in name.lower()) or "model"


def load_gguf(path: Path):
    """(model in fp32, tokenizer) from a GGUF file through transformers' GGUF loader, as a user
    of `from_pretrained(folder, gguf_file=...)` gets them."""
    import tempfile

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = Path(path)
    with tempfile.TemporaryDirectory(prefix="gguf-load-") as alone:
        (Path(alone) / path.name).symlink_to(path.resolve())  # see verify_gguf: alone in its folder
        tokenizer = AutoTokenizer.from_pretrained(alone, gguf_file=path.name)
        with _memoized_name_maps():
            model = AutoModelForCausalLM.from_pretrained(alone, gguf_file=path.name, dtype=torch.float32)
    return model, tokenizer
