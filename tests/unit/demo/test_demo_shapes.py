"""The image task: its pictures read back pixel by pixel against their answers, its splits, its
scorer (driven by a stand-in model that reads the colour off the pixels it is given) and the tiny
SmolVLM-family model it is asked of, built from the test tokenizer."""

from __future__ import annotations

import hashlib
import itertools
import json

import numpy as np
import pytest
import torch

from homelab_ft.demo import shapes, shapes_model
from homelab_ft.locate import EMBEDDED_CONFIG

INK_SPREAD = 45
"""A shape pixel's channels differ by more than this (the least saturated, green at its worst
jitter, by 55); the grey background's only by its faint tint (sigma 4 a channel)."""


@pytest.fixture(scope="module")
def examples():
    return {split: shapes.make_rows(split, num_rows=n)
            for split, n in (("train", 2 * shapes.NUM_EVAL_ROWS), ("eval", shapes.NUM_EVAL_ROWS))}


@pytest.fixture(scope="module")
def vlm_dir(tmp_path_factory):
    from tiny import make_tokenizer

    tokenizer_dir = tmp_path_factory.mktemp("tokenizer")
    make_tokenizer(tokenizer_dir)
    return shapes_model.build(tokenizer_dir, tmp_path_factory.mktemp("tiny-vlm"))


# ------------------------------------------------------------------------------- the pictures


def colour_of(rgb) -> str:
    """The colour whose jitter box holds `rgb` (the boxes are disjoint: test below)."""
    (name,) = [name for name, base in shapes.COLOURS.items()
               if all(abs(int(v) - b) <= shapes.COLOUR_JITTER for v, b in zip(rgb, base, strict=True))]
    return name


def shape_of(ink: np.ndarray) -> str:
    """A shape from its ink mask: which corners of its bounding box are inked, and how full it is."""
    rows, cols = np.nonzero(ink)
    box = ink[rows.min() : rows.max() + 1, cols.min() : cols.max() + 1]
    corners = (box[0, 0], box[0, -1], box[-1, 0], box[-1, -1])
    if all(corners):
        return "square"
    if corners == (False, False, True, True):
        return "triangle"
    assert not any(corners)
    return "circle" if box.mean() > 0.67 else "cross"  # pi/4 against a cross's ~5/9


def read_picture(image) -> shapes.Scene:
    """What a picture shows, read from its pixels alone."""
    pixels = np.asarray(image).astype(int)
    ink = pixels.max(-1) - pixels.min(-1) > INK_SPREAD
    cells, colours, kinds = [], set(), set()
    for cell in range(4):
        top, left = cell // 2 * shapes.CELL_PX, cell % 2 * shapes.CELL_PX
        here = ink[top : top + shapes.CELL_PX, left : left + shapes.CELL_PX]
        if here.any():
            cells.append(cell)
            fills = {tuple(p) for p in pixels[top : top + shapes.CELL_PX, left : left + shapes.CELL_PX][here]}
            assert len(fills) == 1, "one flat fill per shape"
            colours.add(colour_of(fills.pop()))
            kinds.add(shape_of(here))
    assert len(colours) == len(kinds) == 1, "one colour and one shape per picture"
    return shapes.Scene(colours.pop(), kinds.pop(), tuple(cells))


def test_the_colour_jitter_boxes_are_disjoint():
    for (a, x), (b, y) in itertools.combinations(shapes.COLOURS.items(), 2):
        assert max(abs(p - q) for p, q in zip(x, y, strict=True)) > 2 * shapes.COLOUR_JITTER, (a, b)


@pytest.mark.parametrize("split", shapes.SPLITS)
def test_every_picture_shows_what_its_row_answers(examples, split):
    for example in examples[split]:
        seen = read_picture(example.image)
        assert seen == example.scene
        kind = shapes.kind_of(example.row)
        assert example.row["messages"][1]["content"] == seen.answer(kind)


def test_generation_is_seeded():
    def fingerprint(seed):
        return [(ex.row, ex.image.tobytes()) for ex in shapes.make_rows("eval", num_rows=6, seed=seed)]

    assert fingerprint(shapes.SEED) == fingerprint(shapes.SEED)
    assert fingerprint(shapes.SEED) != fingerprint(shapes.SEED + 1)


def test_held_out_pictures_are_not_training_pictures_and_guessing_scores_chance(examples):
    train = {hashlib.sha256(ex.image.tobytes()).digest() for ex in examples["train"]}
    assert not train & {hashlib.sha256(ex.image.tobytes()).digest() for ex in examples["eval"]}
    for split in shapes.SPLITS:
        rows = [ex.row for ex in examples[split]]
        # every wording is answered by every value equally often: reading the question alone
        # gives 1/6 of colours, 1/4 of shapes and counts
        assert shapes.chance(rows) == pytest.approx(2 / 9)
        assert {shapes.kind_of(r) for r in rows} == set(shapes.KINDS)


def test_written_dataset_rows_name_their_pictures_relative_to_the_file(tmp_path):
    paths = shapes.write_dataset(tmp_path / "a", num_train=6, num_eval=3)
    assert [p.name for p in paths] == ["train.jsonl", "eval.jsonl"]
    for path, split in zip(paths, shapes.SPLITS, strict=True):
        rows = shapes.read_rows(path)
        for row, example in zip(rows, shapes.make_rows(split, num_rows=len(rows)), strict=True):
            assert row == json.loads(json.dumps(example.row))
            from PIL import Image

            with Image.open(shapes.image_file(path, row)) as saved:
                assert saved.mode == "RGB" and saved.tobytes() == example.image.tobytes()
    again = shapes.write_dataset(tmp_path / "b", num_train=6, num_eval=3)
    for one, two in zip(sorted((tmp_path / "a").rglob("*.*")), sorted((tmp_path / "b").rglob("*.*")), strict=True):
        assert one.read_bytes() == two.read_bytes()
    assert len(list((tmp_path / "a" / "images").iterdir())) == 9 and again


