"""Reading sources and turning their rows into one canonical shape.

A source (file, glob, folder, `save_to_disk` directory, cached hub id) yields rows with a location
(file and row number). Each row is checked and converted by its format into a canonical sample:

    {"messages": [{"role", "content"}, ...], "prompt": str, "completion": str, "kind": "chat" | "text"}

chat / alpaca / sharegpt rows become `messages` (rendered later by the chat template);
prompt_completion and text rows become plain `prompt` + `completion` (no template; text trains on
everything). A bad row raises `RowError`; the caller turns it into a one-line `UserError` that names
file, row and field, or counts and skips it (`data.bad_rows: skip`).

JSON Lines are parsed here, line by line, rather than by `datasets`' JSON loader, whose errors on a
bad line name neither the line nor the field (it reports an Arrow parse error for the whole file).
"""

from __future__ import annotations

import glob
import importlib.resources
import json
from collections.abc import Iterator
from pathlib import Path

from homelab_ft.errors import UserError

ROLES = ("system", "user", "assistant")
SHAREGPT_ROLES = {"system": "system", "human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "model": "assistant", "chatgpt": "assistant"}
FORMAT_FIELDS = {
    "preference": ("chosen", "rejected"),
    "chat": ("messages",),
    "sharegpt": ("conversations",),
    "alpaca": ("instruction", "output"),
    "prompt_completion": ("prompt", "completion"),
    "text": ("text",),
}
"""Required columns of each format, in the order auto-detection tries them (pairs first: a
preference row may also carry `messages` as its prompt)."""
OPTIONAL_FIELDS = {"alpaca": ("input", "system"), "chat": (), "sharegpt": (), "prompt_completion": (), "text": (),
                   "preference": ("prompt", "messages")}
FILE_TYPES = {".jsonl": "jsonl", ".json": "json", ".csv": "csv", ".parquet": "parquet"}


class RowError(ValueError):
    """One bad row: `field` names the offending field (dotted), the message says what is wrong."""

    def __init__(self, field: str, problem: str):
        super().__init__(f"field '{field}' {problem}")


# --------------------------------------------------------------------------------------------
# locating and reading


def resolve_files(path: str, *, base_dir: Path | None, where: str) -> list[Path] | Path | str:
    """A source path -> list of data files, a `save_to_disk` directory (Path), or a hub id (str)."""
    if path.startswith("demo:"):
        split = path.removeprefix("demo:")
        return [Path(str(importlib.resources.files("homelab_ft") / "assets" / "demo" / f"{split}.jsonl"))]
    roots = [base_dir, None] if base_dir is not None else [None]
    for root in roots:
        full = Path(path) if root is None or Path(path).is_absolute() else root / path
        if any(ch in path for ch in "*?["):
            found = sorted(Path(p) for p in glob.glob(str(full), recursive=True) if Path(p).suffix in FILE_TYPES)
            if found:
                return found
        elif full.is_dir():
            if (full / "state.json").is_file() or (full / "dataset_dict.json").is_file():
                return full
            found = sorted(p for p in full.rglob("*") if p.suffix in FILE_TYPES and p.is_file())
            if not found:
                raise UserError(f"{where}: folder {full} holds no .jsonl/.json/.csv/.parquet files")
            return found
        elif full.is_file():
            if full.suffix not in FILE_TYPES:
                raise UserError(f"{where}: {full} has an unsupported extension; use .jsonl, .json, .csv or .parquet")
            return [full]
    if path.count("/") == 1 and not path.startswith((".", "/")) and not Path(path).suffix:
        return path  # owner/name: a hub dataset id
    looked = ", ".join(str(r) for r in [base_dir, Path.cwd()] if r is not None)
    raise UserError(f"{where}: dataset {path} does not exist (looked relative to {looked}); fix the path")


def read_rows(target, *, split: str, where: str, on_bad) -> Iterator[tuple[str, int, dict]]:
    """Yield (file, row number, row) from what `resolve_files` returned.

    `on_bad(file, row, message)` is called for a row that cannot be parsed at all (invalid UTF-8 or
    JSON, not an object); it raises or counts.
    """
    if isinstance(target, str):
        yield from _dataset_rows(_load_hub(target, split=split, where=where), name=target)
    elif isinstance(target, Path):
        yield from _dataset_rows(_load_disk(target, split=split, where=where), name=str(target))
    else:
        for file in target:
            kind = FILE_TYPES[file.suffix]
            if kind == "jsonl":
                yield from _jsonl_rows(file, on_bad=on_bad)
            elif kind == "json":
                yield from _json_rows(file)
            else:
                yield from _dataset_rows(_load_table(file, kind), name=str(file))


def _jsonl_rows(file: Path, *, on_bad) -> Iterator[tuple[str, int, dict]]:
    data = file.read_bytes()
    if not data.strip():
        raise UserError(f"{file} is empty; a JSONL dataset has one JSON object per line")
    for number, raw in enumerate(data.split(b"\n"), start=1):
        if not raw.strip():
            continue
        try:
            line = raw.decode("utf-8")
        except UnicodeDecodeError as err:
            on_bad(str(file), number, f"is not valid UTF-8 (byte {err.start + 1}); re-save the file as UTF-8")
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as err:
            on_bad(str(file), number, f"is not valid JSON ({err.msg} at column {err.colno})")
            continue
        if not isinstance(row, dict):
            on_bad(str(file), number, f"is a JSON {type(row).__name__}, expected an object with named fields")
            continue
        yield str(file), number, row


def _json_rows(file: Path) -> Iterator[tuple[str, int, dict]]:
    try:
        data = json.loads(file.read_bytes().decode("utf-8"))
    except UnicodeDecodeError as err:
        raise UserError(f"{file} is not valid UTF-8 (byte {err.start + 1}); re-save the file as UTF-8") from None
    except json.JSONDecodeError as err:
        if not file.read_bytes().strip():
            raise UserError(f"{file} is empty; a JSON dataset is a list of objects") from None
        raise UserError(f"{file}: line {err.lineno} is not valid JSON ({err.msg})") from None
    if isinstance(data, dict) and len(data) == 1 and isinstance(next(iter(data.values())), list):
        data = next(iter(data.values()))  # {"data": [...]}
    if not isinstance(data, list):
        raise UserError(f"{file}: expected a list of objects (or {{\"data\": [...]}}), got a {type(data).__name__}")
    if not data:
        raise UserError(f"{file} is empty; a JSON dataset is a list of objects")
    for number, row in enumerate(data, start=1):
        if not isinstance(row, dict):
            raise UserError(f"{file}: item {number} is a {type(row).__name__}, expected an object with named fields")
        yield str(file), number, row


def _dataset_rows(ds, *, name: str) -> Iterator[tuple[str, int, dict]]:
    if len(ds) == 0:
        raise UserError(f"{name} is empty; it has no rows")
    for number, row in enumerate(ds, start=1):
        yield name, number, row


def _load_table(file: Path, kind: str):
    import datasets

    if not file.read_bytes()[:1]:
        raise UserError(f"{file} is empty")
    try:
        return datasets.load_dataset(kind, data_files=str(file), split="train")
    except Exception as err:  # pyarrow/pandas parse errors: keep their first line, name the file
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise UserError(f"{file}: cannot read as {kind}: {first}") from None


def _load_disk(path: Path, *, split: str, where: str):
    import datasets

    loaded = datasets.load_from_disk(str(path))
    if isinstance(loaded, datasets.DatasetDict):
        if split not in loaded:
            raise UserError(f"{where}: {path} has splits {sorted(loaded)}, not {split!r}; set split:")
        return loaded[split]
    return loaded


def _load_hub(name: str, *, split: str, where: str):
    import datasets
    from datasets.naming import camelcase_to_snakecase

    # Look in the cache ourselves first (the layout datasets' CachedDatasetModuleFactory reads), so an
    # uncached id fails at once instead of after network timeouts on an offline machine.
    owner, dataset = name.split("/")
    cached = Path(datasets.config.HF_DATASETS_CACHE) / f"{owner}___{camelcase_to_snakecase(dataset)}"
    fix = (f"it is neither a local path nor a hub dataset in the local cache ({cached}); fix the path, or run "
           f"`datasets.load_dataset('{name}')` on a machine with network and copy its cache here")
    if not any(p.is_dir() for p in cached.glob("*/*/*")):
        raise UserError(f"{where}: {name}: {fix}")
    try:
        return datasets.load_dataset(name, split=split)
    except Exception as err:
        raise UserError(f"{where}: {name} (split {split}) cannot be loaded from the cache: {str(err).splitlines()[0]}") from None


# --------------------------------------------------------------------------------------------
# formats


def detect_format(columns: set[str], *, where: str) -> str:
    for name, required in FORMAT_FIELDS.items():
        if all(c in columns for c in required):
            return name
    expected = "; ".join(f"{n}: {', '.join(r)}" for n, r in FORMAT_FIELDS.items())
    raise UserError(
        f"{where}: cannot tell the format from the columns {sorted(columns)}; expected one of ({expected}); "
        "set format: and, if your columns have other names, fields: {format_name: your_column}"
    )


def check_fields(fields: dict[str, str], fmt: str, columns: set[str], *, where: str) -> None:
    """A mapping must name a field of the format and a column the data has."""
    known = FORMAT_FIELDS[fmt] + OPTIONAL_FIELDS[fmt]
    for ours, theirs in fields.items():
        if ours not in known:
            raise UserError(f"{where}.fields: {ours!r} is not a field of format {fmt} (fields: {', '.join(known)})")
        if theirs not in columns:
            raise UserError(
                f"{where}.fields maps {ours} -> {theirs!r}, but the data has no column {theirs!r} "
                f"(columns: {', '.join(sorted(columns))})"
            )


def to_sample(row: dict, fmt: str, fields: dict[str, str], *, system_prompt: str | None, drop_system: bool) -> dict:
    """Convert one row to the canonical sample, or raise RowError."""
    col = {name: fields.get(name, name) for name in FORMAT_FIELDS[fmt] + OPTIONAL_FIELDS[fmt]}
    if fmt == "preference":
        return _to_pair(row, col, system_prompt=system_prompt, drop_system=drop_system)
    if fmt in ("prompt_completion", "text"):
        prompt = _string(row, col["prompt"]) if fmt == "prompt_completion" else ""
        completion = _string(row, col["completion" if fmt == "prompt_completion" else "text"])
        return {"kind": "text", "messages": [], "prompt": prompt, "completion": completion}
    if fmt == "alpaca":
        user = _string(row, col["instruction"])
        extra = _string(row, col["input"], optional=True)
        system = _string(row, col["system"], optional=True)
        messages = [{"role": "system", "content": system}] if system else []
        messages.append({"role": "user", "content": f"{user}\n\n{extra}" if extra else user})
        messages.append({"role": "assistant", "content": _string(row, col["output"])})
    elif fmt == "chat":
        messages = _turns(row, col["messages"], role_key="role", text_key="content", roles={r: r for r in ROLES})
    else:
        messages = _turns(row, col["conversations"], role_key="from", text_key="value", roles=SHAREGPT_ROLES)
    if drop_system:
        messages = [m for m in messages if m["role"] != "system"]
    elif system_prompt is not None and not any(m["role"] == "system" for m in messages):
        messages.insert(0, {"role": "system", "content": system_prompt})
    if not any(m["role"] == "assistant" for m in messages):
        raise RowError(col.get("messages", col.get("conversations", "output")), "has no assistant turn, so nothing would be learned")
    first = next(m["role"] for m in messages if m["role"] != "system")
    if first != "user":
        raise RowError(col.get("messages", col.get("conversations", "output")), f"starts with a {first} turn; the first non-system turn must be user")
    return {"kind": "chat", "messages": messages, "prompt": "", "completion": ""}


def _to_pair(row: dict, col: dict[str, str], *, system_prompt: str | None, drop_system: bool) -> dict:
    """A preference row -> {"kind": "pair", "messages": prompt turns, "chosen": turns, "rejected": turns}.

    Accepted layouts (the common hub ones):
    - `prompt` (string or turns) or `messages` (turns), with `chosen`/`rejected` as strings or as
      lists of assistant turns (TRL's explicit-prompt layout);
    - `chosen`/`rejected` as whole conversations (UltraFeedback-binarized): the turns they share
      are the prompt, the rest are the answers; a `prompt` column beside them is then ignored.
    """
    answers = {name: _answer(row, col[name]) for name in ("chosen", "rejected")}
    whole = all(any(m["role"] != "assistant" for m in turns) for turns in answers.values())
    if whole:
        chosen, rejected = answers["chosen"], answers["rejected"]
        shared = 0
        while shared < min(len(chosen), len(rejected)) and chosen[shared] == rejected[shared]:
            shared += 1
        while shared and chosen[shared - 1]["role"] == "assistant":  # a shared assistant turn ends an answer
            shared -= 1
        prompt, answers = chosen[:shared], {"chosen": chosen[shared:], "rejected": rejected[shared:]}
        if not prompt:
            raise RowError(col["chosen"], "and 'rejected' are conversations that share no prompt turns")
    elif col["messages"] in row and row[col["messages"]] is not None:
        prompt = _turns(row, col["messages"], role_key="role", text_key="content", roles={r: r for r in ROLES})
    elif col["prompt"] in row and isinstance(row[col["prompt"]], list):
        prompt = _turns(row, col["prompt"], role_key="role", text_key="content", roles={r: r for r in ROLES})
    elif col["prompt"] in row and row[col["prompt"]] is not None:
        prompt = [{"role": "user", "content": _string(row, col["prompt"])}]
    else:
        raise RowError(col["prompt"], f"is missing; a pair needs its prompt ('{col['prompt']}' or '{col['messages']}')")
    if drop_system:
        prompt = [m for m in prompt if m["role"] != "system"]
    elif system_prompt is not None and not any(m["role"] == "system" for m in prompt):
        prompt.insert(0, {"role": "system", "content": system_prompt})
    talk = [m["role"] for m in prompt if m["role"] != "system"]
    if not talk or talk[0] != "user":
        raise RowError(col["prompt"], "has no user turn first; the prompt must start with a user turn")
    if talk[-1] == "assistant":
        raise RowError(col["prompt"], "ends with an assistant turn; the answers in chosen/rejected must follow a user turn")
    for name, turns in answers.items():
        if not turns or turns[0]["role"] != "assistant":
            raise RowError(col[name], "has no assistant answer after the prompt")
    if answers["chosen"] == answers["rejected"]:
        raise RowError(col["rejected"], f"is identical to '{col['chosen']}'; the pair has nothing to prefer")
    return {"kind": "pair", "messages": prompt, "chosen": answers["chosen"], "rejected": answers["rejected"],
            "prompt": "", "completion": ""}


def _answer(row: dict, key: str) -> list[dict]:
    """`chosen`/`rejected`: a string is one assistant turn; a list is turns (role/content)."""
    value = row.get(key)
    if isinstance(value, list):
        return _turns(row, key, role_key="role", text_key="content", roles={r: r for r in ROLES})
    return [{"role": "assistant", "content": _string(row, key)}]


def _string(row: dict, key: str, *, optional: bool = False) -> str:
    if key not in row or row[key] is None:
        if optional:
            return ""
        raise RowError(key, "is missing")
    value = row[key]
    if not isinstance(value, str):
        raise RowError(key, f"is a {type(value).__name__}, expected a string")
    return value


def _turns(row: dict, key: str, *, role_key: str, text_key: str, roles: dict[str, str]) -> list[dict]:
    if key not in row or row[key] is None:
        raise RowError(key, "is missing")
    turns = row[key]
    if not isinstance(turns, list) or not turns:
        raise RowError(key, f"must be a non-empty list of turns, got {type(turns).__name__}")
    out = []
    for i, turn in enumerate(turns):
        if not isinstance(turn, dict):
            raise RowError(f"{key}[{i}]", f"is a {type(turn).__name__}, expected an object with {role_key} and {text_key}")
        role = turn.get(role_key) if role_key in turn else None
        if role is None:
            raise RowError(f"{key}[{i}].{role_key}", "is missing")
        if role not in roles:
            raise RowError(f"{key}[{i}].{role_key}", f"is an unknown role {role!r}; use one of {', '.join(sorted(roles))}")
        content = turn[text_key] if text_key in turn else None
        if content is None:
            raise RowError(f"{key}[{i}].{text_key}", "is missing")
        if isinstance(content, list):  # OpenAI content parts: [{"type": "text", "text": ...}]
            if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str) for p in content):
                raise RowError(f"{key}[{i}].{text_key}", "has non-text parts; only text is supported")
            content = "".join(p["text"] for p in content)
        if not isinstance(content, str):
            raise RowError(f"{key}[{i}].{text_key}", f"is a {type(content).__name__}, expected a string")
        out.append({"role": roles[role], "content": content})
    return out
