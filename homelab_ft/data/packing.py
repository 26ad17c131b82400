"""Packing: several tokenised samples per row, so a batch is (almost) all real tokens.

Samples are never split across rows (a split sample would lose its prompt). They are placed by
best-fit decreasing bin packing: longest first, each into the fullest row that still has room.
On chat data with a long tail of lengths this fills rows to >= 97% (bench/data.py prints the
measured fraction), against ~40-60% non-pad tokens when each sample is padded on its own.

A packed row carries `position_ids` that restart at 0 for every sample. That is all the model
needs to keep samples apart: transformers 5's `masking_utils.find_packed_sequence_indices`
turns position ids into per-sample segments and `create_causal_mask` ands a block-diagonal mask
into the causal one, for sdpa, eager and flex attention alike, *provided* the forward call gets
`attention_mask=None` and no KV cache (`use_cache=False`). flash_attention_2 reads the same
position ids as varlen boundaries. `collate` therefore leaves `attention_mask` out of packed
batches; tests/unit/data/test_packing.py checks that the packed loss equals the per-sample loss.
"""

from __future__ import annotations

import bisect
import random


def pack_bins(lengths: list[int], *, max_length: int) -> list[list[int]]:
    """Group sample indices into rows of at most `max_length` tokens (best-fit decreasing).

    Returns the rows in a deterministic order; within a row, samples keep their input order.
    """
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    bins: list[list[int]] = []
    free: list[tuple[int, int]] = []  # (tokens left, bin index), sorted: best fit = first with room
    for i in order:
        size = lengths[i]
        assert 0 < size <= max_length, f"sample {i} has {size} tokens; truncation must run before packing"
        slot = bisect.bisect_left(free, (size, -1))
        if slot < len(free):
            left, b = free.pop(slot)
        else:
            left, b = max_length, len(bins)
            bins.append([])
        bins[b].append(i)
        if left - size > 0:
            bisect.insort(free, (left - size, b))
    return [sorted(b) for b in bins]


def pack_table(table, bins: list[list[int]], *, seed: int, shuffle: bool):
    """Concatenate the samples of each bin (a pyarrow table with input_ids, labels) into one row.

    Vectorised over flat token arrays (no Python loop per token): 10k samples pack in well under a
    second. Position ids restart at 0 at every sample start.
    """
    import numpy as np
    import pyarrow as pa
    import pyarrow.compute as pc

    order = list(range(len(bins)))
    if shuffle:
        # Best-fit decreasing emits long-sample rows first; shuffle rows so training order is mixed.
        random.Random(seed).shuffle(order)
    samples = np.asarray([i for b in order for i in bins[b]], dtype=np.int64)
    per_row = np.asarray([len(bins[b]) for b in order], dtype=np.int64)
    ids = pc.take(table.column("input_ids"), samples)
    lengths = pc.list_value_length(ids).to_numpy(zero_copy_only=False).astype(np.int64)
    sample_ends = np.cumsum(lengths)
    positions = np.arange(int(sample_ends[-1]), dtype=np.int64) - np.repeat(sample_ends - lengths, lengths)
    row_offsets = np.concatenate([[0], sample_ends[np.cumsum(per_row) - 1]])

    def rows(values) -> pa.ListArray:
        return pa.ListArray.from_arrays(pa.array(row_offsets, pa.int64()).cast(pa.int32()), values)

    flat = {name: pc.list_flatten(pc.take(table.column(name), samples)).combine_chunks() for name in ("input_ids", "labels")}
    return pa.table({
        "input_ids": rows(flat["input_ids"]),
        "labels": rows(flat["labels"]),
        "position_ids": rows(pa.array(positions, pa.int64())),
    })


def non_pad_fraction(lengths: list[int], *, num_rows: int, max_length: int) -> float:
    """Real tokens / tokens in `num_rows` rows of `max_length` (1.0 = no padding at all)."""
    return sum(lengths) / (num_rows * max_length) if num_rows else 0.0
