"""Token rows, one set of rules for SFT samples and preference pairs: the cached tokenising map,
the fit to `data.max_length`, the kept-rows count and the padding into a batch.

A pipeline (sft.py, pairs.py) brings its canonical samples and an encoder, the map function that
renders a batch of samples, tokenises it with offsets, labels the trained spans and writes a
status per sample. `tokenize` runs the encoder through `datasets.Dataset.map` with a cache file
named by a fingerprint of the samples, tokenizer, template and settings, so a re-run does not
tokenise again. `kept` keeps the OK and TRUNCATED samples and counts every status for the report.
A sample is one token row (`input_ids`, `labels`) or, for a pair, one per side
(`chosen_input_ids`, ...).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from homelab_ft.errors import UserError
from homelab_ft.labels import IGNORE_INDEX
from homelab_ft.recipe.config import DataConfig

if TYPE_CHECKING:
    import datasets

CACHE_VERSION = "1"
"""Bump when tokenisation changes, so caches written by older code are not reused."""
TOKENIZE_BATCH_ROWS = 512
# status codes written by the tokenising map, in rising severity: a pair takes its worse side's;
# the last two are image rows' (image_rows.py): an unreadable image, a cut that would fall in an image
OK, TRUNCATED, TOO_LONG, NO_TARGET, BAD_TEMPLATE, BAD_IMAGE, CUT_IMAGE = 0, 1, 2, 3, 4, 5, 6
STATUSES = (OK, TRUNCATED, TOO_LONG, NO_TARGET, BAD_TEMPLATE, BAD_IMAGE, CUT_IMAGE)
KEPT = (OK, TRUNCATED)


@dataclass(frozen=True)
class RowKind:
    """What the SFT samples' and the preference pairs' tokenised rows differ in."""

    cache_prefix: str
    """The cache file is `<cache_prefix>-<fingerprint>.arrow`."""
    fingerprint_tag: tuple[bytes, ...]
    """Hashed after the version: empty for samples, whose key predates pairs, so their caches stay valid."""
    turn_columns: tuple[str, ...]
    """The sample's columns that hold chat turns (role, content)."""
    sides: tuple[str, ...]
    """Token rows per sample: side "" is `input_ids`/`labels`, side s is `s_input_ids`/`s_labels`."""
    desc: str
    """The progress bar's label."""
    kept_columns: tuple[str, ...] = ()
    """Boolean columns of the sample kept beside its token rows (an unpaired row's `label`)."""
    text_columns: tuple[str, ...] = ()
    """String columns of the sample the map reads and replaces (an image row's `conversation`)."""

    def token_columns(self) -> list[str]:
        return [column(side, name) for side in self.sides for name in ("input_ids", "labels")]

    def sample_columns(self) -> list[str]:
        """The canonical sample's columns that the map replaces by token rows (all but `origin`)."""
        return ["kind", *self.turn_columns, "prompt", "completion", *self.text_columns]


def column(side: str, name: str) -> str:
    return f"{side}_{name}" if side else name


