"""train/rollout.py: the layout of sampled completions, seeded sampling, and log-probs that do not
depend on the rows a completion was batched with."""

from __future__ import annotations

import json

import pytest
import torch

from homelab_ft.recipe.objectives import GrpoConfig
from homelab_ft.train.loss import completion_logprobs
from homelab_ft.train.rollout import Colocated, end_token_ids, seed_for

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def model_and_tokenizer(tiny_model_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    return (AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32),
            AutoTokenizer.from_pretrained(tiny_model_dir))


def _engine(tokenizer, **settings) -> Colocated:
    cfg = GrpoConfig(**{"num_generations": 3, "max_completion_length": 6, "reward_funcs": ("x",), **settings})
    return Colocated(settings=cfg, tokenizer=tokenizer, device=CPU, distributed=False)


def _row(ids, prompt="p", **columns) -> dict:
    return {"prompt_ids": ids, "prompt": json.dumps(prompt), "columns": json.dumps(columns)}


def test_completions_end_at_their_first_end_token_and_the_rest_is_masked(model_and_tokenizer):
    model, tok = model_and_tokenizer
    engine = _engine(tok)
    ends = end_token_ids(tok, model)
    out = torch.tensor([[0, 5, 6, 9, ends[0], 4, 4], [7, 8, 6, 9, 9, 9, 9]])  # prompts [0?] 5 6 | 7 8
    ids, mask = torch.tensor([[0, 5, 6], [7, 8, 9]]), torch.tensor([[0, 1, 1], [1, 1, 1]])
    r = engine.rollout(torch.cat([ids, out[:, 3:]], 1), prompt_ids=ids, prompt_mask=mask, ends=ends,
                       rows=[_row([5, 6], "a", answer="1"), _row([7, 8, 9], [{"role": "user", "content": "b"}])], g=1)
    assert r.completion_mask.tolist() == [[1, 1, 0, 0], [1, 1, 1, 1]]
    assert r.truncated.tolist() == [False, True]
    assert r.completion_ids[0] == [9, ends[0]] and r.completion_ids[1] == [9, 9, 9, 9]
    assert r.attention_mask[0].tolist() == [0, 1, 1, 1, 1, 0, 0]
    # TRL's conventions: a chat prompt's completion is an assistant message; columns per completion
    assert isinstance(r.completions[0], str) and r.completions[1][0]["role"] == "assistant"
    assert r.columns == {"answer": ["1", None]} and r.prompts == ["a", [{"role": "user", "content": "b"}]]
    assert r.batch["position_ids"][0, :4].tolist() == [0, 0, 1, 2]


def test_sampling_is_seeded_and_groups_are_consecutive(model_and_tokenizer):
    model, tok = model_and_tokenizer
    engine = _engine(tok)
    rows = [_row([5, 6, 7]), _row([9, 10])]
    a = engine.sample(model, rows, seed=seed_for(1, step=3, micro_batch=0, rank=0))
    b = engine.sample(model, rows, seed=seed_for(1, step=3, micro_batch=0, rank=0))
    c = engine.sample(model, rows, seed=seed_for(1, step=4, micro_batch=0, rank=0))
    assert a.num_completions == 6 and torch.equal(a.input_ids, b.input_ids) and not torch.equal(a.input_ids, c.input_ids)
    assert a.input_ids[:3, :3].tolist() == [[5, 6, 7]] * 3 and a.input_ids[3:, 1:3].tolist() == [[9, 10]] * 3
    # sampling leaves the training's RNG where it was
    torch.manual_seed(0)
    before = torch.random.get_rng_state()
    engine.sample(model, rows, seed=5)
    assert torch.equal(torch.random.get_rng_state(), before)
    assert len({seed_for(1, step=s, micro_batch=m, rank=r) for s in range(3) for m in range(3) for r in range(3)}) == 27


def test_a_rows_log_probs_do_not_depend_on_the_padding_it_was_batched_with(model_and_tokenizer):
    model, tok = model_and_tokenizer
    engine = _engine(tok, num_generations=2)
    both = engine.sample(model, [_row([5, 6]), _row(list(range(20, 32)))], seed=1)
    batched = completion_logprobs(model, both.batch, device=CPU, chunk_tokens=0)
    for i in range(both.num_completions):  # each row on its own: no padding, its real tokens only
        keep = both.attention_mask[i].bool()
        length = int(both.completion_mask[i].sum())
        single = {"input_ids": both.input_ids[i:i + 1, keep], "attention_mask": torch.ones(1, int(keep.sum()), dtype=torch.long),
                  "completion_mask": torch.ones(1, length, dtype=torch.long)}
        own = completion_logprobs(model, single, device=CPU, chunk_tokens=0)
        torch.testing.assert_close(own[0], batched[i, :length], atol=1e-5, rtol=0)
