"""The image task: say the colour, the shape or the number of shapes in a small generated picture.

Each picture is 64x64 pixels: a noisy light-grey background and one to four shapes of one kind and
one colour, each in its own quarter of the picture (a 2x2 grid of 32-pixel cells), at a random size
(18-28 px) and offset, its colour jittered by up to 25 per channel. A row asks one question about it
("What colour are the shapes?", "Which shape do you see?", "How many shapes are there?", three
wordings each) and the assistant answers one word: a colour of six, a shape of four, a count 1-4.

The held-out rows are pictures drawn from a seed of their own, so no held-out picture is a training
picture, and every question wording is answered by every value equally often: a model that does not
look at the picture can do no better than `chance` (2/9: 1/6 of the colours, 1/4 of the shapes and
counts). A cell per shape is what makes the task learnable from a random vision tower in a few CPU
minutes: the image demo's model (shapes_model.py) turns each cell into one image token. Measured
with a trainable projector and a linear head over the frozen random tower (300 steps of 8
pictures, held out): colour / shape / count 97 / 86 / 88% with these cells, 79 / 45 / 57% with up
to four smaller shapes in a 4x4 grid of 16-px cells, four cells to an image token.

`python -m homelab_ft.demo.shapes --write-dataset DIR` writes DIR/train.jsonl, DIR/eval.jsonl and the
PNG files under DIR/images that their rows name (relative to the JSONL file), the same bytes for the
same seed.
"""

from __future__ import annotations

import argparse
import json
import logging
import random
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

SEED = 20250301
SPLITS = ("train", "eval")
NUM_TRAIN_ROWS = 540
NUM_EVAL_ROWS = 108
"""Multiples of 108 = 3 kinds x 36, and 36 is a multiple of 6 colours x 3 wordings and of 4 shapes
(or counts) x 3 wordings: every wording is answered by every value equally often in each split."""

CANVAS_PX = 64
CELL_PX = 32
"""The picture is a 2x2 grid of cells; at most one shape per cell."""
SHAPE_PX = (18, 28)
"""Smallest and largest shape, in pixels across its bounding box."""
COLOUR_JITTER = 25
COLOURS = {
    "red": (215, 35, 35),
    "green": (35, 160, 55),
    "blue": (35, 75, 215),
    "yellow": (235, 200, 25),
    "purple": (135, 55, 185),
    "orange": (245, 125, 25),
}
SHAPES = ("circle", "square", "triangle", "cross")
COUNTS = (1, 2, 3, 4)
QUESTIONS = {
    "colour": ("What colour are the shapes?", "Which colour is in this picture?", "Name the colour of the shapes."),
    "shape": ("What shape is drawn here?", "Which shape do you see?", "Name the shape in the picture."),
    "count": ("How many shapes are there?", "Count the shapes.", "How many shapes do you see?"),
}
KINDS = tuple(QUESTIONS)
ANSWERS = {"colour": tuple(COLOURS), "shape": SHAPES, "count": tuple(str(n) for n in COUNTS)}

log = logging.getLogger("homelab_ft.demo.shapes")  # also when run as __main__


@dataclass(frozen=True)
class Scene:
    """What a picture shows: `cells` are the grid cells (0-3, row by row) holding a shape."""

    colour: str
    shape: str
    cells: tuple[int, ...]

    @property
    def count(self) -> int:
        return len(self.cells)

    def answer(self, kind: str) -> str:
        return {"colour": self.colour, "shape": self.shape, "count": str(self.count)}[kind]


@dataclass(frozen=True)
class Example:
    """One generated row and its picture (a PIL image, written to the path its row names)."""

    row: dict
    image: object
    scene: Scene

    @property
    def image_path(self) -> str:
        return self.row["messages"][0]["content"][0]["path"]


