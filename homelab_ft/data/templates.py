"""Chat templates and the loss mask: which characters of a rendered sample the model learns.

The rule (docs/data.md): loss falls on every assistant turn, from the first character after the
template's generation prompt (`<|im_start|>assistant\\n` in ChatML) through the turn's
end-of-turn marker (`<|im_end|>`, `<|eot_id|>`, `</s>`, `<end_of_turn>`), so the model learns to
stop. Whitespace the template writes after that marker (ChatML's `\\n`) is not trained: the model
never generates it, generation stops at the marker.

transformers can return an assistant mask only for templates with a `{% generation %}` block, and
most shipped templates (SmolLM2's ChatML, Llama-3, Mistral, Gemma) have none. So the boundaries
are derived from the template itself, by rendering prefixes of the conversation:

    before = render(messages[:i], add_generation_prompt=True)    # ... <|im_start|>assistant\\n
    through = render(messages[:i + 1])                           # ... answer<|im_end|>\\n

and the assistant turn i occupies characters [len(before), len(through.rstrip())) of the full
rendering. That needs the template to be prefix-stable (rendering more turns only appends text),
which is checked on every sample; a template that rewrites earlier turns is refused with a
message. Character spans become token labels through the fast tokenizer's offset mapping: a
token is trained when it overlaps a span.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from homelab_ft import fsio
from homelab_ft.errors import UserError
from homelab_ft.labels import IGNORE_INDEX

# A plain ChatML template, for base models whose tokenizer ships no template (`chat_template: chatml`).
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
NAMED_TEMPLATES = {"chatml": CHATML_TEMPLATE}


class SpanError(ValueError):
    """A row the template cannot render into exact assistant spans (the caller adds file and row)."""


def resolve_template(tokenizer, chat_template: str | None, *, base_dir: Path | None = None) -> str | None:
    """The Jinja source to render chats with: the recipe's (a name, a file or inline) or the tokenizer's.

    Returns None when neither exists; chat-style rows then raise at first use, text rows do not care.
    """
    if chat_template is None:
        own = tokenizer.chat_template
        if isinstance(own, dict):  # tokenizers that ship several named templates
            own = own.get("default")
        return own
    if chat_template in NAMED_TEMPLATES:
        return NAMED_TEMPLATES[chat_template]
    if "{%" in chat_template or "{{" in chat_template:
        return chat_template
    for root in [base_dir, Path.cwd()]:
        candidate = Path(chat_template) if root is None else root / chat_template
        if candidate.is_file():
            return fsio.read_text(candidate, what="data.chat_template file")
    raise UserError(
        f"data.chat_template = {chat_template!r} is neither a template name ({', '.join(NAMED_TEMPLATES)}), "
        "an existing file, nor inline Jinja; fix the path or paste the template"
    )


def render(tokenizer, template: str, messages: list[dict], *, add_generation_prompt: bool) -> str:
    try:
        return tokenizer.apply_chat_template(
            messages, chat_template=template, tokenize=False, add_generation_prompt=add_generation_prompt
        )
    except Exception as err:  # jinja raise_exception(), e.g. Gemma refusing a system turn
        raise SpanError(f"the chat template refused this conversation: {err}") from None


def chat_spans(tokenizer, template: str, messages: list[dict], *, train_on_inputs: bool) -> tuple[str, list]:
    """Render a conversation; return the text and the character spans that carry loss."""
    text = render(tokenizer, template, messages, add_generation_prompt=False)
    if train_on_inputs:
        return text, [(0, len(text))]
    spans = []
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        before = render(tokenizer, template, messages[:i], add_generation_prompt=True)
        # The last turn's rendering is the full text: saves one of the three renders of a single-turn chat.
        last = i + 1 == len(messages)
        through = text if last else render(tokenizer, template, messages[: i + 1], add_generation_prompt=False)
        if not (through.startswith(before) and text.startswith(through)):
            raise SpanError(
                f"the chat template is not prefix-stable at turn {i} (rendering more turns changes earlier "
                "text), so assistant spans cannot be derived; use a template without that behaviour "
                "(data.chat_template) or data.train_on_inputs=true"
            )
        end = len(through.rstrip())
        if end > len(before):
            spans.append((len(before), end))
    return text, spans


def text_spans(prompt: str, completion: str, *, eos_token: str | None, train_on_inputs: bool):
    """Plain text (no template): the completion and an end-of-sequence marker carry loss."""
    text = prompt + completion + (eos_token or "")
    return text, [(0 if train_on_inputs else len(prompt), len(text))]


def labels_from_spans(input_ids: list[int], offsets: list[tuple[int, int]], spans) -> list[int]:
    """Token labels: the token id where the token overlaps a trained span, IGNORE_INDEX elsewhere.

    The first label is always IGNORE_INDEX: nothing predicts the first token (causal LM losses
    shift labels left), and in a packed row it would otherwise be predicted from the previous
    sample's last token.
    """
    ids = np.asarray(input_ids, dtype=np.int64)
    if len(ids) == 0:
        return []
    bounds = np.asarray(offsets, dtype=np.int64).reshape(-1, 2)
    trained = np.zeros(len(ids), dtype=bool)
    for start, end in spans:
        trained |= (bounds[:, 1] > start) & (bounds[:, 0] < end)
    labels = np.where(trained, ids, IGNORE_INDEX)
    labels[0] = IGNORE_INDEX
    return labels.tolist()
