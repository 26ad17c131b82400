"""The loss mask on four template families, none with a {% generation %} block.

Each test states, as literal strings, exactly which text must carry loss; the labelled tokens
must be exactly the tokens of those strings, in order, and nothing else.
"""

from __future__ import annotations

import json

import pytest
from tiny import CHATML_TEMPLATE, CORPUS

from homelab_ft.data import IGNORE_INDEX, prepare_data
from homelab_ft.data.templates import chat_spans, labels_from_spans
from homelab_ft.errors import UserError
from homelab_ft.recipe.config import DataConfig, SourceConfig

LLAMA3_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n' + message['content'] | trim + '<|eot_id|>' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
)
MISTRAL_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{% if message['role'] == 'user' %}{{ '[INST] ' + message['content'] + ' [/INST]' }}"
    "{% elif message['role'] == 'assistant' %}{{ ' ' + message['content'] + eos_token }}"
    "{% else %}{{ raise_exception('Only user and assistant roles are supported!') }}{% endif %}"
    "{% endfor %}"
)
GEMMA_TEMPLATE = (
    "{{ bos_token }}{% if messages[0]['role'] == 'system' %}{{ raise_exception('System role not supported') }}{% endif %}"
    "{% for message in messages %}"
    "{% if message['role'] == 'assistant' %}{% set role = 'model' %}{% else %}{% set role = message['role'] %}{% endif %}"
    "{{ '<start_of_turn>' + role + '\n' + message['content'] | trim + '<end_of_turn>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<start_of_turn>model\n' }}{% endif %}"
)
SPECIALS = {
    "chatml": dict(bos="<|im_start|>", eos="<|im_end|>"),
    "llama3": dict(bos="<|begin_of_text|>", eos="<|eot_id|>"),
    "mistral": dict(bos="<s>", eos="</s>"),
    "gemma": dict(bos="<bos>", eos="<end_of_turn>"),
}
TEMPLATES = {"chatml": CHATML_TEMPLATE, "llama3": LLAMA3_TEMPLATE, "mistral": MISTRAL_TEMPLATE, "gemma": GEMMA_TEMPLATE}
CONVERSATION = [
    {"role": "user", "content": "what is two plus two"},
    {"role": "assistant", "content": "four"},
    {"role": "user", "content": "and ten plus ten"},
    {"role": "assistant", "content": "twenty"},
]
# What each family must train on: every assistant turn through its end-of-turn marker, nothing else.
EXPECTED = {
    "chatml": ["four<|im_end|>", "twenty<|im_end|>"],
    "llama3": ["four<|eot_id|>", "twenty<|eot_id|>"],
    "mistral": [" four</s>", " twenty</s>"],
    "gemma": ["four<end_of_turn>", "twenty<end_of_turn>"],
}


