"""The prepared rows' lengths kept for `plan` (data/lengths.py, issue 39 point 5): what a row's padded
width is made of per objective, the round trip through the cache, and a changed file measured again."""

from __future__ import annotations

from types import SimpleNamespace

from homelab_ft.data import lengths
from homelab_ft.recipe.config import recipe_from_dict


def report(sample_lengths, *, packed=False, image_rows=()):
    return SimpleNamespace(sample_lengths=tuple(sample_lengths), packed=packed, image_rows=tuple(image_rows))


def recipe(tmp_path, *overrides, **top):
    return recipe_from_dict({"data": {"sources": [{"path": str(tmp_path / "d.jsonl")}]}, **top}, overrides=overrides)


def test_a_rows_width_per_objective(tmp_path):
    sft, dpo = recipe(tmp_path), recipe(tmp_path, objective="dpo", method="lora")
    assert lengths.row_lengths(sft, report([70, 90, 80])) == [70, 90, 80]
    # a pair's chosen rows come first, then its rejected ones; the pair is as wide as its longer side
    assert lengths.row_lengths(dpo, report([70, 90, 60, 120])) == [70, 120]
    assert lengths.row_lengths(sft, report([128, 128], packed=True)) is None


def test_stored_reads_back_what_store_kept_until_the_data_changes(tmp_path, monkeypatch):
    monkeypatch.setenv("HOMELAB_FT_CACHE", str(tmp_path / "cache"))
    (tmp_path / "d.jsonl").write_text('{"text": "x"}\n')
    r = recipe(tmp_path)
    assert lengths.stored(r, base_dir=tmp_path) is None
    lengths.store(r, report([80, 70, 80]), base_dir=tmp_path)
    assert lengths.stored(r, base_dir=tmp_path) == ((70, 1), (80, 2))
    assert lengths.stored(recipe(tmp_path, "data.max_length=64"), base_dir=tmp_path) is None  # other rows
    (tmp_path / "d.jsonl").write_text('{"text": "a longer row"}\n')
    assert lengths.stored(r, base_dir=tmp_path) is None  # the file changed: measured again when next prepared


def test_image_rows_keep_their_images_and_image_tokens_for_the_planner(tmp_path, monkeypatch):
    monkeypatch.setenv("HOMELAB_FT_CACHE", str(tmp_path / "cache"))
    (tmp_path / "d.jsonl").write_text('{"text": "x"}\n')
    r, text = recipe(tmp_path, "data.images=true"), recipe(tmp_path)
    lengths.store(r, report([90, 70, 90], image_rows=[(1, 18), (1, 6), (1, 18)]), base_dir=tmp_path)
    assert lengths.stored(r, base_dir=tmp_path) == ((70, 1), (90, 2))
    assert lengths.stored_images(r, base_dir=tmp_path) == ((1, 6, 1), (1, 18, 2))  # (images, image tokens, rows)
    lengths.store(text, report([90, 70]), base_dir=tmp_path)
    assert lengths.stored_images(text, base_dir=tmp_path) is None and lengths.stored(text, base_dir=tmp_path)