def tokenize(samples: list[dict], tokenizer, *, kind: RowKind, encode, settings: list, cfg: DataConfig):
    """Tokenise `samples` with `encode` through datasets.map, cached under a fingerprint of
    everything that matters: the samples, the tokenizer and `settings` (the template and every
    data.* key the encoder reads). Returns the dataset and whether it came from the cache."""
    import datasets
    from datasets.fingerprint import Hasher

    if not getattr(tokenizer, "is_fast", False):
        raise UserError("the tokenizer is not a fast (Rust) tokenizer; the loss mask needs its offset mapping")
    fingerprint = Hasher.hash_bytes([
        CACHE_VERSION.encode(), *kind.fingerprint_tag,
        json.dumps(samples, ensure_ascii=False).encode(),
        tokenizer.backend_tokenizer.to_str().encode(),
        json.dumps(settings).encode(),
    ])
    cache_dir = Path(cfg.cache_dir) if cfg.cache_dir else Path(datasets.config.HF_DATASETS_CACHE) / "homelab_ft"
    if cfg.cache_dir and any(part.exists() and not part.is_dir() for part in (cache_dir, *cache_dir.parents)):
        raise UserError(f"data.cache_dir: {cache_dir} is (inside) a file, not a directory; point it at a folder")
    cache_dir.mkdir(parents=True, exist_ok=True)
    cache_file = cache_dir / f"{kind.cache_prefix}-{fingerprint}.arrow"
    hit = cache_file.is_file()
    text = datasets.Value("string")
    turns = [{"role": text, "content": text}]
    features = datasets.Features({
        "kind": text, **{name: turns for name in kind.turn_columns},
        "prompt": text, "completion": text, "origin": text,
        **{name: datasets.Value("bool") for name in kind.kept_columns}, **{name: text for name in kind.text_columns},
    })
    ds = datasets.Dataset.from_list(samples, features=features)
    ds = ds.map(
        encode,
        batched=True,
        batch_size=TOKENIZE_BATCH_ROWS,
        remove_columns=kind.sample_columns(),
        new_fingerprint=fingerprint,
        cache_file_name=str(cache_file),
        load_from_cache_file=True,
        desc=kind.desc,
    )
    return ds, hit


def fit_row(ids: list[int], labels: list[int], cfg: DataConfig) -> tuple[list[int], list[int], int]:
    """One tokenised row cut to `data.max_length` (or dropped, `overlong: drop`), with its status;
    a row left with no trained token is NO_TARGET. SFT samples and each side of a DPO pair."""
    status = OK
    if len(ids) > cfg.max_length:
        if cfg.overlong == "drop":
            return [], [], TOO_LONG
        ids, labels, status = ids[: cfg.max_length], labels[: cfg.max_length], TRUNCATED
    if all(x == IGNORE_INDEX for x in labels):
        return [], [], NO_TARGET
    return ids, labels, status


@dataclass(frozen=True)
class Kept:
    """The usable samples of a tokenised split and what the report counts of it."""

    rows: datasets.Dataset
    """The kept samples' token columns (and what the map wrote beside them: an image row's images)."""
    counts: dict[int, int]
    """Samples of each status, kept or not."""
    lengths: np.ndarray
    """Token count of every kept row (int64): a pair's sides one after the other, all chosen rows first."""
    num_trained_tokens: int
    """Tokens that carry loss (label != -100) in the kept rows."""


def kept(ds, *, kind: RowKind) -> Kept:
    """The usable samples, the count of each status, their rows' lengths and the trained-token total.

    Read through Arrow compute on the (memory-mapped) columns: converting 10k token lists to
    Python just to count them took longer than packing them.
    """
    import pyarrow as pa
    import pyarrow.compute as pc

    table = ds.with_format("arrow")[:]
    status = table.column("status").to_numpy()
    counts = {code: int(np.count_nonzero(status == code)) for code in STATUSES}
    keep = np.isin(status, KEPT)
    lengths, num_trained = [], 0
    for side in kind.sides:
        ids = table.column(column(side, "input_ids"))
        lengths.append(pc.list_value_length(ids).to_numpy(zero_copy_only=False)[keep])
        labels = pc.list_flatten(table.column(column(side, "labels")).filter(pa.array(keep)))
        num_trained += int(pc.sum(pc.not_equal(labels, IGNORE_INDEX)).as_py() or 0)
    rows = ds.select(np.flatnonzero(keep)).remove_columns(["status", "origin"])
    return Kept(rows=rows, counts=counts, lengths=np.concatenate(lengths).astype(np.int64), num_trained_tokens=num_trained)


