"""Prompts for GRPO: sources -> prompt rows -> the prompt's tokens, its other columns kept for the rewards.

A GRPO row is what TRL's `GRPOTrainer` reads: a `prompt`, either a string (used as it is, no chat
template: TRL's "standard" format) or a list of chat messages (rendered with the chat template up to
the assistant's turn: "conversational"), and any other columns (`answer`, `solution`, a test case),
which every reward function receives by name, one value per completion. `fields: {prompt: question}`
reads the prompt from another column. A `messages` row (the chat format) also works: its prompt is
the turns before its last assistant turn, so an SFT data set's rows can be rewarded against the answers
kept in their other columns.

The same sources as SFT (sources.py: files, globs, folders, `save_to_disk`, the hub cache, the
eval hold-out, weights and mixing), and the same bad-row rule: an empty prompt or one of another
type stops the run naming file and row (`data.bad_rows: fail`) or is counted and skipped. A prompt
longer than `data.max_length` tokens keeps its last `max_length` tokens (`overlong: truncate`,
as TRL cuts prompts from the left) or is dropped (`overlong: drop`); completions come on top of it
(`grpo.max_completion_length`).

Rows are kept as a `datasets.Dataset` of `prompt_ids`, `prompt` and `columns` (the last two as JSON,
since a prompt may be text in one row and messages in the next) and `origin`.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

from homelab_ft.data import sources, templates
from homelab_ft.data.report import DataReport, PreparedData, SourceReport
from homelab_ft.errors import UserError
from homelab_ft.recipe.config import DataConfig, SourceConfig


def prepare_prompts(data_cfg: DataConfig, tokenizer, *, seed: int, base_dir: Path | None = None) -> PreparedData:
    """Read, check, mix, split and tokenise the recipe's prompts (module docstring)."""
    import datasets

    sources.check_sources_declared(data_cfg)
    template = templates.resolve_template(tokenizer, data_cfg.chat_template, base_dir=base_dir)
    train_parts, train_reports, eval_parts, eval_reports = [], [], [], []
    for i, src in enumerate(data_cfg.sources):
        rows, report = _read(src, data_cfg, where=f"data.sources[{i}]", base_dir=base_dir)
        held = []
        if not data_cfg.eval_sources and data_cfg.eval_fraction > 0:
            rows, held = sources.hold_out(rows, fraction=data_cfg.eval_fraction, rng=random.Random(f"{seed}:eval:{i}"))
        used = sources.weighted(rows, weight=src.weight, rng=random.Random(f"{seed}:weight:{i}"))
        train_parts += used
        eval_parts += held
        train_reports.append(SourceReport(src.path, report[0], report[1], report[2], len(used), report[3]))
    for i, src in enumerate(data_cfg.eval_sources):
        rows, report = _read(src, data_cfg, where=f"data.eval_sources[{i}]", base_dir=base_dir)
        eval_parts += rows
        eval_reports.append(SourceReport(src.path, report[0], report[1], report[2], len(rows), report[3]))
    if data_cfg.shuffle:
        random.Random(f"{seed}:mix").shuffle(train_parts)
    train, counts = _tokenised(train_parts, tokenizer, template, data_cfg)
    held_out, _ = _tokenised(eval_parts, tokenizer, template, data_cfg)
    if not train:
        raise UserError(f"no training prompts are left: {counts['dropped']} are longer than data.max_length="
                        f"{data_cfg.max_length} tokens (data.overlong=drop); raise data.max_length or set "
                        "data.overlong=truncate")
    lengths = [len(r["prompt_ids"]) for r in train]
    report = DataReport(
        sources=tuple(train_reports), eval_sources=tuple(eval_reports),
        num_train_samples=len(train), num_eval_samples=len(held_out), num_train_rows=len(train),
        num_train_tokens=sum(lengths), num_trained_tokens=0, num_truncated=counts["truncated"],
        num_dropped_overlong=counts["dropped"], num_dropped_no_target=0, num_bad_template=0,
        max_length=data_cfg.max_length, packed=False,
        non_pad_fraction=sum(lengths) / max(len(lengths) * max(lengths), 1), sample_lengths=tuple(lengths),
        cache_hit=False, prompts=True,
    )
    as_set = datasets.Dataset.from_list
    return PreparedData(train=as_set(train), eval=as_set(held_out) if held_out else None, report=report)


