"""The tokenizer in a GGUF file: llama.cpp's token list, types, scores, merges and pre-tokenizer
name, read from the tokenizer transformers builds (so what llama.cpp splits matches training)."""

from __future__ import annotations

import json
import re
from pathlib import Path

from homelab_ft.errors import UserError

_PRE_TOKENIZERS = {
    "llama-bpe": r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
    "qwen2": r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
    # Qwen 3.5: Qwen2's with combining marks (\p{M}) kept in the word (llama-vocab.cpp LLAMA_VOCAB_PRE_TYPE_QWEN35)
    "qwen35": r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
}
"""llama.cpp's name for a byte-level BPE split regex (its converter finds the same names by hashing
the ids of a probe text; we read the regex from tokenizer.json instead, which also works for
tokenizers trained from scratch)."""


def check_tokenizer(model_dir: Path, *, target) -> None:
    """Refuse (GgufUnsupported) a tokenizer this architecture is not written with (gguf_layouts.Layout.
    tokenizer_kinds): Gemma 4's own is llama.cpp's `gemma4` tokenizer model (BPE merges over raw
    UTF-8 with spaces as U+2581, Gemma4Model.set_vocab), which homelab-ft does not write."""
    from homelab_ft.export.gguf.arch import GgufUnsupported

    model_dir = Path(model_dir)
    spec = json.loads((model_dir / "tokenizer.json").read_text()) if (model_dir / "tokenizer.json").is_file() else None
    kind = _tokenizer_kind(model_dir, spec)
    if target.layout.tokenizer_kinds and kind not in target.layout.tokenizer_kinds:
        raise GgufUnsupported(f"{model_dir}: a {target.arch_name} model with a {kind!r}-kind tokenizer cannot be written "
                              f"as GGUF by homelab-ft, which writes {target.arch_name} with a byte-level BPE one only "
                              "(llama.cpp reads Gemma 4's own as its `gemma4` tokenizer model, not written yet)")


def write_vocab(writer, model_dir: Path, *, vocab_size: int) -> None:
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


PHI3_NAMES = re.compile(r"phi-?3", re.IGNORECASE)
"""What llama.cpp looks for in `general.name` (llama-vocab.cpp, load: `_contains_any(model_name,
{"phi-3", "phi3"})`, lower-cased) to tokenize as Phi-3's tokenizer does: every special token strips
the whitespace after it (RSTRIP), </s> too, <unk>, <s> and <|endoftext|> not; it looks each of those
four up with `token_to_id.at`, so a vocabulary without one fails to load ("unordered_map::at")."""

PHI3_KEPT = ("<unk>", "<s>", "<|endoftext|>")


def general_name(model_dir: Path, name: str) -> str:
    """`general.name` for `model_dir`'s GGUF: `name` (the export folder's), with llama.cpp's Phi-3
    tokenizer rule (PHI3_NAMES) following the tokenizer rather than the name: named in where the
    tokenizer strips the whitespace after every special token but </s> and PHI3_KEPT (Phi-3's chat
    tokens, rstrip true in its tokenizer.json; its </s>, which llama.cpp strips after too, ends a
    SentencePiece text, not a chat turn) and has the four tokens the rule looks up; named out where it
    does not, which a run exported to `--out phi3-ft` of another tokenizer would otherwise meet as a
    file llama.cpp cannot load, and a Phi-3 tokenizer as other prompt ids."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    vocab = tokenizer.get_vocab()
    added = [token for token in tokenizer.added_tokens_decoder.values() if token.special]
    chat = [token for token in added if token.content not in ("</s>", *PHI3_KEPT)]
    strips = all(token in vocab for token in ("</s>", *PHI3_KEPT)) and bool(chat) and all(token.rstrip for token in chat)
    named = bool(PHI3_NAMES.search(name))
    if strips and not named:
        return f"{name} (phi-3 tokenizer)"
    if named and not strips:
        return PHI3_NAMES.sub(lambda match: match[0].replace("-", "").replace("3", " 3"), name)
    return name
