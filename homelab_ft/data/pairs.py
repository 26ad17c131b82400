"""Preference pairs: sources -> pairs -> chat template -> two token rows with answer-only labels -> collate.

The same sources (sources.py), formats (formats.py, format `preference`), chat templates and
loss-mask rule (templates.py) as SFT data. A pair becomes two token rows, prompt + chosen and
prompt + rejected, whose labels cover only the answer turns: the trained span rule of
templates.py, restricted to what follows the prompt (a multi-turn prompt's earlier assistant
turns are context, not answer).

Length: each row is cut to `data.max_length` (`overlong: truncate`) or the pair is dropped
(`overlong: drop`). A prompt that leaves either answer no token within `max_length` stops the run
naming the row (`bad_rows: fail`) or is counted and skipped (`bad_rows: skip`). Pairs are never
packed: each answer is scored whole against its prompt. An empty or whitespace-only prompt, chosen or
rejected is a bad row of formats.py, failed or skipped by the same `bad_rows` rule.

Tokenised pairs go through the one cached map and kept-rows count of rows.py, as SFT samples do,
under a fingerprint of the pairs, tokenizer, template and settings.

Unpaired rows (KTO, format `unpaired`) take the same path as a pair whose two sides are the row's
own completion (`answer`) and a mismatched one (`kl`): the completion of another row with another
prompt, which KTO's reference point z0 is estimated on (Ethayarajh et al. 2024, eq. 8; TRL's
KTOTrainer pairs each prompt with another row's completion the same way). Fixing the mismatch per
row, here, makes the estimate the same however a step is split over micro-batches and ranks, and
lets the reference cache score both sides as it scores a pair's.
"""

from __future__ import annotations

from pathlib import Path

from homelab_ft.data import packing, rows, sources, templates
from homelab_ft.data.report import DataReport, PreparedData
from homelab_ft.data.rows import BAD_TEMPLATE, KEPT, NO_TARGET, OK, collate
from homelab_ft.errors import UserError
from homelab_ft.labels import IGNORE_INDEX
from homelab_ft.recipe.config import DataConfig

SIDES = ("chosen", "rejected")
PAIR_ROWS = rows.RowKind(cache_prefix="pairs", fingerprint_tag=(b"pairs",), turn_columns=("messages", *SIDES),
                         sides=SIDES, desc="tokenising pairs")
"""A pair is two token rows, prompt + chosen and prompt + rejected."""
COLUMNS = tuple(PAIR_ROWS.token_columns())
UNPAIRED_SIDES = ("answer", "kl")
UNPAIRED_ROWS = rows.RowKind(cache_prefix="unpaired", fingerprint_tag=(b"unpaired",),
                             turn_columns=("messages", *UNPAIRED_SIDES), sides=UNPAIRED_SIDES,
                             desc="tokenising unpaired rows", kept_columns=("label",))
"""An unpaired row is two token rows, prompt + its completion and prompt + a mismatched completion."""
MISMATCH_LOOKAHEAD = 64
"""Rows looked ahead for one with another prompt (a set of many answers per prompt, in a row)."""


def prepare_pairs(data_cfg: DataConfig, tokenizer, *, seed: int, base_dir: Path | None = None,
                  unpaired: bool = False) -> PreparedData:
    """Read, check, mix, split and tokenise (cached) the recipe's preference pairs, or its unpaired
    rows (`unpaired`: dpo.loss kto), each with its mismatched completion."""
    kind = UNPAIRED_ROWS if unpaired else PAIR_ROWS
    sources.check_sources_declared(data_cfg)
    template = templates.resolve_template(tokenizer, data_cfg.chat_template, base_dir=base_dir)
    if template is None:
        raise UserError("the tokenizer has no chat template, and preference pairs are rendered through one; set "
                        "data.chat_template (e.g. chatml)")
    train_parts, train_reports, eval_parts, eval_reports = sources.read_and_mix(
        data_cfg, seed=seed, base_dir=base_dir, preference="unpaired" if unpaired else "preference")
    if unpaired:
        train_parts, eval_parts = mismatched(train_parts), mismatched(eval_parts)
    train, held_out, cache_hit = rows.kept_splits(
        train_parts, eval_parts, tokenize=lambda parts: _tokenize(parts, tokenizer, template, data_cfg, kind=kind),
        kind=kind, cfg=data_cfg, unit="row" if unpaired else "pair")
    num_eval = len(held_out.rows) if held_out is not None else 0
    eval_ds = held_out.rows if num_eval else None
    lengths = train.lengths.tolist()
    report = DataReport(
        sources=tuple(train_reports),
        eval_sources=tuple(eval_reports),
        num_train_samples=len(train.rows),
        num_eval_samples=num_eval,
        num_train_rows=len(train.rows),
        max_length=data_cfg.max_length,
        packed=False,
        non_pad_fraction=packing.non_pad_fraction(lengths, num_rows=len(lengths), max_length=data_cfg.max_length),
        cache_hit=cache_hit,
        pairs=True,
        desirable=_desirable(train.rows) if unpaired else None,
        **rows.report_counts(train),
    )
    return PreparedData(train=train.rows, eval=eval_ds, report=report)


