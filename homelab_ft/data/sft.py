"""The SFT pipeline: sources -> formats -> chat template -> tokens + loss mask -> truncate/drop -> pack.

`prepare_data` reads and checks every source and mixes them (sources.py), tokenises with the loss
mask (templates.py) through the one cached map (rows.py), and packs (packing.py). The trainer
shuffles and shards the final rows itself, per epoch; the order here is only the deterministic
mix of sources. Preference pairs take the same road in pairs.py; `prepare_for` (prepare.py)
picks the pipeline a recipe's objective trains on.
"""

from __future__ import annotations

from pathlib import Path

from homelab_ft.data import image_rows, packing, rows, sources, templates
from homelab_ft.data.report import DataReport, PreparedData
from homelab_ft.data.rows import BAD_TEMPLATE, OK
from homelab_ft.errors import UserError
from homelab_ft.recipe.config import DataConfig

SAMPLE_ROWS = rows.RowKind(cache_prefix="tokenized", fingerprint_tag=(), turn_columns=("messages",), sides=("",),
                           desc="tokenising")
"""A sample is one token row, `input_ids` and `labels`."""


def prepare_data(data_cfg: DataConfig, tokenizer, *, seed: int, base_dir: Path | None = None, processor=None,
                 refuse_cut: bool = True) -> PreparedData:
    """Read, check, mix, split, tokenise (cached) and pack the recipe's data. Image rows
    (`data.images`) are read through `processor` (image_rows.py); `refuse_cut`: a row whose cut would
    fall in an image stops the run (`data inspect` lists such rows instead)."""
    sources.check_sources_declared(data_cfg)
    template = templates.resolve_template(processor or tokenizer, data_cfg.chat_template, base_dir=base_dir)
    train_parts, train_reports, eval_parts, eval_reports = sources.read_and_mix(data_cfg, seed=seed, base_dir=base_dir)

    cut: list[str] = []  # rows whose cut would fall in an image, named by `data inspect`
    if data_cfg.images:
        def tokenize(parts):
            return _tokenize_images(parts, processor, template, data_cfg, refuse_cut=refuse_cut, cut=cut)
    else:
        def tokenize(parts):
            return _tokenize(parts, tokenizer, template, data_cfg)
    kind = image_rows.IMAGE_ROWS if data_cfg.images else SAMPLE_ROWS
    train, held_out, cache_hit = rows.kept_splits(train_parts, eval_parts, tokenize=tokenize, kind=kind, cfg=data_cfg,
                                                  unit="sample")
    num_eval = len(held_out.rows) if held_out is not None else 0
    eval_ds = _finish(held_out.rows, held_out.lengths, data_cfg, seed=seed) if num_eval else None

    lengths = train.lengths.tolist()
    final = _finish(train.rows, lengths, data_cfg, seed=seed)
    report = DataReport(
        sources=tuple(train_reports),
        eval_sources=tuple(eval_reports),
        num_train_samples=len(lengths),
        num_eval_samples=num_eval,
        num_train_rows=len(final),
        max_length=data_cfg.max_length,
        packed=data_cfg.packing,
        non_pad_fraction=packing.non_pad_fraction(lengths, num_rows=len(final), max_length=data_cfg.max_length),
        cache_hit=cache_hit,
        **rows.report_counts(train),
        **(image_rows.report_fields(train, cut=cut) if data_cfg.images else {}),
    )
    pixels = image_rows.PixelBatcher(processor=processor, cfg=data_cfg) if data_cfg.images else None
    return PreparedData(train=final, eval=eval_ds, report=report, pixels=pixels)


def _tokenize(samples: list[dict], tokenizer, template: str | None, cfg: DataConfig):
    """The samples' token rows through the cached map; the settings are everything _Encoder reads."""
    settings = [template, tokenizer.eos_token, cfg.max_length, cfg.overlong, cfg.train_on_inputs, cfg.bad_rows]
    return rows.tokenize(samples, tokenizer, kind=SAMPLE_ROWS, encode=_Encoder(tokenizer, template, cfg),
                         settings=settings, cfg=cfg)


def _tokenize_images(samples: list[dict], processor, template: str | None, cfg: DataConfig, *, refuse_cut: bool,
                     cut: list[str]):
    """Image samples' token rows through the cached map (image_rows.py); a cut inside an image refused,
    or (not `refuse_cut`) the rows it would fall in added to `cut`."""
    samples = image_rows.as_image_samples(samples)
    ds, hit = rows.tokenize(samples, processor.tokenizer, kind=image_rows.IMAGE_ROWS,
                            encode=image_rows.ImageEncoder(processor, template, cfg),
                            settings=image_rows.settings(processor, template, cfg, samples), cfg=cfg)
    if refuse_cut:
        image_rows.refuse_cut(ds, cfg)
    cut.extend(image_rows.cut_origins(ds))
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
                out["input_ids"][i], out["labels"][i], out["status"][i] = rows.fit_row(ids, labels, self.cfg)
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


def _finish(ds, lengths, cfg: DataConfig, *, seed: int):
    """Final rows: the tokenised samples, or packed rows when `data.packing` is on."""
    if not cfg.packing:
        return ds
    import datasets
    from datasets.table import InMemoryTable

    bins = packing.pack_bins(list(lengths), max_length=cfg.max_length)
    table = packing.pack_table(ds.with_format("arrow")[:], bins, seed=seed, shuffle=cfg.shuffle)
    return datasets.Dataset(InMemoryTable(table))