def make_rows(split: str, *, num_rows: int, seed: int = SEED) -> list[Example]:
    """`num_rows` rows of one split, deterministic for a given seed.

    Row i asks about KINDS[i % 3]; the value asked for and the wording cycle together through all
    their pairs, so each wording's answers are balanced; everything else is drawn at random."""
    if split not in SPLITS:
        raise ValueError(f"split {split!r}: expected one of {SPLITS}")
    rng = random.Random(f"{seed}-{split}")
    examples = []
    for index in range(num_rows):
        kind, turn = KINDS[index % len(KINDS)], index // len(KINDS)
        asked = ANSWERS[kind][turn % len(ANSWERS[kind])]
        wording = QUESTIONS[kind][turn // len(ANSWERS[kind]) % len(QUESTIONS[kind])]
        picked = {name: rng.choice(options) for name, options in ANSWERS.items()} | {kind: asked}
        cells = tuple(sorted(rng.sample(range(4), int(picked["count"]))))
        scene = Scene(picked["colour"], picked["shape"], cells)
        image = draw(scene, rng)
        path = f"images/{split}-{index:04d}.png"
        row = {
            "messages": [
                {"role": "user", "content": [{"type": "image", "path": path}, {"type": "text", "text": wording}]},
                {"role": "assistant", "content": scene.answer(kind)},
            ]
        }
        examples.append(Example(row=row, image=image, scene=scene))
    return examples


def draw(scene: Scene, rng: random.Random):
    """The picture of `scene` as a PIL RGB image; `rng` places, sizes and tints everything."""
    import numpy as np
    from PIL import Image, ImageDraw

    noise = np.random.default_rng(rng.getrandbits(64))
    grey = rng.randint(195, 245)
    # grey per pixel (sigma 10) plus a faint tint per picture (sigma 4): the background is never
    # one flat colour, but always far less saturated than a shape (>= 100 between channels)
    pixels = grey + noise.normal(0.0, 10.0, (CANVAS_PX, CANVAS_PX, 1)) + noise.normal(0.0, 4.0, (1, 1, 3))
    image = Image.fromarray(np.clip(pixels, 0, 255).astype(np.uint8))
    pen = ImageDraw.Draw(image)
    for cell in scene.cells:
        size = rng.randint(*SHAPE_PX)
        margin = (CELL_PX - size) // 2
        x = cell % 2 * CELL_PX + margin + rng.randint(-2, 2)
        y = cell // 2 * CELL_PX + margin + rng.randint(-2, 2)
        fill = tuple(min(255, max(0, c + rng.randint(-COLOUR_JITTER, COLOUR_JITTER))) for c in COLOURS[scene.colour])
        _draw_shape(pen, scene.shape, (x, y, x + size - 1, y + size - 1), fill)
    return image


def _draw_shape(pen, shape: str, box: tuple[int, int, int, int], fill: tuple[int, ...]) -> None:
    left, top, right, bottom = box
    if shape == "circle":
        pen.ellipse(box, fill=fill)
    elif shape == "square":
        pen.rectangle(box, fill=fill)
    elif shape == "triangle":
        pen.polygon([((left + right) / 2, top), (right, bottom), (left, bottom)], fill=fill)
    elif shape == "cross":
        size = right - left + 1
        arm = size // 3
        start = left + (size - arm) // 2
        pen.rectangle((start, top, start + arm - 1, bottom), fill=fill)
        start = top + (size - arm) // 2
        pen.rectangle((left, start, right, start + arm - 1), fill=fill)
    else:
        raise ValueError(f"shape {shape!r}: expected one of {SHAPES}")


def write_dataset(out_dir: Path, *, num_train: int = NUM_TRAIN_ROWS, num_eval: int = NUM_EVAL_ROWS,
                  seed: int = SEED) -> list[Path]:
    """out_dir/train.jsonl and out_dir/eval.jsonl, and the PNG files their rows name under out_dir/images."""
    (out_dir / "images").mkdir(parents=True, exist_ok=True)
    paths = []
    for split, num_rows in zip(SPLITS, (num_train, num_eval), strict=True):
        examples = make_rows(split, num_rows=num_rows, seed=seed)
        for example in examples:
            example.image.save(out_dir / example.image_path)
        path = out_dir / f"{split}.jsonl"
        path.write_text("".join(json.dumps(ex.row) + "\n" for ex in examples), encoding="utf-8", newline="\n")
        paths.append(path)
    return paths


def read_rows(data_file: Path) -> list[dict]:
    with Path(data_file).open(encoding="utf-8") as fh:
        return [json.loads(line) for line in fh if line.strip()]


def image_file(data_file: Path, row: dict) -> Path:
    """The picture a row names, relative to the data file that holds the row."""
    part = next(p for p in row["messages"][0]["content"] if p["type"] == "image")
    return Path(data_file).parent / part["path"]


# --------------------------------------------------------------------------------------------
# scoring


def question_of(row: dict) -> str:
    return next(p["text"] for p in row["messages"][0]["content"] if p["type"] == "text")


def kind_of(row: dict) -> str:
    question = question_of(row)
    return next(kind for kind, wordings in QUESTIONS.items() if question in wordings)


def grade(reply: str, expected: str) -> bool:
    """Exact: the reply, less surrounding white space, is the answer word ("Red", "red." are wrong)."""
    return reply.strip() == expected


def chance(rows: list[dict]) -> float:
    """The best score of an answerer that reads the question but not the picture: for each wording,
    its most frequent answer. 2/9 on either shipped split (every wording's answers balanced)."""
    answers: dict[str, Counter] = {}
    for row in rows:
        answers.setdefault(question_of(row), Counter())[row["messages"][-1]["content"]] += 1
    return sum(counts.most_common(1)[0][1] for counts in answers.values()) / len(rows) if rows else 0.0


@dataclass(frozen=True)
class Reply:
    question: str
    expected: str
    got: str
    correct: bool


@dataclass(frozen=True)
class ShapesScore:
    """Exact-match accuracy on held-out rows, per kind of question, beside what guessing scores."""

    num_rows: int
    num_correct: int
    chance: float
    per_kind: dict[str, tuple[int, int]]
    """kind -> (correct, rows)."""
    replies: tuple[Reply, ...]

    @property
    def accuracy(self) -> float:
        return self.num_correct / self.num_rows if self.num_rows else 0.0

    def summary(self) -> str:
        """One line: correct of all, per kind, and chance."""
        kinds = ", ".join(f"{kind} {good}/{total}" for kind, (good, total) in self.per_kind.items())
        return f"{self.num_correct}/{self.num_rows} correct ({self.accuracy:.0%}; {kinds}); chance {self.chance:.0%}"


def score(model, processor, rows: list[dict], *, data_file: Path, batch_size: int = 16) -> ShapesScore:
    """Greedy replies to each row's question about its picture, graded exactly against its answer."""
    from PIL import Image

    images = []
    for row in rows:
        with Image.open(image_file(data_file, row)) as image:
            images.append(image.convert("RGB"))
    replies = answer(model, processor, [row["messages"][:-1] for row in rows], images, batch_size=batch_size)
    graded, per_kind = [], {kind: [0, 0] for kind in KINDS}
    for row, reply in zip(rows, replies, strict=True):
        expected = row["messages"][-1]["content"]
        graded.append(Reply(question=question_of(row), expected=expected, got=reply, correct=grade(reply, expected)))
        tally = per_kind[kind_of(row)]
        tally[0] += graded[-1].correct
        tally[1] += 1
    return ShapesScore(
        num_rows=len(rows),
        num_correct=sum(r.correct for r in graded),
        chance=chance(rows),
        per_kind={kind: (good, total) for kind, (good, total) in per_kind.items() if total},
        replies=tuple(graded),
    )


def answer(model, processor, conversations: list[list[dict]], images: list, *, batch_size: int = 16) -> list[str]:
    """Greedy replies, one picture per conversation, in left-padded batches (every prompt ends
    where generation starts), each as long as the longest answer and an end of turn in the
    processor's vocabulary (3 tokens in SmolLM2's: "triangle" is 2), so a ramble is cut there."""
    import torch

    tokenizer = processor.tokenizer
    words = [word for kind in KINDS for word in ANSWERS[kind]]
    max_new_tokens = 1 + max(len(ids) for ids in tokenizer(words, add_special_tokens=False)["input_ids"])
    texts = [processor.apply_chat_template(conv, add_generation_prompt=True) for conv in conversations]
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    side, tokenizer.padding_side = tokenizer.padding_side, "left"
    replies: list[str] = []
    model.eval()
    try:
        for start in range(0, len(texts), batch_size):
            batch = processor(text=texts[start : start + batch_size],
                              images=[[image] for image in images[start : start + batch_size]],
                              return_tensors="pt", padding=True).to(model.device)
            with torch.inference_mode():
                out = model.generate(**batch, max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=pad_id)
            replies += tokenizer.batch_decode(out[:, batch["input_ids"].shape[1] :], skip_special_tokens=True)
    finally:
        tokenizer.padding_side = side
    return replies


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m homelab_ft.demo.shapes", description=__doc__.splitlines()[0])
    parser.add_argument("--write-dataset", type=Path, metavar="DIR", help="write train.jsonl, eval.jsonl, images/ into DIR")
    parser.add_argument("--score", type=Path, metavar="MODEL_DIR", help="score a model folder on --data's rows")
    parser.add_argument("--data", type=Path, metavar="JSONL", help="the rows --score asks (their images beside them)")
    args = parser.parse_args(argv)
    from homelab_ft import logs

    logs.configure()
    if args.write_dataset:
        for path in write_dataset(args.write_dataset):
            log.info("wrote %s", path)
    if args.score:
        if args.data is None:
            parser.error("--score needs --data")
        import torch
        from transformers import AutoModelForImageTextToText, AutoProcessor

        model = AutoModelForImageTextToText.from_pretrained(args.score, dtype=torch.float32)
        result = score(model, AutoProcessor.from_pretrained(args.score), read_rows(args.data), data_file=args.data)
        log.info("%s: %s", args.score, result.summary())
    if not (args.write_dataset or args.score):
        parser.print_help()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
