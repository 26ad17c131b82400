"""Formats: each source row, checked and converted into one canonical sample.

A row (read by sources.py) is converted by its format:

    {"messages": [{"role", "content"}, ...], "prompt": str, "completion": str, "kind": "chat" | "text"}

chat / alpaca / sharegpt rows become `messages` (rendered later by the chat template);
prompt_completion and text rows become plain `prompt` + `completion` (no template; text trains on
everything); preference rows become a pair (kind "pair": prompt turns in `messages`, `chosen`,
`rejected`); unpaired rows (KTO) become kind "unpaired": prompt turns in `messages`, the completion's
turns in `answer`, the boolean `label`. A bad row raises `RowError`; the caller turns it into a one-line `UserError` that
names file, row and field, or counts and skips it (`data.bad_rows: skip`).
"""

from __future__ import annotations

from pathlib import Path

from homelab_ft.errors import UserError

ROLES = ("system", "user", "assistant")
SHAREGPT_ROLES = {"system": "system", "human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "model": "assistant", "chatgpt": "assistant"}
FORMAT_FIELDS = {
    "preference": ("chosen", "rejected"),
    "unpaired": ("completion", "label"),
    "chat": ("messages",),
    "sharegpt": ("conversations",),
    "alpaca": ("instruction", "output"),
    "prompt_completion": ("prompt", "completion"),
    "text": ("text",),
}
"""Required columns of each format, in the order auto-detection tries them (pairs first: a
preference row may also carry `messages` as its prompt; an unpaired row's `label` tells it from
prompt_completion)."""
OPTIONAL_FIELDS = {"alpaca": ("input", "system"), "chat": (), "sharegpt": (), "prompt_completion": (), "text": (),
                   "preference": ("prompt", "messages"), "unpaired": ("prompt", "messages")}


class RowError(ValueError):
    """One bad row: `field` names the offending field (dotted), the message says what is wrong."""

    def __init__(self, field: str, problem: str):
        super().__init__(f"field '{field}' {problem}")


def detect_format(columns: set[str], *, where: str) -> str:
    for name, required in FORMAT_FIELDS.items():
        if all(c in columns for c in required):
            return name
    expected = "; ".join(f"{n}: {', '.join(r)}" for n, r in FORMAT_FIELDS.items())
    raise UserError(
        f"{where}: cannot tell the format from the columns {sorted(columns)}; expected one of ({expected}); "
        "set format: and, if your columns have other names, fields: {format_name: your_column}"
    )


def check_fields(fields: dict[str, str], fmt: str, columns: set[str], *, where: str) -> None:
    """A mapping must name a field of the format and a column the data has."""
    known = FORMAT_FIELDS[fmt] + OPTIONAL_FIELDS[fmt]
    for ours, theirs in fields.items():
        if ours not in known:
            raise UserError(f"{where}.fields: {ours!r} is not a field of format {fmt} (fields: {', '.join(known)})")
        if theirs not in columns:
            raise UserError(
                f"{where}.fields maps {ours} -> {theirs!r}, but the data has no column {theirs!r} "
                f"(columns: {', '.join(sorted(columns))})"
            )


def to_sample(row: dict, fmt: str, fields: dict[str, str], *, system_prompt: str | None, drop_system: bool,
              images: bool = False, image_dir: Path | None = None) -> dict:
    """Convert one row to the canonical sample, or raise RowError. `images` (data.images): a chat
    turn's content may hold image parts (images.py), kept as parts with their paths resolved
    against `image_dir`, the data file's folder."""
    col = {name: fields.get(name, name) for name in FORMAT_FIELDS[fmt] + OPTIONAL_FIELDS[fmt]}
    if fmt == "preference":
        return _to_pair(row, col, system_prompt=system_prompt, drop_system=drop_system)
    if fmt == "unpaired":
        return _to_unpaired(row, col, system_prompt=system_prompt, drop_system=drop_system)
    if fmt in ("prompt_completion", "text"):
        prompt = _string(row, col["prompt"]) if fmt == "prompt_completion" else ""
        completion = _string(row, col["completion" if fmt == "prompt_completion" else "text"])
        return {"kind": "text", "messages": [], "prompt": prompt, "completion": completion}
    if fmt == "alpaca":
        user = _string(row, col["instruction"])
        extra = _string(row, col["input"], optional=True)
        system = _string(row, col["system"], optional=True)
        messages = [{"role": "system", "content": system}] if system else []
        messages.append({"role": "user", "content": f"{user}\n\n{extra}" if extra else user})
        messages.append({"role": "assistant", "content": _string(row, col["output"])})
    elif fmt == "chat":
        messages = _turns(row, col["messages"], role_key="role", text_key="content", roles={r: r for r in ROLES},
                          images=images, image_dir=image_dir)
    else:
        messages = _turns(row, col["conversations"], role_key="from", text_key="value", roles=SHAREGPT_ROLES,
                          images=images, image_dir=image_dir)
    if drop_system:
        messages = [m for m in messages if m["role"] != "system"]
    elif system_prompt is not None and not any(m["role"] == "system" for m in messages):
        messages.insert(0, {"role": "system", "content": system_prompt})
    if not any(m["role"] == "assistant" for m in messages):
        raise RowError(col.get("messages", col.get("conversations", "output")), "has no assistant turn, so nothing would be learned")
    first = next(m["role"] for m in messages if m["role"] != "system")
    if first != "user":
        raise RowError(col.get("messages", col.get("conversations", "output")), f"starts with a {first} turn; the first non-system turn must be user")
    return {"kind": "chat", "messages": messages, "prompt": "", "completion": ""}


def _to_pair(row: dict, col: dict[str, str], *, system_prompt: str | None, drop_system: bool) -> dict:
    """A preference row -> {"kind": "pair", "messages": prompt turns, "chosen": turns, "rejected": turns}.

    Accepted layouts (the common hub ones):
    - `prompt` (string or turns) or `messages` (turns), with `chosen`/`rejected` as strings or as
      lists of assistant turns (TRL's explicit-prompt layout);
    - `chosen`/`rejected` as whole conversations (UltraFeedback-binarized): the turns they share
      are the prompt, the rest are the answers; a `prompt` column beside them is then ignored.
    """
    answers = {name: _answer(row, col[name]) for name in ("chosen", "rejected")}
    for name, turns in answers.items():
        _check_text(turns, col[name], listed=isinstance(row[col[name]], list))
    whole = all(any(m["role"] != "assistant" for m in turns) for turns in answers.values())
    if whole:
        chosen, rejected = answers["chosen"], answers["rejected"]
        shared = 0
        while shared < min(len(chosen), len(rejected)) and chosen[shared] == rejected[shared]:
            shared += 1
        while shared and chosen[shared - 1]["role"] == "assistant":  # a shared assistant turn ends an answer
            shared -= 1
        prompt, answers = chosen[:shared], {"chosen": chosen[shared:], "rejected": rejected[shared:]}
        if not prompt:
            raise RowError(col["chosen"], "and 'rejected' are conversations that share no prompt turns")
        prompt = _system(prompt, system_prompt=system_prompt, drop_system=drop_system)
        _check_prompt(prompt, col)
    else:
        prompt = _prompt(row, col, system_prompt=system_prompt, drop_system=drop_system)
    for name, turns in answers.items():
        if not turns or turns[0]["role"] != "assistant":
            raise RowError(col[name], "has no assistant answer after the prompt")
    if answers["chosen"] == answers["rejected"]:
        raise RowError(col["rejected"], f"is identical to '{col['chosen']}'; the pair has nothing to prefer")
    return {"kind": "pair", "messages": prompt, "chosen": answers["chosen"], "rejected": answers["rejected"],
            "prompt": "", "completion": ""}


def _to_unpaired(row: dict, col: dict[str, str], *, system_prompt: str | None, drop_system: bool) -> dict:
    """An unpaired row (KTO, TRL's unpaired preference layout) -> {"kind": "unpaired", "messages": prompt
    turns, "answer": the completion's turns, "label": True (desirable) or False (undesirable)}.

    The prompt is read as a pair's (`prompt` string or turns, or `messages`); the completion is a string
    or a list of assistant turns; the label must be a JSON boolean: 1/0 or "yes" would leave the user
    guessing which rows were read as thumbs up."""
    label = row.get(col["label"])
    if not isinstance(label, bool):
        shown = "missing" if label is None else f"{label!r} ({type(label).__name__})"
        raise RowError(col["label"], f"is {shown}, expected true (desirable) or false (undesirable)")
    answer = _answer(row, col["completion"])
    _check_text(answer, col["completion"], listed=isinstance(row[col["completion"]], list))
    if not answer or any(m["role"] != "assistant" for m in answer):
        raise RowError(col["completion"], "must be the assistant's answer (a string or assistant turns)")
    prompt = _prompt(row, col, system_prompt=system_prompt, drop_system=drop_system)
    return {"kind": "unpaired", "messages": prompt, "answer": answer, "label": label, "prompt": "", "completion": ""}


def _prompt(row: dict, col: dict[str, str], *, system_prompt: str | None, drop_system: bool) -> list[dict]:
    """The prompt turns of a pair or an unpaired row: `messages` (turns), or `prompt` (turns or a string)."""
    if col["messages"] in row and row[col["messages"]] is not None:
        prompt = _turns(row, col["messages"], role_key="role", text_key="content", roles={r: r for r in ROLES})
        _check_text(prompt, col["messages"], listed=True)
    elif col["prompt"] in row and isinstance(row[col["prompt"]], list):
        prompt = _turns(row, col["prompt"], role_key="role", text_key="content", roles={r: r for r in ROLES})
        _check_text(prompt, col["prompt"], listed=True)
    elif col["prompt"] in row and row[col["prompt"]] is not None:
        prompt = [{"role": "user", "content": _string(row, col["prompt"])}]
        _check_text(prompt, col["prompt"], listed=False)
    else:
        raise RowError(col["prompt"], f"is missing; a preference row needs its prompt ('{col['prompt']}' or '{col['messages']}')")
    prompt = _system(prompt, system_prompt=system_prompt, drop_system=drop_system)
    _check_prompt(prompt, col)
    return prompt


def _system(prompt: list[dict], *, system_prompt: str | None, drop_system: bool) -> list[dict]:
    if drop_system:
        return [m for m in prompt if m["role"] != "system"]
    if system_prompt is not None and not any(m["role"] == "system" for m in prompt):
        return [{"role": "system", "content": system_prompt}, *prompt]
    return prompt


def _check_prompt(prompt: list[dict], col: dict[str, str]) -> None:
    talk = [m["role"] for m in prompt if m["role"] != "system"]
    if not talk or talk[0] != "user":
        raise RowError(col["prompt"], "has no user turn first; the prompt must start with a user turn")
    if talk[-1] == "assistant":
        raise RowError(col["prompt"], "ends with an assistant turn; the answer must follow a user turn")


def _check_text(turns: list[dict], key: str, *, listed: bool) -> None:
    """An empty or whitespace-only prompt or answer is a bad row: DPO would push the model toward (or
    away from) saying nothing, and the pair carries no preference to learn. A system turn may be empty."""
    for i, turn in enumerate(turns):
        if turn["role"] != "system" and not turn["content"].strip():
            raise RowError(f"{key}[{i}].content" if listed else key, "is empty; a pair needs text in its prompt and both answers")


def _answer(row: dict, key: str) -> list[dict]:
    """`chosen`/`rejected`: a string is one assistant turn; a list is turns (role/content)."""
    value = row.get(key)
    if isinstance(value, list):
        return _turns(row, key, role_key="role", text_key="content", roles={r: r for r in ROLES})
    return [{"role": "assistant", "content": _string(row, key)}]


def _string(row: dict, key: str, *, optional: bool = False) -> str:
    if key not in row or row[key] is None:
        if optional:
            return ""
        raise RowError(key, "is missing")
    value = row[key]
    if not isinstance(value, str):
        raise RowError(key, f"is a {type(value).__name__}, expected a string")
    return value


def _turns(row: dict, key: str, *, role_key: str, text_key: str, roles: dict[str, str], images: bool = False,
           image_dir: Path | None = None) -> list[dict]:
    if key not in row or row[key] is None:
        raise RowError(key, "is missing")
    turns = row[key]
    if not isinstance(turns, list) or not turns:
        raise RowError(key, f"must be a non-empty list of turns, got {type(turns).__name__}")
    out = []
    for i, turn in enumerate(turns):
        if not isinstance(turn, dict):
            raise RowError(f"{key}[{i}]", f"is a {type(turn).__name__}, expected an object with {role_key} and {text_key}")
        role = turn.get(role_key) if role_key in turn else None
        if role is None:
            raise RowError(f"{key}[{i}].{role_key}", "is missing")
        if role not in roles:
            raise RowError(f"{key}[{i}].{role_key}", f"is an unknown role {role!r}; use one of {', '.join(sorted(roles))}")
        content = turn[text_key] if text_key in turn else None
        if content is None:
            raise RowError(f"{key}[{i}].{text_key}", "is missing")
        if isinstance(content, list):  # OpenAI content parts: [{"type": "text", "text": ...}]
            content = _parts(content, key=f"{key}[{i}].{text_key}", role=roles[role], images=images,
                             image_dir=image_dir)
        if not isinstance(content, (str, list)):
            raise RowError(f"{key}[{i}].{text_key}", f"is a {type(content).__name__}, expected a string")
        out.append({"role": roles[role], "content": content})
    return out


def _parts(content: list, *, key: str, role: str, images: bool, image_dir: Path | None) -> str | list[dict]:
    """OpenAI content parts: the text joined, or with `images` and an image among them, the parts
    (images.py: each image's ref resolved)."""
    from homelab_ft.data import images as image_refs

    out = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "text" and isinstance(part.get("text"), str):
            out.append({"type": "text", "text": part["text"]})
        elif kind in ("image", "image_url") and not images:
            raise RowError(f"{key}[{j}]", "is an image; train on images with data.images=true (an image-text model, "
                                          "objective sft), or leave the image out")
        elif kind in ("image", "image_url"):
            if role == "assistant":
                raise RowError(f"{key}[{j}]", "is an image in an assistant turn; images go in user or system turns")
            value = next((part[k] for k in ("path", "image", "image_url", "url") if k in part), None)
            try:
                out.append({"type": "image", "image": image_refs.resolve(value, base_dir=image_dir)})
            except image_refs.ImageError as err:  # a path is relative to the data file's folder
                raise RowError(f"{key}[{j}]", f"{err}; fix the path or the part" if "does not exist" in str(err)
                               else str(err)) from None
        else:
            raise RowError(f"{key}[{j}]", 'is not a content part; use {"type": "text", "text": ...} or '
                                          '{"type": "image", "path": ...}')
    if any(p["type"] == "image" for p in out):
        return out
    return "".join(p["text"] for p in out)
