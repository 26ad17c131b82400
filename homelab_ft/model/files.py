"""What a model folder must hold, checked from file headers before anything loads it.

Every command that reads a model (train's preflight, `data inspect`, `generate`, `chat`, export's
base load) asks these, so a half-copied or damaged folder is one line naming the file and the fix,
exit 2, instead of a traceback from deep inside safetensors or transformers, and before a run
directory exists. Only headers are read: 8 bytes of length and the JSON index of each safetensors
file (microseconds, whatever the model's size); a tokenizer is checked by its files' names here and
by loading it in `loading.load_tokenizer`; config.json's values by transformers itself
(`locate.config_refusal`).
"""

from __future__ import annotations

import json
import struct
from itertools import pairwise
from pathlib import Path

from homelab_ft.errors import UserError
from homelab_ft.locate import locate

TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "vocab.txt", "tiktoken.model")
"""Any one of these holds a vocabulary (fast tokenizers, SentencePiece, BPE/WordPiece, tiktoken)."""
WEIGHT_INDEXES = ("model.safetensors.index.json", "pytorch_model.bin.index.json")
WEIGHT_FILES = ("model.safetensors", "pytorch_model.bin")
REFETCH = "copy the folder again (a partial download or copy is the usual cause)"


def check_model_files(model_dir: Path, *, converted: bool = False) -> None:
    """Weights are present and every safetensors file's header is whole and true to the file."""
    where = "the converted GGUF in " if converted else ""
    for index_name in WEIGHT_INDEXES:
        index = model_dir / index_name
        if index.is_file():
            try:
                shards = sorted(set(json.loads(index.read_text(encoding="utf-8"))["weight_map"].values()))
            except (json.JSONDecodeError, KeyError, AttributeError, TypeError, UnicodeDecodeError):
                raise UserError(f"model.path: {index} is not a valid weight index; {REFETCH}") from None
            for shard in shards:
                path = model_dir / str(shard)
                if not path.is_file():
                    raise UserError(f"model.path: {path} is missing ({index.name} lists it); {REFETCH}")
                if path.suffix == ".safetensors":
                    check_safetensors(path)
            return
    for name in WEIGHT_FILES:
        path = model_dir / name
        if path.is_file():
            if path.suffix == ".safetensors":
                check_safetensors(path)
            return
    raise UserError(
        f"model.path: {where}{model_dir} has config.json but no weights (model.safetensors or "
        f"model.safetensors.index.json with its shards); {REFETCH}"
    )


def check_safetensors(path: Path) -> None:
    """Read only the header (8 bytes of length, then a JSON object of tensor entries) and check it
    against the format (safetensors' spec): every entry's byte range inside the file, as long as its
    shape x dtype, and no two ranges overlapping. A truncated or damaged file fails here in
    microseconds instead of halfway through loading, or inside safetensors' mmap with a traceback."""
    size = path.stat().st_size
    with open(path, "rb") as fh:
        head = fh.read(8)
        if len(head) < 8:
            raise UserError(f"model.path: {path} is truncated ({size} bytes, not even a header); {REFETCH}")
        (header_len,) = struct.unpack("<Q", head)
        if header_len > size - 8 or header_len > 100_000_000:
            raise UserError(f"model.path: {path} is truncated or not safetensors (header of {header_len:,} bytes "
                            f"in a {size:,}-byte file); {REFETCH}")
        try:
            header = json.loads(fh.read(header_len))
        except (json.JSONDecodeError, UnicodeDecodeError):
            raise UserError(f"model.path: {path} has a damaged safetensors header (not JSON); {REFETCH}") from None
    if not isinstance(header, dict):
        raise UserError(f"model.path: {path} has a damaged safetensors header (a JSON {type(header).__name__}, "
                        f"not an object of tensors); {REFETCH}")
    tensors = {key: entry for key, entry in header.items() if key != "__metadata__"}
    ranges = sorted((*_byte_range(path, key, entry), key) for key, entry in tensors.items())
    for (_, end, key), (start, _, other) in pairwise(ranges):
        if start < end:
            raise UserError(f"model.path: {path} has a damaged safetensors header: {key!r} and {other!r} share "
                            f"bytes; {REFETCH}")
    needed = 8 + header_len + max((end for _, end, _ in ranges), default=0)
    if needed > size:
        raise UserError(f"model.path: {path} is truncated ({size:,} of {needed:,} bytes); {REFETCH}")


_DTYPE_BYTES = {"F64": 8, "I64": 8, "U64": 8, "F32": 4, "I32": 4, "U32": 4, "F16": 2, "BF16": 2, "I16": 2,
                "U16": 2, "I8": 1, "U8": 1, "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1, "F8_E8M0": 1}
"""Bytes per element of safetensors' dtypes (its format spec); a dtype not listed is not size-checked."""


def _byte_range(path: Path, key: str, entry) -> tuple[int, int]:
    """(start, end) of one header entry, which must hold exactly shape x dtype bytes: a header that
    lies about a size would otherwise fail inside safetensors' loader, after the run directory was made."""
    try:
        start, end = (int(v) for v in entry["data_offsets"])
        count = 1
        for dim in entry["shape"]:
            count *= int(dim)
        width = _DTYPE_BYTES.get(entry["dtype"])
    except (TypeError, KeyError, ValueError):
        raise UserError(f"model.path: {path} has a damaged safetensors header (entry {key!r}); {REFETCH}") from None
    if start < 0 or end < start or (width is not None and end - start != count * width):
        raise UserError(f"model.path: {path} has a damaged safetensors header: {key!r} is {entry['dtype']} "
                        f"{list(entry['shape'])} but spans {end - start:,} bytes; {REFETCH}")
    return start, end


def check_tokenizer(tokenizer_spec: str | None, model_dir: Path) -> None:
    """A vocabulary file is where the tokenizer will be loaded from (model.tokenizer, else the model)."""
    if tokenizer_spec is None:
        folder, field = model_dir, "model.path"
    else:
        where = locate(tokenizer_spec, field="model.tokenizer")
        if where.is_gguf:
            return  # the tokenizer is inside the GGUF; the converted folder is checked with the model
        folder, field = (where.path if where.path.is_dir() else where.path.parent), "model.tokenizer"
    if not any((folder / name).is_file() for name in TOKENIZER_FILES):
        raise UserError(
            f"{field}: {folder} has no tokenizer ({' or '.join(TOKENIZER_FILES[:2])}); copy the tokenizer files "
            "from the original model into it, or set model.tokenizer to a folder that has them"
        )

