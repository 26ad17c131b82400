"""Packing: bins, position ids, and the packed loss equal to the per-sample loss (fp32)."""

from __future__ import annotations

import json
import random

import pytest
import torch

from homelab_ft.data import IGNORE_INDEX, collate, prepare_data
from homelab_ft.data.packing import pack_bins
from homelab_ft.recipe.config import DataConfig, SourceConfig

WORDS = "the quick brown fox jumps over the lazy dog answer yes no paris four ten twenty".split()


def write_chats(path, *, num_rows: int, seed: int = 0):
    rng = random.Random(seed)
    with open(path, "w") as f:
        for _ in range(num_rows):
            turns = []
            for _ in range(rng.choice([1, 1, 2])):
                turns.append({"role": "user", "content": " ".join(rng.choices(WORDS, k=rng.randint(1, 12)))})
                turns.append({"role": "assistant", "content": " ".join(rng.choices(WORDS, k=rng.randint(1, 20)))})
            f.write(json.dumps({"messages": turns}) + "\n")


def test_pack_bins_is_a_partition_within_max_length():
    rng = random.Random(0)
    lengths = [min(256, int(rng.paretovariate(1.2) * 8)) for _ in range(2000)]
    bins = pack_bins(lengths, max_length=256)
    assert sorted(i for b in bins for i in b) == list(range(len(lengths)))
    assert all(sum(lengths[i] for i in b) <= 256 for b in bins)
    # Best-fit decreasing needs at most 11/9 OPT + 1 bins; OPT >= total / 256.
    assert len(bins) <= 11 / 9 * (sum(lengths) / 256) + 1


def test_packed_rows_restart_positions_and_keep_every_sample(tmp_path, tiny_model_dir):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    write_chats(tmp_path / "d.jsonl", num_rows=40)
    base = dict(sources=[SourceConfig(path=str(tmp_path / "d.jsonl"))], max_length=256, cache_dir=str(tmp_path / "c"))
    plain = prepare_data(DataConfig(**base), tokenizer, seed=3)
    packed = prepare_data(DataConfig(**base, packing=True), tokenizer, seed=3)
    assert len(packed.train) < len(plain.train)
    samples = []
    for row in packed.train:
        assert len(row["input_ids"]) <= 256
        starts = [i for i, p in enumerate(row["position_ids"]) if p == 0] + [len(row["position_ids"])]
        for a, b in zip(starts, starts[1:], strict=False):
            assert row["position_ids"][a:b] == list(range(b - a))
            assert row["labels"][a] == IGNORE_INDEX  # never predicted from the previous sample
            samples.append((tuple(row["input_ids"][a:b]), tuple(row["labels"][a:b])))
    assert sorted(samples) == sorted((tuple(r["input_ids"]), tuple(r["labels"])) for r in plain.train)
    assert packed.report.non_pad_fraction > plain.report.non_pad_fraction


def test_collate_pads_and_masks():
    rows = [{"input_ids": [5, 6, 7], "labels": [-100, 6, 7]}, {"input_ids": [8], "labels": [-100]}]
    batch = collate(rows, pad_token_id=0)
    assert batch["input_ids"].tolist() == [[5, 6, 7], [8, 0, 0]]
    assert batch["labels"].tolist() == [[-100, 6, 7], [-100, -100, -100]]
    assert batch["attention_mask"].tolist() == [[1, 1, 1], [1, 0, 0]]
    packed = [dict(r, position_ids=list(range(len(r["input_ids"])))) for r in rows]
    batch = collate(packed, pad_token_id=0)
    assert "attention_mask" not in batch
    assert batch["position_ids"].tolist() == [[0, 1, 2], [0, 0, 1]]


def _loss_sum(logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, int]:
    shift_logits, shift_labels = logits[..., :-1, :].reshape(-1, logits.shape[-1]), labels[..., 1:].reshape(-1)
    loss = torch.nn.functional.cross_entropy(shift_logits.float(), shift_labels, ignore_index=IGNORE_INDEX, reduction="sum")
    return loss, int((shift_labels != IGNORE_INDEX).sum())


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_packed_loss_equals_per_sample_loss(tmp_path, tiny_model_dir, attn):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(0)
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32, attn_implementation=attn)
    model.train()  # the trainer's mode; the tiny Llama has no dropout, so outputs are deterministic
    write_chats(tmp_path / "d.jsonl", num_rows=24, seed=1)
    cfg = DataConfig(sources=[SourceConfig(path=str(tmp_path / "d.jsonl"))], max_length=480, packing=True,
                     cache_dir=str(tmp_path / "c"))
    rows = list(prepare_data(cfg, tokenizer, seed=0).train)
    assert max(r["position_ids"].count(0) for r in rows) >= 3  # really several samples per row

    batch = collate(rows, pad_token_id=tokenizer.pad_token_id)
    with torch.no_grad():
        logits = model(**batch, use_cache=False).logits
        packed_sum, packed_count = _loss_sum(logits, batch["labels"])
        single_sum, single_count = torch.zeros(()), 0
        for row in rows:
            starts = [i for i, p in enumerate(row["position_ids"]) if p == 0] + [len(row["input_ids"])]
            for a, b in zip(starts, starts[1:], strict=False):
                ids = torch.tensor([row["input_ids"][a:b]])
                s, c = _loss_sum(model(input_ids=ids, use_cache=False).logits, torch.tensor([row["labels"][a:b]]))
                single_sum, single_count = single_sum + s, single_count + c
        assert packed_count == single_count > 0
        assert abs(packed_sum / packed_count - single_sum / single_count).item() <= 1e-5

        # The control that makes this test able to fail: an all-ones attention mask (or a KV cache)
        # turns transformers' packed-sequence detection off, and samples attend to each other.
        ones = torch.ones_like(batch["input_ids"])
        leaky = model(**batch, attention_mask=ones, use_cache=False).logits
        leaky_sum, _ = _loss_sum(leaky, batch["labels"])
        assert abs(leaky_sum / packed_count - single_sum / single_count).item() > 1e-4  # 10x the tolerance