def mismatched(samples: list[dict]) -> list[dict]:
    """Each unpaired sample with `kl`: the completion of the next sample (cyclically) whose prompt
    differs, within MISMATCH_LOOKAHEAD rows (the next one when none does: a set of one prompt)."""
    n = len(samples)
    out = []
    for i, sample in enumerate(samples):
        ahead = ((i + k) % n for k in range(1, min(n, MISMATCH_LOOKAHEAD + 1)))
        j = next((j for j in ahead if samples[j]["messages"] != sample["messages"]), (i + 1) % n)
        out.append({**sample, "kl": samples[j]["answer"]})
    return out


def _desirable(ds) -> tuple[int, int]:
    labels = ds.with_format("arrow")[:].column("label").to_pylist()
    return sum(labels), len(labels) - sum(labels)


def collate_pairs(rows: list[dict], *, pad_token_id: int) -> dict:
    """B pairs -> one batch of 2B rows, the B chosen first, then the B rejected, in the same order.

    One concatenated batch means one forward per micro-batch (and one weight all-gather under
    FSDP2) instead of two. Rows carry `reference_logps` (chosen, rejected) when a full fine-tune's
    reference was cached; the batch then has them as a [2B] tensor in the same row order. Unpaired
    rows give their B completions, then their B mismatched completions, and `label` ([B] bool).
    """
    import torch

    sides = UNPAIRED_SIDES if "label" in rows[0] else SIDES
    sequences = [{"input_ids": r[f"{side}_input_ids"], "labels": r[f"{side}_labels"]} for side in sides for r in rows]
    batch = collate(sequences, pad_token_id=pad_token_id)
    if "label" in rows[0]:
        batch["label"] = torch.tensor([bool(r["label"]) for r in rows], dtype=torch.bool)
    if "reference_logps" in rows[0]:
        batch["reference_logps"] = torch.tensor([r["reference_logps"][k] for k in range(2) for r in rows],
                                                dtype=torch.float32)
    return batch


# --------------------------------------------------------------------------------------------
# tokenising


def _tokenize(pairs: list[dict], tokenizer, template: str, cfg: DataConfig, *, kind: rows.RowKind):
    """The pairs' token rows through the cached map; the settings are everything _PairEncoder reads."""
    settings = [template, cfg.max_length, cfg.overlong, cfg.bad_rows]
    return rows.tokenize(pairs, tokenizer, kind=kind, encode=_PairEncoder(tokenizer, template, cfg, sides=kind.sides),
                         settings=settings, cfg=cfg)


def answer_spans(tokenizer, template: str, prompt: list[dict], answer: list[dict]) -> tuple[str, list]:
    """The rendered prompt + answer and the character spans of the answer's assistant turns."""
    text, spans = templates.chat_spans(tokenizer, template, prompt + answer, train_on_inputs=False)
    start = len(templates.render(tokenizer, template, prompt, add_generation_prompt=True))
    return text, [(a, b) for a, b in spans if a >= start]


class _PairEncoder:
    """The map function: render both sides, tokenise with offsets, answer labels, fit to max_length."""

    def __init__(self, tokenizer, template: str, cfg: DataConfig, *, sides: tuple[str, ...]):
        self.tokenizer, self.template, self.cfg, self.sides = tokenizer, template, cfg, sides

    def __call__(self, batch: dict[str, list]) -> dict[str, list]:
        n = len(batch["messages"])
        out = {f"{side}_{name}": [[] for _ in range(n)] for side in self.sides for name in ("input_ids", "labels")}
        out["status"] = [OK] * n
        rendered = {}
        for i in range(n):
            try:
                rendered[i] = [answer_spans(self.tokenizer, self.template, batch["messages"][i], batch[side][i])
                               for side in self.sides]
            except templates.SpanError as err:
                if self.cfg.bad_rows == "fail":
                    raise UserError(f"{batch['origin'][i]}: {err}") from None
                out["status"][i] = BAD_TEMPLATE
        good = list(rendered)
        if not good:
            return out
        # The template writes BOS where the model wants one (as in sft._Encoder).
        texts = [rendered[i][k][0] for k in range(2) for i in good]
        enc = self.tokenizer(texts, add_special_tokens=False, return_offsets_mapping=True)
        for j, i in enumerate(good):
            fitted, prompt_tokens = [], 0
            for k in range(len(self.sides)):
                at = k * len(good) + j
                labels = templates.labels_from_spans(enc["input_ids"][at], enc["offset_mapping"][at], rendered[i][k][1])
                prompt_tokens = max(prompt_tokens, next((t for t, x in enumerate(labels) if x != IGNORE_INDEX), len(labels)))
                fitted.append(rows.fit_row(enc["input_ids"][at], labels, self.cfg))
            status = max(f[2] for f in fitted)  # NO_TARGET > TOO_LONG > TRUNCATED > OK
            if status == NO_TARGET and self.cfg.bad_rows == "fail":
                raise UserError(
                    f"{batch['origin'][i]}: the prompt takes {prompt_tokens} tokens and leaves no room for an answer "
                    f"within data.max_length={self.cfg.max_length}; raise data.max_length, shorten the prompt, or set "
                    "data.bad_rows=skip to leave such pairs out")
            out["status"][i] = status
            if status in KEPT:
                for k, side in enumerate(self.sides):
                    out[f"{side}_input_ids"][i], out[f"{side}_labels"][i] = fitted[k][0], fitted[k][1]
        return out
