"""The reward functions GRPO recipes name without writing Python (rewards.py resolves them).

Each has TRL's signature (`f(prompts, completions, completion_ids, **columns)`, see rewards.py) and
reads a completion as text, whether it is a string or a conversation (TRL's conversational
completions are lists of messages; the last message's `content` is the reply):

    exact_answer      1.0 when the answer equals the `answer` (or `solution`) column, after normalising
    numeric_answer    1.0 when the answer is the same number (1/2 = 0.5 = \\frac{1}{2}; 1,000 = 1000)
    math_answer       1.0 when math-verify finds the answer symbolically equal to the `solution`
                      (or `answer`) column: \\sqrt{2}/2 = \\frac{1}{\\sqrt{2}}, x \\in [0, 1], matrices; TRL's accuracy_reward
    json_valid        1.0 when the completion is JSON
    think_format      TRL's think_format_reward: reasoning in one <think>...</think> before the answer

and, with parameters (`regex_match: {pattern: ...}` in the recipe; callable from a rewards file too):

    regex_match(pattern, full=False)              1.0 when the pattern is found (or matches the whole text)
    json_object(required_keys=())                 1.0 for a JSON object holding every required key
    overlong_penalty(max_completion_len, soft_punish_cache)   DAPO's soft overlong punishment (eq. 13)

The answer of a completion (`extract_answer`) is the last `\\boxed{...}`, else what follows the last
`####` (GSM8K's mark), else what follows the last `answer:` on its line, else the whole text. A row
whose reference answer is empty or not a number (for numeric_answer) gets None: no reward, as TRL's
accuracy_reward does for a solution it cannot parse. numeric_answer's exact rational equality covers
the integer, decimal and fraction answers of GSM8K-like tasks; math_answer is for answers that are
expressions (MATH, NuminaMath), where only a symbolic comparison can tell two spellings are equal.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from fractions import Fraction


def text_of(item) -> str:
    """A prompt or completion as text: a string, or the `content` of a conversation's last message."""
    if isinstance(item, str):
        return item
    if isinstance(item, dict):
        return str(item.get("content", ""))
    if isinstance(item, Sequence) and item:
        return text_of(item[-1])
    return ""


def extract_answer(text: str) -> str:
    """The answer a completion gives (module docstring: boxed, then ####, then `answer:`, then all)."""
    boxed = _last_boxed(text)
    if boxed is not None:
        return boxed.strip()
    if "####" in text:
        return text.rsplit("####", 1)[1].strip()
    marks = list(re.finditer(r"answer(?:\s*is\b\s*[:=]?|\s*[:=])", text, flags=re.IGNORECASE))
    if marks:
        return text[marks[-1].end():].split("\n", 1)[0].strip()
    return text.strip()


def _last_boxed(text: str) -> str | None:
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    depth, i = 1, start + len("\\boxed{")
    for j in range(i, len(text)):
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        if depth == 0:
            return text[i:j]
    return None


def _normalised(answer: str) -> str:
    answer = " ".join(answer.split()).casefold()
    return answer.strip("$ ").rstrip(".").strip()


def _references(columns: dict, *, name: str, keys: tuple[str, ...] = ("answer", "solution")) -> Sequence:
    """The reference column, the first of `keys` the data has."""
    for key in keys:
        if key in columns:
            return columns[key]
    raise ValueError(f"{name} reads the reference from an 'answer' (or 'solution') column; the data has "
                     f"{', '.join(sorted(columns)) or 'no other column'}")


def exact_answer(prompts, completions, completion_ids=None, **columns) -> list[float | None]:
    """1.0 when the completion's answer equals the reference, compared case- and space-insensitively."""
    refs = _references(columns, name="exact_answer")
    out = []
    for completion, ref in zip(completions, refs, strict=True):
        want = _normalised(extract_answer(str(ref))) if ref is not None else ""
        out.append(None if not want else float(_normalised(extract_answer(text_of(completion))) == want))
    return out


_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?(?:[eE][-+]?\d+)?|-?\.\d+")
_FRAC = re.compile(r"^(-?)\\d?frac\{([^{}]+)\}\{([^{}]+)\}$")


def parse_number(text: str) -> Fraction | None:
    """`text` as an exact number: an integer, a decimal (1,234.5; 1e3), a fraction (3/4, \\frac{3}{4}),
    with a leading `$` or a trailing `%` or unit word ignored; None if it is not one number."""
    text = text.strip().strip("$").strip()
    text = re.sub(r"\\(?:text|mathrm)\{[^{}]*\}", "", text).strip()
    frac = _FRAC.match(text)
    if frac:
        num, den = parse_number(frac.group(2)), parse_number(frac.group(3))
        if num is None or not den:
            return None
        return -num / den if frac.group(1) else num / den
    match = re.fullmatch(r"(-?[\d.,eE+-]+)\s*/\s*(-?\d+)", text)
    if match:
        num, den = _plain(match.group(1)), _plain(match.group(2))
        return num / den if num is not None and den else None
    match = re.fullmatch(r"(\S+?)\s*(?:%|[a-zA-Z]+\.?)?", text)
    return _plain(match.group(1)) if match else None


def _plain(token: str) -> Fraction | None:
    if not _NUMBER.fullmatch(token) or ("," in token and not re.fullmatch(r"-?\d{1,3}(?:,\d{3})+(?:\.\d+)?", token)):
        return None
    try:
        return Fraction(token.replace(",", ""))
    except (ValueError, ZeroDivisionError):
        return None


def _answer_number(text: str) -> Fraction | None:
    """The number a completion answers: its extracted answer, or else the last number in its text."""
    value = parse_number(extract_answer(text))
    if value is None:
        found = _NUMBER.findall(text)
        value = _plain(found[-1].rstrip(",")) if found else None
    return value


