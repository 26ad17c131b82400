"""The token lengths of a recipe's prepared training rows, kept so `plan` can price a step at them.

A CPU step is priced by the tokens it computes, and a micro-batch is padded to its longest row
(rows.collate), not to `data.max_length`: the demo's SFT rows are 70-88 tokens under max_length 128,
so pricing every row at 128 made smollm2-lora-cpu's plan ~1.45x slow, its DPO pairs (~80 of 160)
~1.8x (issue 39). Preparing the data (`prepare_for`: train, `data inspect`) measures the lengths
anyway (DataReport.sample_lengths); `store` keeps them as a histogram under locate.cache_root, and
`stored` reads them back for the CLI, which hands them to the planner as an input
(plan.inputs.RowLengths): the planner reads no files. The key is what decides the lengths: the
objective, the data settings, the model (its tokenizer and template) and each local data file's
size and modification time, so an edited file is measured again.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
from collections import Counter
from pathlib import Path

from homelab_ft import fsio
from homelab_ft.data.report import DataReport
from homelab_ft.data.sources import resolve_files
from homelab_ft.errors import UserError
from homelab_ft.locate import cache_root
from homelab_ft.recipe.config import Recipe

log = logging.getLogger(__name__)


def row_lengths(recipe: Recipe, report: DataReport) -> list[int] | None:
    """What one training row's padded width is made of: an SFT sample's tokens, the longer side of a
    preference pair (its chosen and rejected rows share the batch's width), a GRPO prompt's tokens;
    None for packed rows (each is data.max_length already)."""
    lengths = list(report.sample_lengths)
    if report.packed or not lengths:
        return None
    if recipe.objective == "dpo":  # all chosen rows first, then the rejected ones (rows.Kept.lengths)
        half = len(lengths) // 2
        return [max(c, r) for c, r in zip(lengths[:half], lengths[half:], strict=True)]
    return lengths


def key(recipe: Recipe, *, base_dir: Path | None) -> str | None:
    """The cache entry's name; None when a source cannot be resolved here (then nothing is kept)."""
    data = {k: v for k, v in dataclasses.asdict(recipe.data).items() if k != "cache_dir"}
    files = []
    try:
        for i, src in enumerate(recipe.data.sources):
            target = resolve_files(src.path, base_dir=base_dir, where=f"data.sources[{i}]")
            paths = [target] if isinstance(target, (str, Path)) else target
            for p in paths:
                stat = Path(p).stat() if isinstance(p, Path) and Path(p).is_file() else None
                files.append([str(p), stat.st_size if stat else None, stat.st_mtime_ns if stat else None])
    except (UserError, OSError):
        return None
    text = json.dumps([recipe.objective, recipe.model.path, data, files], sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:32]


def _path(entry: str) -> Path:
    return cache_root() / "row_lengths" / f"{entry}.json"


def store(recipe: Recipe, report: DataReport, *, base_dir: Path | None) -> None:
    """Keep the training rows' lengths (row_lengths) as {length: rows}, and for image rows their
    (images, image tokens) as {(images, image tokens): rows}; a failure only logs."""
    lengths = row_lengths(recipe, report)
    entry = key(recipe, base_dir=base_dir)
    if lengths is None or entry is None:
        return
    path = _path(entry)
    kept = {"rows": len(lengths), "counts": sorted(Counter(lengths).items())}
    if report.image_rows:
        kept["images"] = [[n, tokens, rows] for (n, tokens), rows in sorted(Counter(report.image_rows).items())]
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fsio.replace_text(path, json.dumps(kept))
    except OSError as err:
        log.warning("could not keep the data's row lengths in %s (%s); plans price rows at data.max_length",
                    path.parent, err)


def stored(recipe: Recipe, *, base_dir: Path | None) -> tuple[tuple[int, int], ...] | None:
    """The (length, rows) pairs `store` kept for this recipe's data, shortest first; None when the data
    was not prepared here since it last changed."""
    kept = _kept(recipe, base_dir=base_dir)
    return None if kept is None else tuple((int(length), int(n)) for length, n in kept["counts"])


def stored_images(recipe: Recipe, *, base_dir: Path | None) -> tuple[tuple[int, int, int], ...] | None:
    """The (images, image tokens, rows) triples `store` kept for this recipe's image rows, fewest
    images first; None when its data holds no image rows or was not prepared here since it last changed."""
    kept = _kept(recipe, base_dir=base_dir)
    if kept is None or "images" not in kept:
        return None
    return tuple((int(n), int(tokens), int(rows)) for n, tokens, rows in kept["images"])


def _kept(recipe: Recipe, *, base_dir: Path | None) -> dict | None:
    entry = key(recipe, base_dir=base_dir)
    if entry is None:
        return None
    try:
        kept = json.loads(_path(entry).read_text())
        kept["counts"] = [(int(length), int(n)) for length, n in kept["counts"]]
        return kept
    except FileNotFoundError:
        return None
    except (OSError, ValueError, TypeError, KeyError) as err:
        log.warning("ignoring the unreadable row lengths %s (%s)", _path(entry), err)
        return None
