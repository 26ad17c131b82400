"""Sources: where a recipe's data lives, reading its rows, and mixing sources into the splits.

A source (file, glob, folder, `save_to_disk` directory, cached hub id, `demo:<split>`) yields rows
with a location (file and row number). Each row is converted by its format (formats.py) into a
canonical sample that remembers its origin; a row that cannot be read or converted stops the run
with a one-line `UserError` naming file and row, or is counted and skipped (`data.bad_rows: skip`).
The sources are then limited, split (the eval hold-out), weighted and mixed, deterministically
for a seed. SFT samples and preference pairs are read the same way.

JSON Lines are parsed here, line by line, rather than by `datasets`' JSON loader, whose errors on a
bad line name neither the line nor the field (it reports an Arrow parse error for the whole file).
"""

from __future__ import annotations

import fnmatch
import importlib.resources
import json
import logging
import os
import random
from collections.abc import Iterator
from pathlib import Path

from homelab_ft.data import formats
from homelab_ft.data.report import SourceReport
from homelab_ft.errors import UserError
from homelab_ft.recipe.config import DataConfig, SourceConfig

FILE_TYPES = {".jsonl": "jsonl", ".json": "json", ".csv": "csv", ".parquet": "parquet"}

log = logging.getLogger(__name__)


def check_sources_declared(data_cfg: DataConfig) -> None:
    """Training data is never defaulted: a recipe without `data.sources` would otherwise train on
    whatever a default pointed at and look like it worked."""
    if not data_cfg.sources:
        raise UserError("data.sources is empty: list the training data, e.g. data.sources=[{path: train.jsonl}] "
                        "(the shipped demo task is `path: demo:train`)")


def read_and_mix(data_cfg: DataConfig, *, seed: int, base_dir: Path | None, preference: str | None = None):
    """Canonical samples of every source, mixed by weight, the eval split held out; and the reports.

    `preference`: the format every source must hold when the objective is preference tuning
    (`preference` pairs for DPO and its kin, `unpaired` rows for KTO); None for SFT, whose sources
    must hold neither.
    """
    train_parts, train_reports, eval_parts, eval_reports = [], [], [], []
    for i, src in enumerate(data_cfg.sources):
        samples, fmt, num_rows, skipped, first_error = _read_source(src, data_cfg, where=f"data.sources[{i}]",
                                                                    base_dir=base_dir, preference=preference)
        held_out = []
        if not data_cfg.eval_sources and data_cfg.eval_fraction > 0:
            samples, held_out = hold_out(samples, fraction=data_cfg.eval_fraction, rng=random.Random(f"{seed}:eval:{i}"))
        used = weighted(samples, weight=src.weight, rng=random.Random(f"{seed}:weight:{i}"))
        train_parts += used
        eval_parts += held_out
        train_reports.append(SourceReport(src.path, fmt, num_rows, skipped, len(used), first_error))
    for i, src in enumerate(data_cfg.eval_sources):
        samples, fmt, num_rows, skipped, first_error = _read_source(src, data_cfg, where=f"data.eval_sources[{i}]",
                                                                    base_dir=base_dir, preference=preference)
        eval_parts += samples
        eval_reports.append(SourceReport(src.path, fmt, num_rows, skipped, len(samples), first_error))
    if data_cfg.shuffle:
        random.Random(f"{seed}:mix").shuffle(train_parts)
    return train_parts, train_reports, eval_parts, eval_reports


# --------------------------------------------------------------------------------------------
# reading rows


def resolve_files(path: str, *, base_dir: Path | None, where: str) -> list[Path] | Path | str:
    """A source path -> list of data files, a `save_to_disk` directory (Path), or a hub id (str)."""
    if path.startswith("demo:"):
        split = path.removeprefix("demo:")
        return [Path(str(importlib.resources.files("homelab_ft") / "assets" / "demo" / f"{split}.jsonl"))]
    roots = [base_dir, None] if base_dir is not None else [None]
    for root in roots:
        full = Path(path) if root is None or Path(path).is_absolute() else root / path
        if _is_pattern(path):
            found = sorted(Path(p) for p in set(_glob(str(full))) if Path(p).suffix in FILE_TYPES)
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


def _glob(pattern: str) -> Iterator[str]:
    """What `glob.glob(pattern, recursive=True)` yields, except that `**` does not descend into a
    folder it is already inside: through a symlink loop (`d/up -> d`) glob.glob recursed until the
    path hit the OS limit, ~40 levels with every level multiplying the names, which hung. A link
    that is not a loop is followed, as glob does; names starting with a dot match only a dot."""
    parts = Path(pattern).parts
    if Path(pattern).is_absolute():
        return _glob_from(parts[0], parts[1:], frozenset())
    return _glob_from("", parts, frozenset())


def _glob_from(base: str, parts: tuple[str, ...], inside: frozenset) -> Iterator[str]:
    if not parts:
        yield base
        return
    part, rest = parts[0], parts[1:]
    if not _is_pattern(part):
        path = os.path.join(base, part)
        if os.path.isdir(path) if rest else os.path.lexists(path):
            yield from _glob_from(path, rest, inside)
        return
    if part == "**":
        here = inside | {_identity(base or os.curdir)}
        yield from _glob_from(base, rest, here)
        for name in _names(base, "*"):
            path = os.path.join(base, name)
            if not os.path.isdir(path):
                if not rest:
                    yield path
            elif _identity(path) in here:
                log.info("data glob: not following %s, a link back into a folder it is inside", path)
            else:
                yield from _glob_from(path, parts, here)
        return
    for name in _names(base, part):
        path = os.path.join(base, name)
        if not rest or os.path.isdir(path):
            yield from _glob_from(path, rest, inside)


