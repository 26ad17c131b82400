"""data/prompts.py: GRPO's prompt rows, read as TRL reads them, with the same bad-row and length rules as SFT."""

from __future__ import annotations

import json

import pytest
from tiny import make_tokenizer

from homelab_ft.data.prompts import decoded, prepare_prompts
from homelab_ft.errors import UserError
from homelab_ft.recipe.config import DataConfig


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return make_tokenizer(tmp_path_factory.mktemp("tok"))


def _data(tmp_path, rows, **cfg) -> DataConfig:
    path = tmp_path / "p.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return DataConfig(sources=[{"path": str(path), **cfg.pop("source", {})}], **cfg)


def test_text_prompts_are_used_as_written_and_chat_prompts_rendered_with_the_template(tmp_path, tokenizer):
    rows = [{"prompt": "2+2=", "answer": "4"},
            {"prompt": [{"role": "user", "content": "3+3?"}], "answer": "6", "level": 1}]
    data = prepare_prompts(_data(tmp_path, rows, shuffle=False), tokenizer, seed=0)
    first, second = data.train[0], data.train[1]
    assert first["prompt_ids"] == tokenizer("2+2=")["input_ids"]
    rendered = tokenizer.apply_chat_template(rows[1]["prompt"], tokenize=False, add_generation_prompt=True)
    assert second["prompt_ids"] == tokenizer(rendered, add_special_tokens=False)["input_ids"]
    assert tokenizer.decode(second["prompt_ids"]).endswith("<|im_start|>assistant\n")
    # the prompt as the data set had it and every other column, for the reward functions
    assert decoded(first) == ("2+2=", {"answer": "4"})
    assert decoded(second) == (rows[1]["prompt"], {"answer": "6", "level": 1})
    assert data.report.prompts and "2 training prompts" in data.report.summary()


def test_a_chat_row_prompts_with_the_turns_before_its_last_answer(tmp_path, tokenizer):
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"},
                {"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"}]
    data = prepare_prompts(_data(tmp_path, [{"messages": messages}]), tokenizer, seed=0)
    prompt, columns = decoded(data.train[0])
    assert prompt == messages[:3] and columns == {}


def test_fields_map_the_prompt_column_and_system_prompt_applies(tmp_path, tokenizer):
    rows = [{"question": [{"role": "user", "content": "why?"}], "solution": "because"}]
    data = prepare_prompts(_data(tmp_path, rows, source={"fields": {"prompt": "question"}}, system_prompt="Be brief."),
                           tokenizer, seed=0)
    prompt, columns = decoded(data.train[0])
    assert prompt[0] == {"role": "system", "content": "Be brief."} and columns == {"solution": "because"}


@pytest.mark.parametrize(("row", "message"), [
    ({"prompt": "  "}, "field 'prompt' is empty"),
    ({"prompt": 3}, "field 'prompt' is a int"),
    ({"prompt": [{"role": "user"}]}, "field 'prompt' [0] is not a {role"),
    ({"prompt": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]},
     "field 'prompt' ends with an assistant turn"),
    ({"prompt": [{"role": "system", "content": "s"}]}, "field 'prompt' has no user turn"),
])
def test_a_bad_prompt_names_file_row_and_field_or_is_skipped(tmp_path, tokenizer, row, message):
    rows = [{"prompt": "fine"}, row]
    with pytest.raises(UserError, match="p.jsonl: row 2: " + message.replace("[", r"\[").replace("{", r"\{")):
        prepare_prompts(_data(tmp_path, rows), tokenizer, seed=0)
    data = prepare_prompts(_data(tmp_path, rows, bad_rows="skip"), tokenizer, seed=0)
    assert len(data.train) == 1 and data.report.sources[0].num_rows_skipped == 1


def test_no_prompt_column_is_refused_naming_the_columns_and_the_mapping(tmp_path, tokenizer):
    with pytest.raises(UserError, match=r"reads a `prompt` column.*\['question'\].*fields: \{prompt: your_column\}"):
        prepare_prompts(_data(tmp_path, [{"question": "q"}]), tokenizer, seed=0)
    with pytest.raises(UserError, match="format=preference: objective=grpo reads prompts"):
        prepare_prompts(_data(tmp_path, [{"prompt": "q"}], source={"format": "preference"}), tokenizer, seed=0)


def test_long_prompts_keep_their_last_tokens_or_are_dropped(tmp_path, tokenizer):
    long = "one two three four five six seven eight nine ten " * 4
    rows = [{"prompt": long}, {"prompt": "short"}]
    full = tokenizer(long)["input_ids"]
    data = prepare_prompts(_data(tmp_path, rows, max_length=8, shuffle=False), tokenizer, seed=0)
    assert data.train[0]["prompt_ids"] == full[-8:] and data.report.num_truncated == 1
    data = prepare_prompts(_data(tmp_path, rows, max_length=8, overlong="drop"), tokenizer, seed=0)
    assert len(data.train) == 1 and data.report.num_dropped_overlong == 1
    with pytest.raises(UserError, match="no training prompts are left"):
        prepare_prompts(_data(tmp_path, rows[:1], max_length=8, overlong="drop"), tokenizer, seed=0)


def test_the_eval_fraction_is_held_out_before_weighting(tmp_path, tokenizer):
    rows = [{"prompt": f"q{i}", "answer": str(i)} for i in range(10)]
    data = prepare_prompts(_data(tmp_path, rows, eval_fraction=0.2, source={"weight": 2.0}), tokenizer, seed=3)
    held = {decoded(r)[0] for r in data.eval}
    trained = [decoded(r)[0] for r in data.train]
    assert len(held) == 2 and len(trained) == 16 and not held & set(trained)