def make_family_tokenizer(family: str):
    """A byte-level BPE tokenizer carrying every family's special tokens, with `family`'s template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|begin_of_text|>", "<|start_header_id|>",
                "<|end_header_id|>", "<|eot_id|>", "<s>", "</s>", "<bos>", "<start_of_turn>", "<end_of_turn>"]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=360, special_tokens=specials,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(CORPUS * 4, trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=SPECIALS[family]["bos"],
                                   eos_token=SPECIALS[family]["eos"], pad_token="<|endoftext|>")
    fast.chat_template = TEMPLATES[family]
    return fast


def labelled_runs(input_ids: list[int], labels: list[int]) -> list[list[int]]:
    runs, current = [], []
    for tok, lab in zip(input_ids, labels, strict=True):
        if lab != IGNORE_INDEX:
            assert lab == tok
            current.append(tok)
        elif current:
            runs.append(current)
            current = []
    return runs + ([current] if current else [])


def encode(tokenizer, messages, *, train_on_inputs=False):
    text, spans = chat_spans(tokenizer, tokenizer.chat_template, messages, train_on_inputs=train_on_inputs)
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    return text, enc["input_ids"], labels_from_spans(enc["input_ids"], enc["offset_mapping"], spans)


@pytest.mark.parametrize("family", sorted(TEMPLATES))
def test_mask_trains_exactly_the_assistant_turns(family):
    tokenizer = make_family_tokenizer(family)
    assert "{% generation %}" not in tokenizer.chat_template
    text, ids, labels = encode(tokenizer, CONVERSATION)
    assert ids == tokenizer(text, add_special_tokens=False)["input_ids"]
    expected = [tokenizer(s, add_special_tokens=False)["input_ids"] for s in EXPECTED[family]]
    assert labelled_runs(ids, labels) == expected
    # The end-of-turn token carries loss once per assistant turn (the model learns to stop) ...
    eos_id = tokenizer.convert_tokens_to_ids(SPECIALS[family]["eos"])
    assert sum(1 for lab in labels if lab == eos_id) == 2


def test_chatml_header_and_trailing_newline_are_not_trained():
    tokenizer = make_family_tokenizer("chatml")
    text, ids, labels = encode(tokenizer, CONVERSATION)
    im_start = tokenizer.convert_tokens_to_ids("<|im_start|>")
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    newline = tokenizer("\n", add_special_tokens=False)["input_ids"]
    assert len(newline) == 1
    for i, tok in enumerate(ids):
        if tok == im_start:
            assert labels[i] == IGNORE_INDEX and labels[i + 1] == IGNORE_INDEX  # `<|im_start|>assistant`
        if tok == newline[0] and i > 0 and ids[i - 1] == im_end:
            assert labels[i] == IGNORE_INDEX
    # The user turns' <|im_end|> are not trained: 2 assistant + 1 default system + 2 user end markers.
    assert ids.count(im_end) == 5 and labels.count(im_end) == 2


def test_train_on_inputs_trains_everything_but_the_first_token():
    tokenizer = make_family_tokenizer("llama3")
    _, ids, labels = encode(tokenizer, CONVERSATION, train_on_inputs=True)
    assert labels[0] == IGNORE_INDEX and labels[1:] == ids[1:]


def test_template_that_rewrites_history_is_refused(tmp_path):
    # Like templates that strip earlier assistant "thinking": the last turn renders differently.
    rewriting = (
        "{% for message in messages %}{% if loop.last %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
        "{% else %}{{ message['content'][:2] + '\n' }}{% endif %}{% endfor %}"
        "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
    )
    tokenizer = make_family_tokenizer("chatml")
    (tmp_path / "d.jsonl").write_text(json.dumps({"messages": CONVERSATION}) + "\n")
    cfg = DataConfig(sources=[SourceConfig(path=str(tmp_path / "d.jsonl"))], chat_template=rewriting,
                     cache_dir=str(tmp_path / "cache"))
    with pytest.raises(UserError, match=r"d\.jsonl: row 1: .*not prefix-stable"):
        prepare_data(cfg, tokenizer, seed=0)


def test_template_exception_names_the_row_or_is_skipped(tmp_path):
    tokenizer = make_family_tokenizer("gemma")
    rows = [{"messages": CONVERSATION}, {"messages": [{"role": "system", "content": "be brief"}] + CONVERSATION}]
    (tmp_path / "d.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    cfg = DataConfig(sources=[SourceConfig(path=str(tmp_path / "d.jsonl"))], cache_dir=str(tmp_path / "cache"))
    with pytest.raises(UserError, match=r"d\.jsonl: row 2: .*System role not supported"):
        prepare_data(cfg, tokenizer, seed=0)
    skip = DataConfig(sources=cfg.sources, cache_dir=cfg.cache_dir, bad_rows="skip")
    report = prepare_data(skip, tokenizer, seed=0).report
    assert report.num_train_samples == 1 and report.num_bad_template == 1


def test_named_and_file_templates(tmp_path):
    tokenizer = make_family_tokenizer("llama3")
    (tmp_path / "d.jsonl").write_text(json.dumps({"messages": CONVERSATION}) + "\n")
    (tmp_path / "t.jinja").write_text(GEMMA_TEMPLATE)
    for template, marker in [("chatml", "<|im_end|>"), ("t.jinja", "<end_of_turn>")]:
        cfg = DataConfig(sources=[SourceConfig(path="d.jsonl")], chat_template=template, cache_dir=str(tmp_path / "c"))
        row = prepare_data(cfg, tokenizer, seed=0, base_dir=tmp_path).train[0]
        runs = labelled_runs(row["input_ids"], row["labels"])
        assert [tokenizer.decode(r) for r in runs] == [f"four{marker}", f"twenty{marker}"]
