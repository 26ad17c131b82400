"""Data: sources -> formats -> chat template -> tokens + loss mask -> truncate/drop -> pack -> collate.

`prepare_data` is the one entry point the trainer calls. It reads and checks every source
(formats.py), mixes them by weight and limit, holds out the eval split, tokenises with the loss
mask (templates.py) through `datasets.Dataset.map` with a cache file named by a fingerprint of
the samples, tokenizer, template and settings (so a re-run does not tokenise again), and packs
(packing.py). The trainer shuffles and shards the final rows itself, per epoch; the order here is
only the deterministic mix of sources.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from homelab_ft.config import DataConfig, SourceConfig
from homelab_ft.data import formats, packing, templates
from homelab_ft.data.templates import IGNORE_INDEX
from homelab_ft.errors import UserError

if TYPE_CHECKING:
    import datasets

CACHE_VERSION = "1"
"""Bump when tokenisation changes, so caches written by older code are not reused."""
TOKENIZE_BATCH_ROWS = 512
# status codes written by the tokenising map
OK, TRUNCATED, TOO_LONG, NO_TARGET, BAD_TEMPLATE = 0, 1, 2, 3, 4


@dataclass(frozen=True)
class SourceReport:
    name: str
    """The recipe's path for this source."""
    format: str
    num_rows_read: int
    """Rows in the source, malformed ones included."""
    num_rows_skipped: int
    """Malformed rows left out under `data.bad_rows: skip`."""
    num_samples: int
    """Samples this source contributes to its split, after limit, eval hold-out and weight."""
    first_error: str | None = None
    """The first skipped row's message, so a user sees what kind of rows were skipped."""


@dataclass(frozen=True)
class DataReport:
    sources: tuple[SourceReport, ...]
    eval_sources: tuple[SourceReport, ...]
    num_train_samples: int
    """Tokenised training samples kept (after truncation/dropping, before packing)."""
    num_eval_samples: int
    num_train_rows: int
    """Rows the trainer batches: packed rows when packing, else samples."""
    num_train_tokens: int
    num_trained_tokens: int
    """Training tokens that carry loss (label != -100)."""
    num_truncated: int
    num_dropped_overlong: int
    num_dropped_no_target: int
    """Samples with no trained token left (e.g. the prompt alone fills max_length)."""
    num_bad_template: int
    """Samples the chat template could not render into exact spans (skipped under bad_rows: skip)."""
    max_length: int
    packed: bool
    non_pad_fraction: float
    """Real tokens / (rows x max_length) of the training rows: the packing efficiency."""
    sample_lengths: tuple[int, ...]
    """Token count of every kept training sample (for the length histogram)."""
    cache_hit: bool
    """True when every tokenised split came from the cache instead of being tokenised again."""
    pairs: bool = False
    """Preference pairs (objective: dpo): samples are pairs, tokens and lengths count both answers' rows."""


    def summary(self) -> str:
        """One line for the training log: what was kept, cut and left out."""
        skipped = sum(s.num_rows_skipped for s in self.sources + self.eval_sources)
        packed = f"; packed into {self.num_train_rows} rows, {self.non_pad_fraction:.1%} non-pad" if self.packed else ""
        return (
            f"data: {self.num_train_samples} training {'pairs' if self.pairs else 'samples'} ({self.num_train_tokens:,} tokens, "
            f"{self.num_trained_tokens:,} with loss), {self.num_eval_samples} eval; truncated {self.num_truncated}, "
            f"dropped {self.num_dropped_overlong} too long and {self.num_dropped_no_target} with nothing to learn, "
            f"skipped {skipped} bad rows{packed}{' (tokenised data from the cache)' if self.cache_hit else ''}"
        )


@dataclass(frozen=True)
class PreparedData:
    train: datasets.Dataset
    """Rows with input_ids, labels (-100 = no loss) and, when packed, position_ids."""
    eval: datasets.Dataset | None
    report: DataReport


def check_sources_declared(data_cfg: DataConfig) -> None:
    """Training data is never defaulted: a recipe without `data.sources` would otherwise train on
    whatever a default pointed at and look like it worked."""
    if not data_cfg.sources:
        raise UserError("data.sources is empty: list the training data, e.g. data.sources=[{path: train.jsonl}] "
                        "(the shipped demo task is `path: demo:train`)")