def _is_pattern(text: str) -> bool:
    """glob's wildcards: `*`, `?` and `[...]`."""
    return any(ch in text for ch in "*?[")


def _names(base: str, part: str) -> list[str]:
    try:
        names = os.listdir(base or os.curdir)
    except OSError:  # unreadable or vanished, as glob.glob skips it
        return []
    return [n for n in fnmatch.filter(names, part) if part.startswith(".") or not n.startswith(".")]


def _identity(path: str) -> tuple[int, int] | None:
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_dev, st.st_ino


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
# one source's samples, the hold-out and the weights


class BadRows:
    """`data.bad_rows` for one source: a row that cannot be read or converted stops the run naming file
    and row (`fail`), or is counted and left out, its first message kept for the report (`skip`)."""

    def __init__(self, rule: str):
        self.rule, self.skipped, self.first = rule, 0, None

    def __call__(self, file: str, number: int, message: str) -> None:
        line = f"{file}: row {number}: {message}" if message.startswith("field") else f"{file}: row {number} {message}"
        if self.rule == "fail":
            raise UserError(line + "; fix the row or set data.bad_rows=skip")
        self.skipped += 1
        self.first = self.first or line

    def none_left(self, where: str, path: str) -> UserError:
        return UserError(f"{where}: every row of {path} is malformed ({self.skipped} skipped); first: {self.first}")


def source_rows(src: SourceConfig, cfg: DataConfig, *, where: str, base_dir: Path | None):
    """Every row of one source that parses, as (file, row number, row); the source's `BadRows` (which
    has counted the rows that did not parse); and the rows the source holds, those included."""
    bad = BadRows(cfg.bad_rows)
    target = resolve_files(src.path, base_dir=base_dir, where=where)
    rows = list(read_rows(target, split=src.split, where=where, on_bad=bad))
    if not rows:
        raise UserError(f"{where}: {src.path} has no readable rows ({bad.skipped} skipped as malformed)")
    return rows, bad, len(rows) + bad.skipped


def _read_source(src: SourceConfig, cfg: DataConfig, *, where: str, base_dir: Path | None,
                 preference: str | None = None):
    """Canonical samples of one source, its format, rows in it, the skipped-row count, first skip message."""
    rows, bad, num_rows = source_rows(src, cfg, where=where, base_dir=base_dir)
    columns = set().union(*(row.keys() for _, _, row in rows))
    fmt = src.format
    if fmt == "auto":
        fmt = formats.detect_format(columns | {ours for ours, theirs in src.fields.items() if theirs in columns}, where=where)
    if preference == "preference" and fmt != "preference":
        also = "; unpaired rows (completion, label) train with dpo.loss=kto" if fmt == "unpaired" else ""
        raise UserError(f"{where}: objective=dpo trains on preference pairs, but {src.path} has no chosen and rejected "
                        f"columns (format {fmt}, columns {sorted(columns)}); map them with fields: {{chosen: ..., rejected: ...}}"
                        + also)
    if preference == "unpaired" and fmt != "unpaired":
        raise UserError(f"{where}: dpo.loss=kto trains on unpaired rows, but {src.path} has no completion and label "
                        f"columns (format {fmt}, columns {sorted(columns)}); map them with fields: {{completion: ..., "
                        "label: ...}}, or use another dpo.loss for pairs")
    if preference is None and fmt in ("preference", "unpaired"):
        raise UserError(f"{where}: {src.path} holds {'preference pairs' if fmt == 'preference' else 'unpaired preference rows'} ({fmt}); set objective: dpo to train on "
                        "them, or format: chat for its messages")
    formats.check_fields(src.fields, fmt, columns, where=where)
    samples = []
    for file, number, row in rows:
        if src.limit is not None and len(samples) >= src.limit:
            break
        try:
            sample = formats.to_sample(row, fmt, src.fields, system_prompt=cfg.system_prompt, drop_system=cfg.drop_system_prompt,
                                       images=cfg.images, image_dir=_folder_of(file))
        except formats.RowError as err:
            bad(file, number, str(err))
            continue
        sample["origin"] = f"{file}: row {number}"
        samples.append(sample)
    if not samples:
        raise bad.none_left(where, src.path)
    return samples, fmt, num_rows, bad.skipped, bad.first


def _folder_of(name: str) -> Path:
    """Where a row's relative image paths start: its data file's folder, or a `save_to_disk` folder
    itself (read_rows names rows by file or folder; a hub id's rows start in the working directory)."""
    path = Path(name)
    return path if path.is_dir() else path.parent


def hold_out(samples: list[dict], *, fraction: float, rng: random.Random):
    """Split off round(n * fraction) samples at random positions; both parts keep file order."""
    held = set(rng.sample(range(len(samples)), round(len(samples) * fraction)))
    return [s for i, s in enumerate(samples) if i not in held], [s for i, s in enumerate(samples) if i in held]


def weighted(samples: list[dict], *, weight: float, rng: random.Random) -> list[dict]:
    """`weight` copies of the source: whole repeats, then a random subset for the fraction."""
    whole, part = divmod(round(len(samples) * weight), len(samples))
    return samples * whole + rng.sample(samples, part)
