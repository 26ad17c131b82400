"""The demo's shipped dataset, its grader and its batched greedy generation (tiny model, no SmolLM2)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from homelab_ft.data import IGNORE_INDEX, prepare_data
from homelab_ft.demo import run, sft
from homelab_ft.recipe.config import load_recipe

GOOD = '{"name": "Ana Silva", "age": 34, "city": "Porto"}'


# ---------------------------------------------------------------------------------------- dataset


@pytest.mark.parametrize("split", sft.SPLITS)
def test_shipped_files_are_what_the_generator_writes(split):
    shipped = sft.dataset_path(split).read_bytes()
    assert shipped == sft.dataset_text(split).encode("utf-8")


def test_write_dataset_reproduces_the_shipped_files_byte_for_byte(tmp_path):
    for path in sft.write_dataset(tmp_path):
        assert path.read_bytes() == sft.dataset_path(path.stem).read_bytes()


def test_generation_is_seeded():
    assert sft.make_rows("train", num_rows=20) == sft.make_rows("train", num_rows=20)
    assert sft.make_rows("train", num_rows=20) != sft.make_rows("train", num_rows=20, seed=sft.SEED + 1)


@pytest.mark.parametrize("split", sft.SPLITS)
def test_rows_are_chat_rows_whose_answer_is_in_the_sentence(split):
    rows = sft.read_rows(split)
    assert len(rows) == (sft.NUM_EVAL_ROWS if split == "eval" else sft.NUM_TRAIN_ROWS)
    for row in rows:
        user, assistant = row["messages"]
        assert (user["role"], assistant["role"]) == ("user", "assistant")
        record = json.loads(assistant["content"])
        assert list(record) == list(sft.KEYS)
        assert isinstance(record["age"], int)
        for value in record.values():
            assert str(value) in user["content"]


def test_held_out_people_and_cities_never_occur_in_training_rows():
    train = [json.loads(r["messages"][1]["content"]) for r in sft.read_rows("train")]
    held_out = [json.loads(r["messages"][1]["content"]) for r in sft.read_rows("eval")]
    train_words = {w for r in train for w in r["name"].split()} | {r["city"] for r in train}
    for record in held_out:
        assert not set(record["name"].split()) & train_words
        assert record["city"] not in train_words
    train_text = "\n".join(r["messages"][0]["content"] for r in sft.read_rows("train"))
    for record in held_out:
        assert record["city"] not in train_text


def test_demo_recipe_trains_only_on_the_assistant_reply(tiny_model_dir):
    """With a ChatML tokenizer, the loss of each demo row covers its JSON reply and end-of-turn."""
    from transformers import AutoTokenizer

    # the tiny tokenizer's 320-token vocabulary spells the rows out nearly byte by byte
    recipe = load_recipe(run.DEMO_RECIPE, ["data.max_length=1024"])
    assert recipe.data.sources[0].path == "demo:train" and recipe.data.eval_sources[0].path == "demo:eval"
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    data = prepare_data(recipe.data, tokenizer, seed=0)
    replies = {r["messages"][1]["content"] for r in sft.read_rows("train")}
    assert len(data.train) == sft.NUM_TRAIN_ROWS and len(data.eval) == sft.NUM_EVAL_ROWS
    for row in data.train.select(range(10)):
        trained = [t for t, label in zip(row["input_ids"], row["labels"], strict=True) if label != IGNORE_INDEX]
        text = tokenizer.decode(trained)
        assert text.endswith("<|im_end|>")
        assert text.removesuffix("<|im_end|>").strip() in replies


# ---------------------------------------------------------------------------------------- grading


@pytest.mark.parametrize(
    "reply, correct, well_formed",
    [
        (GOOD, True, True),
        ('  {"city":"Porto","age":34,"name":"Ana Silva"}\n', True, True),  # spacing and key order are free
        ('{"name": "Ana Silva", "age": 35, "city": "Porto"}', False, True),
        ('{"name": "Ana Silva", "age": "34", "city": "Porto"}', False, True),  # age must be a number
        ('{"name": "Ana Silva", "age": 34.0, "city": "Porto"}', False, True),
        ('{"name": "Ana", "age": 34, "city": "Porto"}', False, True),
        ('{"name": "Ana Silva", "age": 34, "country": "Porto"}', False, False),
        ('{"name": "Ana Silva", "age": 34, "city": "Porto", "job": "nurse"}', False, False),
        ('```json\n{"name": "Ana Silva", "age": 34, "city": "Porto"}\n```', False, False),
        ('Here it is: {"name": "Ana Silva", "age": 34, "city": "Porto"}', False, False),
        ('{"name": "Ana Silva", "age": 34, "city": "Porto"} Hope this helps!', False, False),
        ('{\n  "type": "json",\n  "data": {\n    "name": "Ana Silva",\n    "age": 34', False, False),
        ('[{"name": "Ana Silva", "age": 34, "city": "Porto"}]', False, False),
        ("", False, False),
    ],
)
def test_grade(reply, correct, well_formed):
    assert sft.grade(reply, GOOD) == (correct, well_formed)


class _Oracle(torch.nn.Module):
    """Stands in for a model: `generate` appends a scripted reply to each (left-padded) prompt."""

    def __init__(self, tokenizer, replies: dict[str, str]):
        super().__init__()
        self.tokenizer, self.replies = tokenizer, replies
        self.anchor = torch.nn.Parameter(torch.zeros(1))  # gives the module a device

    @property
    def device(self):
        return self.anchor.device

    def generate(self, input_ids, attention_mask, max_new_tokens, do_sample, pad_token_id):
        assert attention_mask[:, -1].all(), "prompts must be left-padded"
        outs = []
        for ids in input_ids:
            prompt = self.tokenizer.decode(ids, skip_special_tokens=True)
            reply = next(r for user, r in self.replies.items() if user in prompt)
            outs.append(ids.tolist() + self.tokenizer(reply, add_special_tokens=False)["input_ids"] + [self.tokenizer.eos_token_id])
        width = max(map(len, outs))
        return torch.tensor([o + [pad_token_id] * (width - len(o)) for o in outs])


def test_score_counts_exact_records_and_shapes(tiny_model_dir):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    rows = sft.read_rows("eval")[:5]
    users = [r["messages"][0]["content"] for r in rows]
    answers = [r["messages"][1]["content"] for r in rows]
    wrong_age = json.dumps({**json.loads(answers[1]), "age": 200})
    replies = {users[0]: answers[0], users[1]: wrong_age, users[2]: "Sure! " + answers[2], users[3]: answers[3], users[4]: "no"}
    result = sft.score(_Oracle(tokenizer, replies), tokenizer, rows, max_new_tokens=40, batch_size=2)
    assert (result.num_rows, result.num_correct, result.num_well_formed) == (5, 2, 3)
    assert [ex.correct for ex in result.examples] == [True, False, False, True, False]
    assert [ex.got for ex in result.examples] == [replies[u] for u in users]
    assert result.accuracy == pytest.approx(0.4)
    assert tokenizer.padding_side == "right"  # restored after generation


def test_batched_left_padded_generation_matches_one_at_a_time(tiny_model_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    # prompts of different lengths, so the batch really is padded
    conversations = [r["messages"][:1] for r in sft.read_rows("eval")[:6]]
    assert len({len(c[0]["content"]) for c in conversations}) > 1
    batched = sft.generate(model, tokenizer, conversations, max_new_tokens=8, batch_size=6)
    single = sft.generate(model, tokenizer, conversations, max_new_tokens=8, batch_size=1)
    assert batched == single
    assert any(batched)


def _scored(num_correct: int, replies: list[str]) -> sft.DemoScore:
    examples = tuple(sft.Example(prompt=f"user {i}", expected=GOOD, got=r, correct=i < num_correct)
                     for i, r in enumerate(replies))
    return sft.DemoScore(num_rows=len(replies), num_correct=num_correct, num_well_formed=num_correct + 1,
                         examples=examples)


def test_the_before_after_table_shows_scores_spread_examples_and_time():
    before = _scored(0, ["prose " * 40] * 6)
    after = _scored(4, [GOOD] * 6)
    assert after.summary() == "4/6 correct (67%), 5/6 with the right shape"
    text = run.summary(before, after, export_dir=Path("runs/demo-export"), seconds={"train": 90.0, "export": 30.0},
                       num_examples=2, gguf=after, gguf_name="model-q8_0.gguf")
    assert "  base SmolLM2-135M-Instruct   0/6 correct (0%), 1/6 with the right shape" in text
    assert "  the same, as model-q8_0.gguf 4/6 correct (67%)" in text
    # two examples, spread over the split (rows 0 and 3), a long reply cut to one line
    assert [line for line in text.splitlines() if line.startswith("  user:")] == ["  user:       user 0",
                                                                                  "  user:       user 3"]
    assert max(len(line) for line in text.splitlines() if line.startswith("  base:")) <= len("  base:       ") + 110
    assert text.endswith("time: train 90s, export 30s; total 2.0 min\nexported model: runs/demo-export")
