"""What a quantized GGUF costs, measured on the run's own eval rows.

A logit bound cannot judge 4-bit weights (SmolLM2's logits move by up to 0.6 per unit, see
gguf_check.GGUF_BOUNDS), and "max |logit difference|" does not tell a user what they lose. So after
a quantized GGUF is written, the GGUF (loaded as gguf_check.verify_gguf loads it: its tensors, read
by transformers' GGUF loader where it reads the architecture, else by gguf-py, in the merged model's
own config) and the merged safetensors model it came from are run on the same rows: how often
their greedy next tokens agree on the trained tokens, and the eval loss of each. Issue 26 measured
what this predicts: the demo's q4_0 answers 32/48 where the merged model answers 41/48, in
llama.cpp and in transformers alike.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

from homelab_ft.export.gguf.check import load_gguf_model
from homelab_ft.labels import IGNORE_INDEX

log = logging.getLogger(__name__)

MEASURED_TYPES = ("q8_0", "q5_1", "q4_0", "mxfp4_moe")
"""The quantized types: the float types (f32, f16, bf16) keep every logit within a bound that
gguf_check enforces, so there is nothing more to report for them."""

BY_FIDELITY = ("q4_0", "q5_1", "q8_0", "bf16", "f16", "f32")
"""GGUF types homelab-ft writes, from the most lossy (4 bits + one fp16 scale per 32 weights) to
exact; the warning names the next two after the type written. mxfp4_moe (4.25 bits in the experts,
q8_0 elsewhere) ranks as q4_0 here and is never suggested: it is for MoE models only."""

AGREEMENT_WARN = 0.995
"""Greedy next-token agreement below which the export warns. Scored teacher-forced, each
disagreement is a point where greedy decoding takes another token and the reply leaves the merged
model's from there on: at the demo's ~25 trained tokens per reply, 99.5% leaves about one reply in
nine changed (1 - 0.995^25 = 0.12). The demo's q4_0 measured 98.8% (about one reply in four; issue
26 saw it answer 32/48 where the merged model answers 41/48), its q8_0 100.0%. The eval loss is
reported but not judged: a fine-tuned model is confident on its task (the demo's eval loss is
0.037), so flipping a greedy token barely moves its mean loss (q4_0: +0.019 nats)."""

MAX_ROWS = 64
"""Eval rows measured at most (the first ones): two forward passes per row, of the merged model
and of the GGUF, on CPU; the demo's 48 rows take seconds for SmolLM2-135M."""

MASKED = IGNORE_INDEX
"""The label of an untrained token (labels.IGNORE_INDEX, the one definition)."""

HELD_OUT_CHATS = (
    ("What is the capital of France?", "The capital of France is Paris."),
    ("Name three primary colours.", "Red, yellow and blue."),
    ("How many days are in a leap year?", "A leap year has 366 days."),
    ("Translate 'good morning' into Spanish.", "Buenos días."),
    ("What is 12 times 12?", "12 times 12 is 144."),
    ("Give a synonym for 'happy'.", "Joyful."),
    ("Which planet is known as the red planet?", "Mars is known as the red planet."),
    ("Write the word 'cat' backwards.", "tac"),
)
"""Used when the run has no eval rows (or they cannot be read here): the loss is taken on the
assistant replies, the chat rendered with the model's own template."""


@dataclass(frozen=True)
class GgufQuality:
    gguf_type: str
    num_rows: int
    num_tokens: int
    """Trained tokens scored (the positions whose label is not masked)."""
    agreement: float
    """Fraction of those tokens where the GGUF's and the merged model's argmax agree."""
    loss_gguf: float
    loss_merged: float
    rows_from: str
    """"eval rows" (the run's own) or "held-out prompts" (HELD_OUT_CHATS)."""

    @property
    def loss_delta(self) -> float:
        return self.loss_gguf - self.loss_merged

    @property
    def warns(self) -> bool:
        return self.agreement < AGREEMENT_WARN

    def line(self) -> str:
        text = (f"gguf {self.gguf_type} vs merged: greedy next-token agreement {self.agreement:.1%} on {self.num_rows} "
                f"{self.rows_from} ({self.num_tokens:,} tokens), eval loss {self.loss_gguf:.3f} vs {self.loss_merged:.3f} "
                f"({self.loss_delta:+.3f})")
        if self.warns:
            text += (f"; warning: below the {AGREEMENT_WARN:.1%} agreement threshold, "
                     f"{' or '.join(less_lossy(self.gguf_type))} keeps more")
        return text

    def as_dict(self) -> dict:
        return asdict(self) | {"loss_delta": self.loss_delta, "agreement_threshold": AGREEMENT_WARN, "line": self.line()}