def numeric_answer(prompts, completions, completion_ids=None, **columns) -> list[float | None]:
    """1.0 when the completion's answer is the reference's number (exact rational equality)."""
    refs = _references(columns, name="numeric_answer")
    out = []
    for completion, ref in zip(completions, refs, strict=True):
        want = parse_number(extract_answer(str(ref))) if ref is not None else None
        out.append(None if want is None else float(_answer_number(text_of(completion)) == want))
    return out


def _json(text: str):
    text = text.strip()
    fenced = re.fullmatch(r"```(?:json)?\s*\n?(.*?)\n?```", text, flags=re.DOTALL)
    try:
        return json.loads(fenced.group(1) if fenced else text), True
    except ValueError:
        return None, False


def json_valid(prompts, completions, completion_ids=None, **columns) -> list[float]:
    """1.0 when the completion (or the one ```json fenced block it is) parses as JSON."""
    return [float(_json(text_of(c))[1]) for c in completions]


class json_object:  # lower case: named as the recipe spells the built-in
    """json_object(required_keys=()): 1.0 for a JSON object that holds every key of `required_keys`."""

    __name__ = "json_object"

    def __init__(self, required_keys: Sequence[str] = ()):
        if isinstance(required_keys, str) or not all(isinstance(k, str) for k in required_keys):
            raise ValueError(f"json_object: required_keys is a list of key names, not {required_keys!r}")
        self.required_keys = tuple(required_keys)

    def __call__(self, prompts, completions, completion_ids=None, **columns) -> list[float]:
        out = []
        for c in completions:
            value, ok = _json(text_of(c))
            out.append(float(ok and isinstance(value, dict) and all(k in value for k in self.required_keys)))
        return out


class regex_match:
    """regex_match(pattern, full=False): 1.0 when `pattern` is found in the completion (matches all of it when full)."""

    __name__ = "regex_match"

    def __init__(self, pattern: str, full: bool = False):
        try:
            self.regex = re.compile(pattern)
        except (re.error, TypeError) as e:
            raise ValueError(f"regex_match: pattern {pattern!r} is not a regular expression ({e})") from None
        self.full = bool(full)

    def __call__(self, prompts, completions, completion_ids=None, **columns) -> list[float]:
        find = self.regex.fullmatch if self.full else self.regex.search
        return [float(find(text_of(c)) is not None) for c in completions]


THINK_PATTERN = r"^<think>(?!.*<think>)(.*?)</think>.*$"
"""TRL 1.16's think_format_reward pattern (re.DOTALL | re.MULTILINE, matched from the start)."""


def think_format(prompts, completions, completion_ids=None, **columns) -> list[float]:
    """1.0 when the completion opens with one <think>...</think> block (TRL's think_format_reward)."""
    return [float(re.match(THINK_PATTERN, text_of(c), re.DOTALL | re.MULTILINE) is not None) for c in completions]


class overlong_penalty:
    """overlong_penalty(max_completion_len, soft_punish_cache): 0 up to max - cache tokens, then down to -1 at max."""

    __name__ = "overlong_penalty"

    def __init__(self, max_completion_len: int, soft_punish_cache: int):
        if not 0 < soft_punish_cache <= max_completion_len:
            raise ValueError(f"overlong_penalty: soft_punish_cache ({soft_punish_cache}) must be in "
                             f"1..max_completion_len ({max_completion_len})")
        self.max_len, self.cache = int(max_completion_len), int(soft_punish_cache)

    def __call__(self, prompts, completions, completion_ids, **columns) -> list[float]:
        """DAPO (arXiv:2503.14476) eq. 13, as TRL's get_soft_overlong_punishment."""
        out = []
        for ids in completion_ids:
            n, free = len(ids), self.max_len - self.cache
            out.append(0.0 if n <= free else (free - n) / self.cache if n <= self.max_len else -1.0)
        return out


def math_answer(prompts, completions, completion_ids=None, **columns) -> list[float | None]:
    """1.0 when math-verify finds the completion's answer equal to the reference (TRL's accuracy_reward)."""
    from latex2sympy2_extended import NormalizationConfig
    from math_verify import LatexExtractionConfig, parse, verify

    refs = _references(columns, name="math_answer", keys=("solution", "answer"))  # TRL's column first
    # TRL 1.16's accuracy_reward settings: the reference parsed as math-verify defaults, the completion
    # as well-formed LaTeX only (no repair of malformed operators), its \boxed{} tried first and an
    # answer without an anchor (\boxed, "final answer") not guessed at.
    answer_config = [LatexExtractionConfig(
        normalization_config=NormalizationConfig(nits=False, malformed_operators=False, basic_latex=True,
                                                 boxed="all", units=True),
        boxed_match_priority=0, try_extract_without_anchor=False)]
    out = []
    for completion, ref in zip(completions, refs, strict=True):
        gold = parse(str(ref), extraction_mode="first_match") if ref is not None else []
        if not gold:
            out.append(None)  # a reference math-verify cannot read: no reward, as TRL does
            continue
        answer = parse(text_of(completion), extraction_config=answer_config, extraction_mode="first_match")
        try:
            out.append(float(verify(gold, answer)))
        except Exception:  # noqa: BLE001 - sympy can fail on any odd pair; TRL scores such a row None
            out.append(None)
    return out


BUILTINS = {f.__name__: f for f in (exact_answer, numeric_answer, math_answer, json_valid, think_format)}
NEEDS = {"math_answer": "math_verify"}
"""Built-ins that need a package beyond homelab-ft's own imports: resolved only when it imports."""
FACTORIES = {f.__name__: f for f in (regex_match, json_object, overlong_penalty)}
