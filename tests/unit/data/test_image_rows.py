"""Image rows (data/image_rows.py, data/images.py) on every tiny family of tests/tiny_vlm.py
whose processor can be built here (TRAINED):
which tokens are the image's and carry no label, what is trained, what a batch holds, and that a
row is never cut inside an image."""

from __future__ import annotations

import base64
import json

import numpy as np
import pytest
import torch
from tiny_vlm import TRAINED, image_chat, make_image, save_vlm

from homelab_ft.data import collate, prepare_data
from homelab_ft.data import image_rows as image_rows_module
from homelab_ft.errors import UserError
from homelab_ft.labels import IGNORE_INDEX
from homelab_ft.model import loading
from homelab_ft.recipe.config import DataConfig, ModelConfig, SourceConfig


@pytest.fixture(scope="module", params=sorted(TRAINED))
def family(request, tmp_path_factory):
    """(folder, tokenizer, processor) of a family's tiny checkpoint (config and processor only)."""
    folder = save_vlm(tmp_path_factory.mktemp(request.param), request.param, weights=False)
    tokenizer, processor = loading.load_tokenizer_and_processor(ModelConfig(path=str(folder)), folder, images=True)
    return folder, tokenizer, processor


def _write(folder, rows) -> None:
    (folder / "d.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def _prepare(folder, processor, **data):
    cfg = DataConfig(sources=[SourceConfig(path="d.jsonl")], images=True, cache_dir=str(folder / "cache"),
                     **{"max_length": 2048, **data})
    return prepare_data(cfg, processor.tokenizer, seed=0, base_dir=folder, processor=processor)


def test_image_prompt_and_padding_tokens_carry_no_label_in_every_family(family, tmp_path):
    folder, tokenizer, processor = family
    make_image(tmp_path / "a.png", size=(70, 50))
    make_image(tmp_path / "b.png", size=(40, 90), colour=(20, 20, 220))
    two = {"messages": [{"role": "user", "content": [{"type": "image", "path": "a.png"}, {"type": "text", "text": "and"},
                                                     {"type": "image", "path": "b.png"}]},
                        {"role": "assistant", "content": "two"}]}
    _write(tmp_path, [image_chat("a.png"), two, {"messages": [{"role": "user", "content": "hi"},
                                                              {"role": "assistant", "content": "yes"}]}])
    prepared = _prepare(tmp_path, processor, shuffle=False)
    answers = ("red", "two", "yes")
    config = json.loads((folder / "config.json").read_text())
    # the features' placeholder is the token the model's own check counts (its config's image token)
    assert image_rows_module.feature_token(processor) == config.get("image_token_id", config.get("image_token_index"))
    for row, answer, (num_images, image_tokens) in zip(prepared.train, answers, prepared.report.image_rows, strict=True):
        ids, labels = np.asarray(row["input_ids"]), np.asarray(row["labels"])
        placeholders = np.isin(ids, processor.image_token_ids)  # what the processor itself marks as image
        assert num_images == len(row["images"]) and (image_tokens > 0) == bool(row["images"])
        assert image_tokens == (ids == image_rows_module.feature_token(processor)).sum() <= placeholders.sum()
        assert (labels[placeholders] == IGNORE_INDEX).all()
        trained = ids[labels != IGNORE_INDEX]
        assert tokenizer.decode(trained) == answer + tokenizer.eos_token  # the answer and its end, nothing else
        # every other token (prompt, images, the template's markup) carries no label
        assert (labels == IGNORE_INDEX).sum() == len(ids) - len(trained)
    batch = collate(list(prepared.train), pad_token_id=tokenizer.pad_token_id, pixels=prepared.pixels)
    padding = batch["attention_mask"] == 0
    assert padding.any() and (batch["labels"][padding] == IGNORE_INDEX).all()
    assert set(processor.image_processor.model_input_names) & set(batch) and "pixel_values" in batch
    assert all(batch[k].shape == batch["input_ids"].shape for k in prepared.pixels.token_columns(prepared.train[0]))


def test_train_on_inputs_still_leaves_the_image_tokens_out(family, tmp_path):
    _, tokenizer, processor = family
    make_image(tmp_path / "a.png")
    _write(tmp_path, [image_chat("a.png")])
    row = _prepare(tmp_path, processor, train_on_inputs=True).train[0]
    labels = np.asarray(row["labels"])
    marked = (labels == IGNORE_INDEX).sum() - 1  # the first token is never trained
    placeholders = np.isin(np.asarray(row["input_ids"]), processor.image_token_ids).sum()
    assert marked >= placeholders >= row["image_tokens"] > 0  # the markup around the features is masked too


@pytest.mark.parametrize("model_type", ["qwen2_vl", "idefics3"])  # image tokens follow the image's size and shape
def test_a_row_is_never_cut_inside_an_image(model_type, tmp_path):
    folder = save_vlm(tmp_path / model_type, model_type, weights=False)
    _, processor = loading.load_tokenizer_and_processor(ModelConfig(path=str(folder)), folder, images=True)
    make_image(tmp_path / "small.png", size=(200, 100))
    make_image(tmp_path / "large.png", size=(112, 112))
    long_text = "the quick brown fox jumps over the lazy dog " * 4
    late_image = {"messages": [{"role": "user", "content": [{"type": "text", "text": long_text},
                                                            {"type": "image", "path": "large.png"}]},
                               {"role": "assistant", "content": "red"}]}
    rows = [image_chat("small.png", answer=long_text), late_image, image_chat("small.png")]
    _write(tmp_path, rows)
    whole = _prepare(tmp_path, processor, shuffle=False).train
    early, late, short = (np.asarray(r["input_ids"]) for r in whole)
    images_of = [np.flatnonzero(np.isin(ids, processor.image_token_ids)) for ids in (early, late)]
    limit = len(short)  # the early row keeps its image and its answer's first tokens, the late row's image crosses
    assert images_of[0][-1] < limit <= images_of[1][-1] < len(late) and limit < len(early)
    with pytest.raises(UserError, match=r"d\.jsonl: row 2: its image tokens reach past data\.max_length=.*"
                                        r"\(1 row\(s\) of its split like it\).*overlong=drop"):
        _prepare(tmp_path, processor, max_length=limit, shuffle=False)
    dropped = _prepare(tmp_path, processor, max_length=limit, overlong="drop", shuffle=False)
    assert (dropped.report.num_dropped_overlong, dropped.report.num_train_samples) == (2, 1)
    inspected = prepare_data(DataConfig(sources=[SourceConfig(path="d.jsonl")], images=True, max_length=limit,
                                        cache_dir=str(tmp_path / "cache"), shuffle=False),
                             processor.tokenizer, seed=0, base_dir=tmp_path, processor=processor, refuse_cut=False)
    report = inspected.report
    assert (report.num_cut_images, report.num_truncated, report.num_train_samples) == (1, 1, 2)
    assert report.cut_image_rows[0].endswith("d.jsonl: row 2")
    cut = np.asarray(inspected.train[0]["input_ids"])  # the early image's row, cut after its image: all of it kept
    assert len(cut) == limit and (cut == early[:limit]).all()
    assert inspected.train[0]["image_tokens"] == whole[0]["image_tokens"]


def test_bad_image_parts_are_bad_rows_naming_the_image(tmp_path):
    folder = save_vlm(tmp_path / "m", "llava", weights=False)
    _, processor = loading.load_tokenizer_and_processor(ModelConfig(path=str(folder)), folder, images=True)
    make_image(tmp_path / "ok.png")
    (tmp_path / "broken.png").write_bytes(b"not a png")
    cases = {
        "missing.png": r"row 1: field 'messages\[0\]\.content\[0\]' names the image .*missing\.png, which does not exist",
        "https://example.com/a.png": r"is a URL \(https://example\.com/a\.png\); images are read from local files",
        "broken.png": r"row 1: image .*broken\.png cannot be read",
    }
    for path, message in cases.items():
        _write(tmp_path, [image_chat(path), image_chat("ok.png")])
        with pytest.raises(UserError, match=message):
            _prepare(tmp_path, processor)
        skipped = _prepare(tmp_path, processor, bad_rows="skip")
        assert skipped.report.num_train_samples == 1
        assert sum(s.num_rows_skipped for s in skipped.report.sources) + skipped.report.num_bad_images == 1
    answered = {"messages": [{"role": "user", "content": "draw"},
                             {"role": "assistant", "content": [{"type": "image", "path": "ok.png"}]}]}
    _write(tmp_path, [answered])
    with pytest.raises(UserError, match="is an image in an assistant turn"):
        _prepare(tmp_path, processor)


def test_a_base64_image_reads_as_its_file_does(tmp_path):
    folder = save_vlm(tmp_path / "m", "qwen2_vl", weights=False)
    _, processor = loading.load_tokenizer_and_processor(ModelConfig(path=str(folder)), folder, images=True)
    png = make_image(tmp_path / "a.png", size=(60, 40)).read_bytes()
    uri = "data:image/png;base64," + base64.b64encode(png).decode()
    _write(tmp_path, [image_chat("a.png"), image_chat({"type": "image", "image": uri})])
    prepared = _prepare(tmp_path, processor, shuffle=False)
    by_file, inline = prepared.train
    assert by_file["input_ids"] == inline["input_ids"] and inline["images"] == [uri]
    batch = prepared.pixels([by_file, inline])
    half = batch["pixel_values"].shape[0] // 2
    assert torch.equal(batch["pixel_values"][:half], batch["pixel_values"][half:])


def test_image_max_pixels_shrinks_an_image_and_its_tokens(tmp_path):
    folder = save_vlm(tmp_path / "m", "qwen2_vl", weights=False)
    _, processor = loading.load_tokenizer_and_processor(ModelConfig(path=str(folder)), folder, images=True)
    make_image(tmp_path / "a.png", size=(112, 56))
    _write(tmp_path, [image_chat("a.png")])
    full = _prepare(tmp_path, processor).train[0]
    shrunk = _prepare(tmp_path, processor, image_max_pixels=56 * 28).train[0]
    # one token per 28x28 pixels (<|vision_start|> and <|vision_end|> around them are no features)
    assert (full["image_tokens"], shrunk["image_tokens"]) == (8, 2)


def test_the_template_markup_around_an_image_is_read_off_the_template(tmp_path):
    folder = save_vlm(tmp_path / "m", "qwen2_vl", weights=False)
    tokenizer, processor = loading.load_tokenizer_and_processor(ModelConfig(path=str(folder)), folder, images=True)
    assert image_rows_module.image_markup(tokenizer, processor.chat_template, processor.image_token) == (
        "<|vision_start|>", "<|vision_end|>")


def test_text_rows_with_an_image_part_name_data_images(tiny_model_dir, tmp_path):
    make_image(tmp_path / "a.png")
    _write(tmp_path, [image_chat("a.png")])
    cfg = DataConfig(sources=[SourceConfig(path="d.jsonl")], cache_dir=str(tmp_path / "cache"))
    with pytest.raises(UserError, match=r"is an image; train on images with data\.images=true"):
        prepare_data(cfg, loading.load_tokenizer(ModelConfig(path=str(tiny_model_dir)), tiny_model_dir), seed=0,
                     base_dir=tmp_path)


@pytest.mark.parametrize("model_type", ["qwen2_vl", "idefics3"])
def test_the_planner_counts_the_image_tokens_the_data_side_gives_an_image_at_the_bound(model_type, tmp_path):
    """An image larger than data.image_max_pixels is resized to the bound (rules/image_area.py) and,
    for Qwen2-VL, its processor is given the bound too, which replaces its own 16-token cap: lowered
    (56 x 56 px: 4 tokens) or raised (224 x 224: 64); the planner's count at the bound
    (planner.recipe_images) is the row's. Idefics3's processor takes no bounds and sizes every image
    to its own longest edge (3 x 3 tiles and the whole image, 40 tokens), on both sides. (The shape
    is only asked whether a measured vision side is there: the count is the model's own, cached.)"""
    from types import SimpleNamespace

    from homelab_ft.plan.planner import recipe_images
    from homelab_ft.plan.shape.types import VisionShape
    from homelab_ft.recipe.config import recipe_from_dict

    folder = save_vlm(tmp_path / model_type, model_type, weights=False)
    _, processor = loading.load_tokenizer_and_processor(ModelConfig(path=str(folder)), folder, images=True)
    make_image(tmp_path / "big.png", size=(900, 900))
    _write(tmp_path, [image_chat("big.png")])
    seen = []
    for side in (56, 112, 224):
        row = _prepare(tmp_path, processor, image_max_pixels=side * side).train[0]
        recipe = recipe_from_dict({"model": {"path": str(folder)}, "data": {"images": True, "image_max_pixels": side * side}})
        planned = recipe_images(recipe, SimpleNamespace(vision=VisionShape(params=1)))
        assert planned.size == (side, side) and planned.tokens_per_image == row["image_tokens"] > 0
        seen.append(row["image_tokens"])
    assert seen == ([4, 16, 64] if model_type == "qwen2_vl" else [40] * 3)  # Idefics3: its longest edge set to 96 px
