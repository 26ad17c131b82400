"""Image rows (`data.images`): chat samples read through the checkpoint's own processor and chat
template, their image tokens kept out of the loss and never cut, and their batches' pixel inputs.

The chat template renders the conversation with its image parts (images.for_template); the
processor expands each image placeholder into the tokens its model reads for that image (Qwen2-VL
one `<|image_pad|>` per 28x28 pixels, Idefics3 its tiles' rows and columns, Gemma 3 a fixed run
between `<start_of_image>` and `<end_of_image>`) and reports where it did
(`return_text_replacement_offsets`). A row's image tokens are every token overlapping what the
processor wrote for an image, widened by the markup the template writes around the placeholder
(`image_markup`: Qwen2-VL's `<|vision_start|>` / `<|vision_end|>`), derived from the template itself
by rendering a turn with and without an image. Their labels are IGNORE_INDEX whatever else says
(`data.train_on_inputs` included), as are the prompt's and padding's (templates.py, rows.collate).

A row longer than `data.max_length` whose cut would fall at or before its last image token is
never cut: the model would find fewer image tokens than image features ("Image features and image
tokens do not match"). With `data.overlong: drop` it is dropped and counted as every overlong row
is; with `truncate` it gets the status CUT_IMAGE, and `refuse_cut` stops the run naming the first
such row, how many there are and the fixes (raise max_length, lower image_max_pixels, overlong:
drop). `data inspect` lists them instead. A row with no image in the cut part is truncated as text is.

A kept row carries its image refs (`images`), its number of images and image tokens (the tokens the
vision side's features fill, `feature_token`: what the planner counts per image and prices a step
at, data/lengths.py keeps them; the markup around them is masked too but is no feature) and the
per-token columns the processor adds beside `input_ids` (`mm_token_type_ids` for Qwen2-VL,
`token_type_ids` for Gemma 3: whatever keys its output has, never a family list). Pixels are not
stored: `PixelBatcher` reads a batch's images again and runs the processor on them (the keys of its
image processor's `model_input_names`: `pixel_values`, `image_grid_thw`, `pixel_attention_mask`,
`image_sizes` ...).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

import numpy as np

from homelab_ft.data import images, rows, templates
from homelab_ft.data.rows import BAD_IMAGE, BAD_TEMPLATE, CUT_IMAGE, OK, TOO_LONG, TRUNCATED
from homelab_ft.errors import UserError
from homelab_ft.labels import IGNORE_INDEX
from homelab_ft.recipe.config import DataConfig
from homelab_ft.rules import image_area

IMAGE_ROWS = rows.RowKind(cache_prefix="tokenized-images", fingerprint_tag=(b"images", b"2"), turn_columns=("messages",),
                          sides=("",), desc="tokenising (images)", text_columns=("conversation",))
"""An image sample: one token row, its conversation (with image parts) as JSON in `conversation`
(tag 2: `image_tokens` counts the features' placeholder, `feature_token`)."""

TEXT_KEYS = ("input_ids", "attention_mask", "offset_mapping", "text_replacement_offsets")
"""What the processor returns for the text that the pipeline reads itself (or drops, attention_mask)."""


def as_image_samples(samples: list[dict]) -> list[dict]:
    """Canonical chat samples as IMAGE_ROWS holds them: the conversation, image parts and all, as
    JSON (a column holds one type: a content is a string or a list of parts), the text in `messages`."""
    return [{**s, "conversation": json.dumps(s["messages"], ensure_ascii=False),
             "messages": [{"role": m["role"], "content": images.text_view(m["content"])} for m in s["messages"]]}
            for s in samples]


def settings(processor, template: str | None, cfg: DataConfig, samples: list[dict]) -> list:
    """What the image rows' tokens depend on beyond the samples: the processor's image settings, its
    image token, the template and data keys, and each image file's size and modification time (an
    image edited in place tokenises again)."""
    files = sorted({ref for s in samples for m in json.loads(s["conversation"]) for ref in images.image_refs([m])
                    if not ref.startswith("data:")})
    stats = [[f, os.stat(f).st_size, os.stat(f).st_mtime_ns] for f in files if os.path.exists(f)]
    return [type(processor).__name__, processor.image_processor.to_json_string(), processor.image_token, template,
            processor.tokenizer.eos_token, cfg.max_length, cfg.overlong, cfg.train_on_inputs, cfg.bad_rows,
            cfg.image_max_pixels, cfg.image_min_pixels, stats]


def image_markup(tokenizer, template: str, image_token: str) -> tuple[str, str]:
    """What the template writes before and after the processor's image placeholder for one image
    part: the text a turn gains when an image joins it, split at the placeholder ("", "" when the
    template writes the placeholder alone)."""
    def turn(content):
        return templates.render(tokenizer, template, [{"role": "user", "content": content}], add_generation_prompt=False)

    text = [{"type": "text", "text": "A"}, {"type": "text", "text": "B"}]
    with_image, without = turn([text[0], {"type": "image"}, text[1]]), turn(text)
    start = 0
    while start < min(len(with_image), len(without)) and with_image[start] == without[start]:
        start += 1
    end = 0
    while end < min(len(with_image), len(without)) - start and with_image[-1 - end] == without[-1 - end]:
        end += 1
    added = with_image[start:len(with_image) - end]
    at = added.find(image_token)
    return ("", "") if at < 0 else (added[:at], added[at + len(image_token):])


def feature_token(processor) -> int:
    """The token id the vision side's features fill, one per feature: the count the model's own check
    compares with its image features and the planner prices an image at (plan/shape/vision.py). It is
    the processor's placeholder (`image_token_id`) where that is among the ids it marks as image
    (`image_token_ids`, what mm_token_type_ids is built from; InternVL marks `<img>` and `</img>`
    too), else the one id it marks (Gemma 3's placeholder `<start_of_image>` is expanded into
    `<image_soft_token>`s between markers)."""
    marked = [i for i in processor.image_token_ids if i is not None]
    return processor.image_token_id if processor.image_token_id in marked or not marked else marked[0]


def token_extras(processor) -> list[str]:
    """The per-token columns the processor returns beside input_ids (from a text-only call)."""
    probe = processor(text=["x"])
    pixel = set(processor.image_processor.model_input_names)
    return sorted(k for k in probe if k not in TEXT_KEYS and k not in pixel)


class ImageEncoder:
    """The map function of image rows: render, read the images, the processor's tokens with
    offsets, labels, the image tokens masked, the fit to max_length (module docstring)."""

    def __init__(self, processor, template: str | None, cfg: DataConfig):
        if template is None:
            raise UserError("the processor and tokenizer have no chat template; set data.chat_template to the "
                            "checkpoint's (an image-text template writes each image part's placeholder)")
        self.processor, self.template, self.cfg = processor, template, cfg
        self.tokenizer = processor.tokenizer
        self.markup = image_markup(self.tokenizer, template, processor.image_token)
        self.feature_id = feature_token(processor)
        self.extras = token_extras(processor)
        self.kwargs = image_area.processor_kwargs(processor.image_processor, max_pixels=cfg.image_max_pixels,
                                                  min_pixels=cfg.image_min_pixels)

    def __call__(self, batch: dict[str, list]) -> dict[str, list]:
        rows_out = [self._row(json.loads(conversation), origin=origin)
                    for conversation, origin in zip(batch["conversation"], batch["origin"], strict=True)]
        return {key: [row[key] for row in rows_out] for key in self._left_out(OK)}

    def _left_out(self, status: int, refs: list[str] = (), image_tokens: int = 0) -> dict:
        """A row with no tokens (dropped or bad, `status`), its images counted as the report counts them."""
        return {"input_ids": [], "labels": [], "status": status, "images": list(refs), "num_images": len(refs),
                "image_tokens": image_tokens, **{k: [] for k in self.extras}}

    def _row(self, messages: list[dict], *, origin: str) -> dict:
        cfg = self.cfg
        refs = images.image_refs(messages)
        try:
            text, spans = templates.chat_spans(self.tokenizer, self.template, images.for_template(messages),
                                               train_on_inputs=cfg.train_on_inputs)
            pictures = [images.load(r, max_pixels=cfg.image_max_pixels, min_pixels=cfg.image_min_pixels) for r in refs]
        except (templates.SpanError, images.ImageError) as err:
            if cfg.bad_rows == "fail":
                raise UserError(f"{origin}: {err}; fix the row or set data.bad_rows=skip") from None
            return self._left_out(BAD_TEMPLATE if isinstance(err, templates.SpanError) else BAD_IMAGE, refs)
        enc = self.processor(text=[text], images=[pictures] if pictures else None, return_offsets_mapping=True,
                             return_text_replacement_offsets=True, **self.kwargs)
        ids, offsets = list(enc["input_ids"][0]), enc["offset_mapping"][0]
        # a processor with its own __call__ (Idefics3) leaves the offsets out when the row has no image
        replaced = [r for r in enc.get("text_replacement_offsets", [[]])[0] if r["type"] == "image"]
        marked = image_positions(offsets, replaced, text=text, markup=self.markup)
        labels = np.asarray(templates.labels_from_spans(ids, offsets, shifted(spans, replaced)))
        labels[marked] = IGNORE_INDEX
        status, keep = fit(len(ids), last_image=int(marked.max()) if len(marked) else -1, cfg=cfg)
        features = int(np.count_nonzero(np.asarray(ids) == self.feature_id))
        if status in (TOO_LONG, CUT_IMAGE):
            return self._left_out(status, refs, features)
        if (labels[:keep] == IGNORE_INDEX).all():
            return self._left_out(rows.NO_TARGET, refs, features)
        return {"input_ids": ids[:keep], "labels": labels[:keep].tolist(), "status": status, "images": refs,
                "num_images": len(refs), "image_tokens": features, **{k: list(enc[k][0])[:keep] for k in self.extras}}


def fit(length: int, *, last_image: int, cfg: DataConfig) -> tuple[int, int]:
    """(status, tokens kept) of a row of `length` tokens whose last image token is at `last_image`
    (-1: none): the text rule of rows.fit_row, except that a cut at or before an image token is CUT_IMAGE."""
    if length <= cfg.max_length:
        return OK, length
    if cfg.overlong == "drop":
        return TOO_LONG, 0
    if last_image >= cfg.max_length:
        return CUT_IMAGE, 0
    return TRUNCATED, cfg.max_length


def image_positions(offsets, replaced: list[dict], *, text: str, markup: tuple[str, str]) -> np.ndarray:
    """Token positions of every image: tokens overlapping what the processor wrote for it, or the
    template's markup right around its placeholder (`image_markup`)."""
    before, after = markup
    bounds = np.asarray(offsets, dtype=np.int64).reshape(-1, 2)
    marked = np.zeros(len(bounds), dtype=bool)
    for r in replaced:
        (start, end), (new_start, new_end) = r["span"], r["new_span"]
        lead = len(before) if before and text[start - len(before):start] == before else 0
        tail = len(after) if after and text[end:end + len(after)] == after else 0
        marked |= (bounds[:, 1] > new_start - lead) & (bounds[:, 0] < new_end + tail)
    return np.flatnonzero(marked)


def shifted(spans, replaced: list[dict]) -> list[tuple[int, int]]:
    """Character spans of the rendered text moved to where they are in the processor's expanded text
    (each image placeholder before them replaced by its tokens). Images are never in a trained turn
    unless train_on_inputs, whose one span starts at 0 and ends at the text's end."""
    def move(pos: int) -> int:
        return pos + sum(len(r["replacement"]) - (r["span"][1] - r["span"][0]) for r in replaced if r["span"][1] <= pos)

    return [(move(start), move(end)) for start, end in spans]


def refuse_cut(ds, cfg: DataConfig) -> None:
    """`overlong: truncate` never cuts inside an image: one line naming the first such row, how many
    rows of its split there are, and the fixes."""
    status = np.asarray(ds["status"])
    cut = np.flatnonzero(status == CUT_IMAGE)
    if not len(cut):
        return
    first = int(cut[0])
    raise UserError(f"{ds[first]['origin']}: its image tokens reach past data.max_length={cfg.max_length}, and cutting "
                    f"the row there would cut an image ({len(cut)} row(s) of its split like it); raise data.max_length, "
                    "lower data.image_max_pixels, or set data.overlong=drop to leave such rows out")


def report_fields(train: rows.Kept, *, cut: list[str]) -> dict:
    """What the data report and the planner's kept statistics say of the image rows (report.DataReport);
    `cut`: the rows (of both splits) whose cut would fall in an image."""
    table = train.rows.with_format("arrow")[:]
    counts = train.counts
    per_row = zip(table.column("num_images").to_pylist(), table.column("image_tokens").to_pylist(), strict=True)
    return {"num_bad_images": counts[BAD_IMAGE], "num_cut_images": counts[CUT_IMAGE], "image_rows": tuple(per_row),
            "cut_image_rows": tuple(cut)}


def cut_origins(ds, *, limit: int = 5) -> list[str]:
    """The first rows whose cut would fall in an image (`data inspect` names them)."""
    status = np.asarray(ds["status"])
    return [ds[int(i)]["origin"] for i in np.flatnonzero(status == CUT_IMAGE)[:limit]]


@dataclass(frozen=True)
class PixelBatcher:
    """A batch's image inputs: its rows' images read again and run through the processor with the
    placeholder they were tokenised with, the keys of the image processor's `model_input_names`."""

    processor: object
    cfg: DataConfig

    @staticmethod
    def token_columns(row: dict) -> list[str]:
        """The per-token columns an image row carries beside input_ids and labels."""
        return [k for k, v in row.items() if k not in ("input_ids", "labels", "images") and isinstance(v, list)]

    def __call__(self, batch_rows: list[dict]) -> dict:
        processor, cfg = self.processor, self.cfg
        with_images = [r for r in batch_rows if r["images"]]
        if not with_images:
            return {}
        pictures = [[images.load(ref, max_pixels=cfg.image_max_pixels, min_pixels=cfg.image_min_pixels)
                     for ref in r["images"]] for r in with_images]
        texts = [processor.image_token * len(p) for p in pictures]
        kwargs = image_area.processor_kwargs(processor.image_processor, max_pixels=cfg.image_max_pixels,
                                             min_pixels=cfg.image_min_pixels)
        out = processor(text=texts, images=pictures, return_tensors="pt", padding=True, **kwargs)
        return {k: out[k] for k in processor.image_processor.model_input_names if k in out}