# ------------------------------------------------------------------------------- grading


@pytest.mark.parametrize("reply, correct", [
    ("red", True), (" red\n", True), ("Red", False), ("red.", False), ("red circle", False), ("", False),
])
def test_grade_is_exact(reply, correct):
    assert shapes.grade(reply, "red") is correct


class ColourReader(torch.nn.Module):
    """Stands in for a model: `generate` names the colour it finds in each row's own pixel values
    (whatever the question), so only colour rows come out right, and only if every row is given
    its own picture and its reply is read after its own (left-padded) prompt."""

    def __init__(self, processor):
        super().__init__()
        self.processor = processor
        self.anchor = torch.nn.Parameter(torch.zeros(1))

    @property
    def device(self):
        return self.anchor.device

    def generate(self, input_ids, attention_mask, pixel_values, max_new_tokens, do_sample, pad_token_id, **_):
        assert attention_mask[:, -1].all(), "prompts must be left-padded"
        images = self.processor.image_processor
        mean, std = torch.tensor(images.image_mean)[:, None, None], torch.tensor(images.image_std)[:, None, None]
        replies = []
        for pixels in pixel_values[:, 0]:
            rgb = ((pixels * std + mean) * 255).permute(1, 2, 0).reshape(-1, 3)
            ink = rgb[rgb.max(-1).values - rgb.min(-1).values > INK_SPREAD].mean(0)
            nearest = min(shapes.COLOURS, key=lambda name: (ink - torch.tensor(shapes.COLOURS[name])).norm())
            replies.append(nearest + "<|im_end|>")
        tokens = self.processor.tokenizer(replies, add_special_tokens=False)["input_ids"]
        width = max(map(len, tokens))
        new = torch.tensor([t + [pad_token_id] * (width - len(t)) for t in tokens])
        return torch.cat([input_ids, new[:, :max_new_tokens]], dim=1)


def test_score_gives_each_row_its_own_picture(tmp_path, vlm_dir):
    from transformers import AutoProcessor

    data_file, _ = shapes.write_dataset(tmp_path, num_train=12, num_eval=3)
    rows = shapes.read_rows(data_file)
    processor = AutoProcessor.from_pretrained(vlm_dir)
    result = shapes.score(ColourReader(processor), processor, rows, data_file=data_file, batch_size=5)
    assert result.per_kind == {"colour": (4, 4), "shape": (0, 4), "count": (0, 4)}
    assert (result.num_correct, result.num_rows) == (4, 12)
    assert [r.got for r in result.replies if r.correct] == [r.expected for r in result.replies if r.correct]
    assert processor.tokenizer.padding_side == "right", "restored after scoring"
    assert "4/12 correct" in result.summary()


# ------------------------------------------------------------------------------- the model


def test_shapes_model_is_smolvlms_family_from_its_configs(vlm_dir):
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(vlm_dir)
    smollm2 = json.loads(EMBEDDED_CONFIG.read_text())
    assert config.model_type == "idefics3" and config.scale_factor == shapes_model.SCALE_FACTOR
    text = config.text_config
    assert text.model_type == smollm2["model_type"] and text.tie_word_embeddings
    assert text.rope_parameters["rope_theta"] == smollm2["rope_theta"] and text.rms_norm_eps == smollm2["rms_norm_eps"]
    assert (text.hidden_size, text.num_hidden_layers) == (shapes_model.TEXT_SIZES["hidden_size"], shapes_model.TEXT_SIZES["num_hidden_layers"])
    assert config.vision_config.image_size == shapes.CANVAS_PX


def test_shapes_model_loads_back_and_reads_a_row_with_its_image_tokens(vlm_dir):
    from transformers import AutoModelForImageTextToText, AutoProcessor

    processor = AutoProcessor.from_pretrained(vlm_dir)
    model = AutoModelForImageTextToText.from_pretrained(vlm_dir, dtype=torch.float32)
    assert model.lm_head.weight is model.get_input_embeddings().weight
    assert model.config.text_config.vocab_size == len(processor.tokenizer)
    example = shapes.make_rows("train", num_rows=1)[0]
    text = processor.apply_chat_template(example.row["messages"])
    assert text == (f"<|im_start|>user\n<image>{shapes.question_of(example.row)}<|im_end|>\n"
                    f"<|im_start|>assistant\n{example.scene.answer('colour')}<|im_end|>\n")
    batch = processor(text=[text], images=[[example.image]], return_tensors="pt")
    ids = batch["input_ids"][0].tolist()
    assert ids.count(model.config.image_token_id) == shapes_model.image_seq_len() == 4
    out = model(**batch, labels=batch["input_ids"])
    assert torch.isfinite(out.loss)
    assert processor.tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False) == \
        "<|im_start|>user\nhi<|im_end|>\n"


def test_shapes_model_is_seeded(vlm_dir, tmp_path):
    from safetensors.torch import load_file

    tokenizer_dir = tmp_path / "tokenizer"
    from tiny import make_tokenizer

    make_tokenizer(tokenizer_dir)
    again = load_file(shapes_model.build(tokenizer_dir, tmp_path / "again") / "model.safetensors")
    first = load_file(vlm_dir / "model.safetensors")
    assert first.keys() == again.keys() and all(torch.equal(first[k], again[k]) for k in first)
    other = load_file(shapes_model.build(tokenizer_dir, tmp_path / "other", seed=1) / "model.safetensors")
    assert not torch.equal(first["model.connector.modality_projection.proj.weight"],
                           other["model.connector.modality_projection.proj.weight"])