def prepare_data(data_cfg: DataConfig, tokenizer, *, seed: int, base_dir: Path | None = None) -> PreparedData:
    """Read, check, mix, split, tokenise (cached) and pack the recipe's data."""
    check_sources_declared(data_cfg)
    template = templates.resolve_template(tokenizer, data_cfg.chat_template, base_dir=base_dir)
    train_parts, train_reports, eval_parts, eval_reports = read_and_mix(data_cfg, seed=seed, base_dir=base_dir)

    train, train_hit = _tokenize(train_parts, tokenizer, template, data_cfg)
    train, counts, lengths, num_trained = _kept(train)
    if len(train) == 0:
        raise UserError(_empty_reason(counts, data_cfg))
    eval_ds, eval_hit, num_eval = None, True, 0
    if eval_parts:
        eval_ds, eval_hit = _tokenize(eval_parts, tokenizer, template, data_cfg)
        eval_ds, _, eval_lengths, _ = _kept(eval_ds)
        num_eval = len(eval_ds)
        eval_ds = _finish(eval_ds, eval_lengths, data_cfg, seed=seed) if num_eval else None

    lengths = lengths.tolist()
    train = _finish(train, lengths, data_cfg, seed=seed)
    report = DataReport(
        sources=tuple(train_reports),
        eval_sources=tuple(eval_reports),
        num_train_samples=len(lengths),
        num_eval_samples=num_eval,
        num_train_rows=len(train),
        num_train_tokens=sum(lengths),
        num_trained_tokens=num_trained,
        num_truncated=counts[TRUNCATED],
        num_dropped_overlong=counts[TOO_LONG],
        num_dropped_no_target=counts[NO_TARGET],
        num_bad_template=counts[BAD_TEMPLATE],
        max_length=data_cfg.max_length,
        packed=data_cfg.packing,
        non_pad_fraction=packing.non_pad_fraction(lengths, num_rows=len(train), max_length=data_cfg.max_length),
        sample_lengths=tuple(lengths),
        cache_hit=train_hit and eval_hit,
    )
    return PreparedData(train=train, eval=eval_ds, report=report)


def read_and_mix(data_cfg: DataConfig, *, seed: int, base_dir: Path | None, pairs: bool = False):
    """Canonical samples of every source, mixed by weight, the eval split held out; and the reports.

    `pairs`: the objective trains on preference pairs (DPO), so every source must hold them.
    """
    train_parts, train_reports, eval_parts, eval_reports = [], [], [], []
    for i, src in enumerate(data_cfg.sources):
        samples, fmt, num_rows, skipped, first_error = _read_source(src, data_cfg, where=f"data.sources[{i}]",
                                                                    base_dir=base_dir, pairs=pairs)
        held_out = []
        if not data_cfg.eval_sources and data_cfg.eval_fraction > 0:
            samples, held_out = _hold_out(samples, fraction=data_cfg.eval_fraction, rng=random.Random(f"{seed}:eval:{i}"))
        used = _weighted(samples, weight=src.weight, rng=random.Random(f"{seed}:weight:{i}"))
        train_parts += used
        eval_parts += held_out
        train_reports.append(SourceReport(src.path, fmt, num_rows, skipped, len(used), first_error))
    for i, src in enumerate(data_cfg.eval_sources):
        samples, fmt, num_rows, skipped, first_error = _read_source(src, data_cfg, where=f"data.eval_sources[{i}]",
                                                                    base_dir=base_dir, pairs=pairs)
        eval_parts += samples
        eval_reports.append(SourceReport(src.path, fmt, num_rows, skipped, len(samples), first_error))
    if data_cfg.shuffle:
        random.Random(f"{seed}:mix").shuffle(train_parts)
    return train_parts, train_reports, eval_parts, eval_reports


def prepare_for(recipe, tokenizer, *, base_dir: Path | None = None) -> PreparedData:
    """The data a recipe trains on: samples for SFT, preference pairs for DPO."""
    if recipe.objective == "dpo":
        from homelab_ft.data.pairs import prepare_pairs

        return prepare_pairs(recipe.data, tokenizer, seed=recipe.train.seed, base_dir=base_dir)
    return prepare_data(recipe.data, tokenizer, seed=recipe.train.seed, base_dir=base_dir)