def empty_reason(counts: dict[int, int], cfg: DataConfig, *, unit: str) -> str:
    """Why no `unit` (sample, pair) is left to train on, and which setting to change."""
    if counts[TOO_LONG] and not counts[NO_TARGET]:
        return (f"every {unit} is longer than data.max_length={cfg.max_length} tokens and overlong=drop removed all "
                f"{counts[TOO_LONG]}; raise data.max_length or set data.overlong=truncate")
    if counts[NO_TARGET]:
        return (f"no {unit} has a trained token within data.max_length={cfg.max_length} ({counts[NO_TARGET]} lost their "
                f"answer to truncation, {counts[TOO_LONG]} too long); raise data.max_length")
    bad_images = f", {counts[BAD_IMAGE]} with an unreadable image" if counts[BAD_IMAGE] else ""
    return f"no usable training {unit} ({counts[BAD_TEMPLATE]} could not be rendered by the chat template{bad_images})"


def collate(rows: list[dict], *, pad_token_id: int, pixels=None) -> dict:
    """Pad rows to the longest one: input_ids with `pad_token_id`, labels with -100.

    Image rows (`pixels`: image_rows.PixelBatcher) also get the per-token columns their processor
    wrote (padded with 0, "no image") and their images' pixel inputs.

    Unpacked rows get an `attention_mask` (1 = real token). Packed rows (they carry position_ids)
    get `position_ids` and NO attention_mask: transformers only derives the per-sample block mask
    from position ids when attention_mask is None (see packing.py). Padding at the end of a packed
    row gets positions 0, 1, ... of its own, so it forms a segment that no real token attends to.
    """
    import torch

    width = max(len(r["input_ids"]) for r in rows)
    input_ids = torch.full((len(rows), width), pad_token_id, dtype=torch.long)
    labels = torch.full((len(rows), width), IGNORE_INDEX, dtype=torch.long)
    packed = "position_ids" in rows[0]
    extra = torch.zeros((len(rows), width), dtype=torch.long)
    for b, row in enumerate(rows):
        n = len(row["input_ids"])
        input_ids[b, :n] = torch.as_tensor(row["input_ids"], dtype=torch.long)
        labels[b, :n] = torch.as_tensor(row["labels"], dtype=torch.long)
        if packed:
            extra[b, :n] = torch.as_tensor(row["position_ids"], dtype=torch.long)
            extra[b, n:] = torch.arange(width - n)
        else:
            extra[b, :n] = 1
    batch = {"input_ids": input_ids, "labels": labels, ("position_ids" if packed else "attention_mask"): extra}
    if pixels is None:
        return batch
    for key in pixels.token_columns(rows[0]):
        padded = torch.zeros((len(rows), width), dtype=torch.long)
        for b, row in enumerate(rows):
            padded[b, :len(row[key])] = torch.as_tensor(row[key], dtype=torch.long)
        batch[key] = padded
    return {**batch, **pixels(rows)}


def kept_splits(train_parts: list[dict], eval_parts: list[dict], *, tokenize, kind: RowKind, cfg: DataConfig,
                unit: str) -> tuple[Kept, Kept | None, bool]:
    """The training and held-out parts through `tokenize` (the pipeline's cached map) and the
    kept-rows rule: (train, eval or None, every split a cache hit). An empty training split is
    refused here, with what dropped its rows, so SFT and pairs say it the same way."""
    train, train_hit = tokenize(train_parts)
    train = kept(train, kind=kind)
    if len(train.rows) == 0:
        raise UserError(empty_reason(train.counts, cfg, unit=unit))
    if not eval_parts:
        return train, None, train_hit
    held_out, eval_hit = tokenize(eval_parts)
    return train, kept(held_out, kind=kind), train_hit and eval_hit


def report_counts(train: Kept) -> dict:
    """The DataReport fields both pipelines fill from the kept training split the same way."""
    lengths = train.lengths.tolist()
    return {"num_train_tokens": sum(lengths), "num_trained_tokens": train.num_trained_tokens,
            "num_truncated": train.counts[TRUNCATED], "num_dropped_overlong": train.counts[TOO_LONG],
            "num_dropped_no_target": train.counts[NO_TARGET], "num_bad_template": train.counts[BAD_TEMPLATE],
            "sample_lengths": tuple(lengths)}