def less_lossy(gguf_type: str) -> tuple[str, ...]:
    """The next two types that keep more of the model than `gguf_type`."""
    at = BY_FIDELITY.index("q4_0" if gguf_type == "mxfp4_moe" else gguf_type)
    return BY_FIDELITY[at + 1 : at + 3]


def measure(gguf_path: Path, reference_dir: Path, *, gguf_type: str,
            rows: Callable[[], list[dict] | None] | None = None) -> GgufQuality | None:
    """The quality report for a quantized GGUF (None for the float types), on the first MAX_ROWS
    of what `rows` returns ({"input_ids", "labels"} as the trainer sees them, packed or not) or,
    without usable rows, on HELD_OUT_CHATS. The warning below AGREEMENT_WARN is also logged."""
    import gc

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if gguf_type not in MEASURED_TYPES:
        return None
    sequences = scored_sequences((rows() if rows else None) or [])[:MAX_ROWS]
    rows_from = "eval rows"
    if not sequences:
        sequences, rows_from = held_out_sequences(AutoTokenizer.from_pretrained(reference_dir)), "held-out prompts"
    merged = AutoModelForCausalLM.from_pretrained(reference_dir, dtype=torch.float32)
    want = [next_tokens(merged, ids, labels) for ids, labels in sequences]
    del merged
    gc.collect()
    gguf_model = load_gguf_model(gguf_path, reference_dir, gguf_type=gguf_type)
    got = [next_tokens(gguf_model, ids, labels) for ids, labels in sequences]
    del gguf_model
    quality = compare(want, got, gguf_type=gguf_type, rows_from=rows_from)
    if quality.warns:
        log.warning("the %s GGUF picks another greedy token than the merged model on %.1f%% of trained tokens "
                    "(threshold %.1f%%); %s keeps more", gguf_type, 100 * (1 - quality.agreement),
                    100 * (1 - AGREEMENT_WARN), " or ".join(less_lossy(gguf_type)))
    return quality


def scored_sequences(rows: list[dict]) -> list[tuple[list[int], list[int]]]:
    """(input_ids, labels) per sample; a packed row (it carries position_ids, each sample's
    starting at 0) is cut back into its samples. Rows without labels (preference pairs) give none."""
    out = []
    for row in rows:
        if "labels" not in row or "input_ids" not in row:
            continue
        ids, labels = list(row["input_ids"]), list(row["labels"])
        positions = list(row.get("position_ids") or range(len(ids)))
        starts = [i for i, p in enumerate(positions) if p == 0] + [len(ids)]
        out += [(ids[a:b], labels[a:b]) for a, b in zip(starts, starts[1:], strict=False) if b - a > 1]
    return [(ids, labels) for ids, labels in out if any(x != MASKED for x in labels[1:])]


def held_out_sequences(tokenizer) -> list[tuple[list[int], list[int]]]:
    """HELD_OUT_CHATS rendered with the chat template; labels on the reply tokens only."""
    out = []
    for question, reply in HELD_OUT_CHATS:
        prompt = tokenizer.apply_chat_template([{"role": "user", "content": question}], tokenize=False,
                                               add_generation_prompt=True)
        full = tokenizer.apply_chat_template([{"role": "user", "content": question}, {"role": "assistant", "content": reply}],
                                             tokenize=False)
        ids = tokenizer(full, add_special_tokens=False)["input_ids"]
        num_prompt = len(tokenizer(prompt, add_special_tokens=False)["input_ids"])
        out.append((ids, [MASKED] * num_prompt + ids[num_prompt:]))
    return out


def next_tokens(model, ids: list[int], labels: list[int]):
    """(argmax token, negative log-likelihood of the label) at every position that predicts a
    trained token: logits at t predict the label at t + 1."""
    import torch

    model.eval()
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([ids])).logits[0, :-1].float()
    target = torch.tensor(labels[1:])
    keep = target != MASKED
    logprobs = torch.log_softmax(logits[keep], dim=-1)
    return logits[keep].argmax(-1), -logprobs.gather(1, target[keep][:, None])[:, 0]


def compare(want: list, got: list, *, gguf_type: str, rows_from: str) -> GgufQuality:
    """The report from next_tokens of the merged model (`want`) and of the GGUF (`got`), row by
    row; agreement and losses are means over all scored tokens (the trainer's normalisation)."""
    import torch

    want_tokens, want_nll = (torch.cat(parts) for parts in zip(*want, strict=True))
    got_tokens, got_nll = (torch.cat(parts) for parts in zip(*got, strict=True))
    return GgufQuality(gguf_type=gguf_type, num_rows=len(want), num_tokens=int(want_tokens.numel()),
                       agreement=float((want_tokens == got_tokens).float().mean()), loss_gguf=float(got_nll.mean()),
                       loss_merged=float(want_nll.mean()), rows_from=rows_from)
