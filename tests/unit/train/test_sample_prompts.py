"""train.sample_every's pieces that need no training: the held-out prompts, the state kept, the config."""

from __future__ import annotations

import datasets
import pytest
import torch

from homelab_ft.data import IGNORE_INDEX
from homelab_ft.recipe.config import TrainConfig
from homelab_ft.train import samples


class _Tokenizer:
    def decode(self, ids, skip_special_tokens=True):
        return " ".join(f"t{i}" for i in ids)


def test_held_out_prompts_are_the_tokens_before_the_first_trained_one():
    rows = datasets.Dataset.from_dict({
        "input_ids": [[1, 2, 3, 4], [5, 6, 7], [8, 9, 10], [11, 12], [13, 14]],
        "labels": [[IGNORE_INDEX, IGNORE_INDEX, 3, 4], [5, 6, 7], [IGNORE_INDEX, 9, 10], [IGNORE_INDEX, 12],
                   [IGNORE_INDEX, 14]],
    })
    prompts = samples.held_out_prompts(rows, _Tokenizer())
    # the second row trains every token (train_on_inputs): it has no prompt; at most 3 are taken
    assert [p.ids for p in prompts] == [(1, 2), (8,), (11,)]
    assert prompts[0].text == "t1 t2"
    assert samples.held_out_prompts(None, _Tokenizer()) == ()


def test_held_out_prompts_of_preference_pairs_take_the_chosen_side():
    rows = datasets.Dataset.from_dict({"chosen_input_ids": [[1, 2, 3]], "chosen_labels": [[IGNORE_INDEX, 2, 3]],
                                       "rejected_input_ids": [[1, 4]], "rejected_labels": [[IGNORE_INDEX, 4]]})
    assert [p.ids for p in samples.held_out_prompts(rows, _Tokenizer())] == [(1,)]


def test_sampling_leaves_the_rng_and_the_mode_as_they_were():
    model = torch.nn.Dropout(0.5).train()
    torch.manual_seed(0)
    expected = torch.rand(3)
    torch.manual_seed(0)
    with samples.preserved(model, device=torch.device("cpu")):
        assert not model.training
        torch.rand(100)  # a generate that draws
    assert model.training
    assert torch.equal(torch.rand(3), expected)


def test_due_every_n_steps_and_never_when_off():
    on = samples.Samples(prompts=(), tokenizer=None, every=3, max_new_tokens=4)
    assert [s for s in range(1, 10) if on.due(s)] == [3, 6, 9]
    assert not any(samples.Samples(prompts=(), tokenizer=None, every=0, max_new_tokens=4).due(s) for s in range(1, 10))


def test_sample_prompts_without_sample_every_are_refused():
    with pytest.raises(ValueError, match="train.sample_every=N"):
        TrainConfig(sample_prompts=("hello",))
    assert TrainConfig(sample_every=2, sample_prompts=("hello",)).sample_prompts == ("hello",)
    assert TrainConfig().sample_every == 0  # off by default