def _read(src: SourceConfig, cfg: DataConfig, *, where: str, base_dir: Path | None):
    """The prompt rows of one source and (format, rows read, rows skipped, first skip message)."""
    if src.format not in ("auto", "chat", "prompt_completion"):
        raise UserError(f"{where}.format={src.format}: objective=grpo reads prompts (a `prompt` column of text or chat "
                        "messages, or chat `messages`); use format: auto")
    unknown = set(src.fields) - {"prompt", "messages"}
    if unknown:
        raise UserError(f"{where}.fields: {sorted(unknown)[0]!r} is not read by objective=grpo; map `prompt` (or "
                        "`messages`) to your column, e.g. fields: {prompt: question}")
    raw, bad, num_rows = sources.source_rows(src, cfg, where=where, base_dir=base_dir)
    columns = set().union(*(row.keys() for _, _, row in raw))
    prompt_key, messages_key = src.fields.get("prompt", "prompt"), src.fields.get("messages", "messages")
    key = prompt_key if prompt_key in columns else messages_key if messages_key in columns else None
    if key is None:
        raise UserError(f"{where}: objective=grpo reads a `prompt` column (text or chat messages) or chat `messages`; "
                        f"{src.path} has {sorted(columns)}; map yours with fields: {{prompt: your_column}}")
    rows = []
    for file, number, row in raw:
        if src.limit is not None and len(rows) >= src.limit:
            break
        try:
            prompt = _prompt(row.get(key), key=key, chat=key == messages_key and key != prompt_key,
                             system=cfg.system_prompt, drop_system=cfg.drop_system_prompt)
        except ValueError as err:
            bad(file, number, f"field '{key}' {err}")
            continue
        rows.append({"prompt": prompt, "columns": {k: v for k, v in row.items() if k != key},
                     "origin": f"{file}: row {number}"})
    if not rows:
        raise bad.none_left(where, src.path)
    return rows, ("prompt", num_rows, bad.skipped, bad.first)


def _prompt(value, *, key: str, chat: bool, system: str | None, drop_system: bool):
    """A row's prompt: a non-blank string, or chat messages ending before the assistant's reply."""
    if isinstance(value, str):
        if chat:
            raise ValueError("is text; chat `messages` is a list of {role, content} turns")
        if not value.strip():
            raise ValueError("is empty")
        return value
    if not isinstance(value, list) or not value:
        raise ValueError(f"is {'empty' if value in ([], None) else 'a ' + type(value).__name__}; a prompt is text "
                         "or a list of {role, content} messages")
    turns = []
    for i, turn in enumerate(value):
        if not isinstance(turn, dict) or turn.get("role") not in ("system", "user", "assistant") \
                or not isinstance(turn.get("content"), str):
            raise ValueError(f"[{i}] is not a {{role: system|user|assistant, content: text}} turn")
        turns.append({"role": turn["role"], "content": turn["content"]})
    if chat:  # a chat row: the turns before its last assistant reply are the prompt
        last = max((i for i, t in enumerate(turns) if t["role"] == "assistant"), default=len(turns))
        turns = turns[:last]
    if drop_system:
        turns = [t for t in turns if t["role"] != "system"]
    elif system is not None and not any(t["role"] == "system" for t in turns):
        turns.insert(0, {"role": "system", "content": system})
    if not any(t["role"] == "user" and t["content"].strip() for t in turns):
        raise ValueError("has no user turn with text to answer")
    if turns[-1]["role"] == "assistant":
        raise ValueError("ends with an assistant turn; the prompt ends where the completion starts")
    return turns


def _tokenised(rows: list[dict], tokenizer, template: str | None, cfg: DataConfig) -> tuple[list[dict], dict]:
    """Each row with its prompt's tokens, fitted to data.max_length; and the truncated/dropped counts."""
    out, counts = [], {"truncated": 0, "dropped": 0}
    for row in rows:
        ids = prompt_ids(row["prompt"], tokenizer, template, where=row["origin"])
        if len(ids) > cfg.max_length:
            if cfg.overlong == "drop":
                counts["dropped"] += 1
                continue
            counts["truncated"] += 1
            ids = ids[-cfg.max_length:]
        out.append({"prompt_ids": ids, "prompt": json.dumps(row["prompt"]), "columns": json.dumps(row["columns"]),
                    "origin": row["origin"]})
    return out, counts


def prompt_ids(prompt, tokenizer, template: str | None, *, where: str) -> list[int]:
    """A text prompt's tokens as written; chat messages rendered through the template with the
    assistant's turn opened (add_generation_prompt), as the trained model will be prompted."""
    if isinstance(prompt, str):
        return tokenizer(prompt, add_special_tokens=True)["input_ids"]
    if template is None:
        raise UserError(f"{where}: a chat prompt is rendered through a chat template and the tokenizer has none; "
                        "set data.chat_template (e.g. chatml), or give prompts as text")
    text = templates.render(tokenizer, template, prompt, add_generation_prompt=True)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def decoded(row: dict) -> tuple[object, dict]:
    """A prepared row's prompt (text or messages) and its other columns, as the data set had them."""
    return json.loads(row["prompt"]), json.loads(row["columns"])