def collate(rows: list[dict], *, pad_token_id: int) -> dict:
    """Pad rows to the longest one: input_ids with `pad_token_id`, labels with -100.

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
    return {"input_ids": input_ids, "labels": labels, ("position_ids" if packed else "attention_mask"): extra}


# --------------------------------------------------------------------------------------------
# reading and mixing


def _read_source(src: SourceConfig, cfg: DataConfig, *, where: str, base_dir: Path | None, pairs: bool = False):
    """Canonical samples of one source, its format, rows in it, the skipped-row count, first skip message."""
    skipped = 0  # rows that could not be parsed (counted as they are met) plus rows that fail their format
    first_error: list[str] = []

    def bad(file: str, number: int, message: str) -> None:
        nonlocal skipped
        line = f"{file}: row {number} {message}" if not message.startswith("field") else f"{file}: row {number}: {message}"
        if cfg.bad_rows == "fail":
            raise UserError(line + "; fix the row or set data.bad_rows=skip")
        skipped += 1
        first_error[:1] = first_error[:1] or [line]

    target = formats.resolve_files(src.path, base_dir=base_dir, where=where)
    rows = list(formats.read_rows(target, split=src.split, where=where, on_bad=bad))
    num_rows = len(rows) + skipped
    if not rows:
        raise UserError(f"{where}: {src.path} has no readable rows ({skipped} skipped as malformed)")
    columns = set().union(*(row.keys() for _, _, row in rows))
    fmt = src.format
    if fmt == "auto":
        fmt = formats.detect_format(columns | {ours for ours, theirs in src.fields.items() if theirs in columns}, where=where)
    if pairs and fmt != "preference":
        raise UserError(f"{where}: objective=dpo trains on preference pairs, but {src.path} has no chosen and rejected "
                        f"columns (format {fmt}, columns {sorted(columns)}); map them with fields: {{chosen: ..., rejected: ...}}")
    if not pairs and fmt == "preference":
        raise UserError(f"{where}: {src.path} holds preference pairs (chosen, rejected); set objective: dpo to train on "
                        "them, or format: chat for its messages")
    formats.check_fields(src.fields, fmt, columns, where=where)
    samples = []
    for file, number, row in rows:
        if src.limit is not None and len(samples) >= src.limit:
            break
        try:
            sample = formats.to_sample(row, fmt, src.fields, system_prompt=cfg.system_prompt, drop_system=cfg.drop_system_prompt)
        except formats.RowError as err:
            bad(file, number, str(err))
            continue
        sample["origin"] = f"{file}: row {number}"
        samples.append(sample)
    if not samples:
        raise UserError(f"{where}: every row of {src.path} is malformed ({skipped} skipped); first: {first_error[0]}")
    return samples, fmt, num_rows, skipped, (first_error[0] if first_error else None)


def _hold_out(samples: list[dict], *, fraction: float, rng: random.Random):
    """Split off round(n * fraction) samples at random positions; both parts keep file order."""
    held = set(rng.sample(range(len(samples)), round(len(samples) * fraction)))
    return [s for i, s in enumerate(samples) if i not in held], [s for i, s in enumerate(samples) if i in held]


def _weighted(samples: list[dict], *, weight: float, rng: random.Random) -> list[dict]:
    """`weight` copies of the source: whole repeats, then a random subset for the fraction."""
    whole, part = divmod(round(len(samples) * weight), len(samples))
    return samples * whole + rng.sample(samples, part)


# --------------------------------------------------------------------------------------------
# tokenising (cached) and finishing


def _tokenize(samples: list[dict], tokenizer, template: str | None, cfg: DataConfig):
    """Tokenise with labels through datasets.map, cached under a fingerprint of everything that matters."""
    import datasets
    from datasets.fingerprint import Hasher

    if not getattr(tokenizer, "is_fast", False):
        raise UserError("the tokenizer is not a fast (Rust) tokenizer; the loss mask needs its offset mapping")
    fingerprint = Hasher.hash_bytes([
        CACHE_VERSION.encode(),
        json.dumps(samples, ensure_ascii=False).encode(),
        tokenizer.backend_tokenizer.to_str().encode(),
        json.dumps([template, tokenizer.eos_token, cfg.max_length, cfg.overlong, cfg.train_on_inputs, cfg.bad_rows]).encode(),
    ])
    cache_dir = Path(cfg.cache_dir) if cfg.cache_dir else Path(datasets.config.HF_DATASETS_CACHE) / "homelab_ft"
    cache_dir.mkdir(parents=True, exist_ok=True)
    cache_file = cache_dir / f"tokenized-{fingerprint}.arrow"
    hit = cache_file.is_file()
    features = datasets.Features({
        "kind": datasets.Value("string"),
        "messages": [{"role": datasets.Value("string"), "content": datasets.Value("string")}],
        "prompt": datasets.Value("string"),
        "completion": datasets.Value("string"),
        "origin": datasets.Value("string"),
    })
    ds = datasets.Dataset.from_list(samples, features=features)
    encode = _Encoder(tokenizer, template, cfg)
    ds = ds.map(
        encode,
        batched=True,
        batch_size=TOKENIZE_BATCH_ROWS,
        remove_columns=["kind", "messages", "prompt", "completion"],
        new_fingerprint=fingerprint,
        cache_file_name=str(cache_file),
        load_from_cache_file=True,
        desc="tokenising",
    )
    return ds, hit


class _Encoder:
    """The map function: render, tokenise with offsets, labels from spans, truncate or drop."""

    def __init__(self, tokenizer, template: str | None, cfg: DataConfig):
        self.tokenizer, self.template, self.cfg = tokenizer, template, cfg

    def __call__(self, batch: dict[str, list]) -> dict[str, list]:
        n = len(batch["kind"])
        out = {"input_ids": [[] for _ in range(n)], "labels": [[] for _ in range(n)], "status": [OK] * n}
        for kind, add_special in (("chat", False), ("text", True)):
            picked = [i for i in range(n) if batch["kind"][i] == kind]
            rendered = {i: self._render(batch, i) for i in picked}
            for i in picked:
                if rendered[i] is None:
                    out["status"][i] = BAD_TEMPLATE
            good = [i for i in picked if rendered[i] is not None]
            if not good:
                continue
            # The template already writes BOS where the model wants one, so chat text is tokenised
            # without adding special tokens (as transformers' apply_chat_template does).
            enc = self.tokenizer([rendered[i][0] for i in good], add_special_tokens=add_special, return_offsets_mapping=True)
            for j, i in enumerate(good):
                ids = enc["input_ids"][j]
                labels = templates.labels_from_spans(ids, enc["offset_mapping"][j], rendered[i][1])
                out["input_ids"][i], out["labels"][i], out["status"][i] = self._fit(ids, labels)
        return out

    def _render(self, batch, i):
        cfg = self.cfg
        if batch["kind"][i] == "text":
            return templates.text_spans(batch["prompt"][i], batch["completion"][i], eos_token=self.tokenizer.eos_token, train_on_inputs=cfg.train_on_inputs or not batch["prompt"][i])
        if self.template is None:
            raise UserError("the tokenizer has no chat template; set data.chat_template (e.g. chatml) or use format: prompt_completion")
        try:
            return templates.chat_spans(self.tokenizer, self.template, batch["messages"][i], train_on_inputs=cfg.train_on_inputs)
        except templates.SpanError as err:
            if cfg.bad_rows == "fail":
                raise UserError(f"{batch['origin'][i]}: {err}") from None
            return None

    def _fit(self, ids: list[int], labels: list[int]):
        return fit_row(ids, labels, self.cfg)


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


def _kept(ds):
    """The usable samples, the count of each status, their lengths and trained-token total.

    Read through Arrow compute on the (memory-mapped) columns: converting 10k token lists to
    Python just to count them took longer than packing them.
    """
    import pyarrow as pa
    import pyarrow.compute as pc

    table = ds.with_format("arrow")[:]
    status = table.column("status").to_numpy()
    counts = {code: int(np.count_nonzero(status == code)) for code in (OK, TRUNCATED, TOO_LONG, NO_TARGET, BAD_TEMPLATE)}
    keep = (status == OK) | (status == TRUNCATED)
    lengths = pc.list_value_length(table.column("input_ids")).to_numpy(zero_copy_only=False)[keep].astype(np.int64)
    labels = pc.list_flatten(table.column("labels").filter(pa.array(keep)))
    num_trained = int(pc.sum(pc.not_equal(labels, IGNORE_INDEX)).as_py() or 0)
    return ds.select(np.flatnonzero(keep)), counts, lengths, num_trained


def _empty_reason(counts: dict[int, int], cfg: DataConfig) -> str:
    if counts[TOO_LONG] and not counts[NO_TARGET]:
        return (f"every sample is longer than data.max_length={cfg.max_length} tokens and overlong=drop removed all "
                f"{counts[TOO_LONG]}; raise data.max_length or set data.overlong=truncate")
    if counts[NO_TARGET]:
        return (f"no sample has a trained token within data.max_length={cfg.max_length} ({counts[NO_TARGET]} lost their "
                f"answer to truncation, {counts[TOO_LONG]} too long); raise data.max_length")
    return f"no usable training sample ({counts[BAD_TEMPLATE]} could not be rendered by the chat template)"


def _finish(ds, lengths, cfg: DataConfig, *, seed: int):
    """Final rows: the tokenised samples, or packed rows when `data.packing` is on."""
    ds = ds.select_columns(["input_ids", "labels"])
    if not cfg.packing:
        return ds
    import datasets
    from datasets.table import InMemoryTable

    bins = packing.pack_bins(list(lengths), max_length=cfg.max_length)
    table = packing.pack_table(ds.with_format("arrow")[:], bins, seed=seed, shuffle=cfg.shuffle)
    return datasets.Dataset(InMemoryTable(table))
