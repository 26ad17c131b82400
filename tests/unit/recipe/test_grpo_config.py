"""The recipe's `grpo:` section (objective: grpo, issue 33): TRL 1.16's names and defaults, each
value validated with the key named, and what the objective needs (a reward, one weight each)."""

from __future__ import annotations

import dataclasses

import pytest

from homelab_ft.errors import UserError
from homelab_ft.recipe.config import recipe_from_dict
from homelab_ft.recipe.objectives import GrpoConfig

TRL_1_16_DEFAULTS = {  # trl/trainer/grpo_config.py of trl 1.16.0
    "num_generations": 8, "max_completion_length": 512, "temperature": 1.0, "top_p": 1.0, "beta": 0.0,
    "epsilon": 0.2, "epsilon_high": None, "scale_rewards": "group", "num_iterations": 1,
    "mask_truncated_completions": False, "loss_type": "dapo", "importance_sampling_level": "token",
    "reward_weights": None,
}


def _error(raw: dict) -> str:
    with pytest.raises(UserError) as caught:
        recipe_from_dict(raw)
    assert "\n" not in str(caught.value)
    return str(caught.value)


def test_defaults_are_trls():
    got = dataclasses.asdict(GrpoConfig())
    assert {k: got[k] for k in TRL_1_16_DEFAULTS} == TRL_1_16_DEFAULTS
    assert got["reward_funcs"] == ()
    assert recipe_from_dict({}).grpo == GrpoConfig()  # an SFT recipe carries the section untouched


def test_a_grpo_recipe_loads():
    recipe = recipe_from_dict({"objective": "grpo", "grpo": {
        "reward_funcs": ["exact_answer", {"regex_match": {"pattern": "^ANSWER: "}}, "rewards.py:short"],
        "reward_weights": [1.0, 0.5, 0.1], "loss_type": "dr_grpo", "epsilon_high": 0.28,
        "importance_sampling_level": "sequence"}})
    assert recipe.grpo.reward_funcs[1] == {"regex_match": {"pattern": "^ANSWER: "}}
    assert recipe.grpo.epsilon_upper == 0.28 and GrpoConfig(epsilon=0.3).epsilon_upper == 0.3


@pytest.mark.parametrize("grpo,message", [
    ({}, "objective=grpo learns from rewards; name at least one in grpo.reward_funcs"),
    ({"reward_funcs": ["exact_answer"], "reward_weights": [1.0, 2.0]},
     "grpo.reward_weights has 2 weights for 1 grpo.reward_funcs"),
    ({"reward_funcs": ["exact_answer"], "num_generations": 1}, "grpo.num_generations = 1"),
    ({"reward_funcs": ["exact_answer"], "epsilon": 1.0}, "grpo.epsilon = 1.0"),
    ({"reward_funcs": ["exact_answer"], "top_p": 0}, "grpo.top_p = 0"),
    ({"reward_funcs": ["exact_answer"], "beta": float("inf")}, "grpo.beta"),
    ({"reward_funcs": ["exact_answer"], "loss_type": "cispo"}, "grpo.loss_type = 'cispo'"),
    ({"reward_funcs": ["exact_answer"], "scale_rewards": True}, "grpo.scale_rewards"),
    ({"reward_funcs": ["exact_answer"], "reward_weights": [float("nan")]}, "grpo.reward_weights"),
    ({"reward_funcs": ["exact_answer"], "num_generation": 4}, "unknown key grpo.num_generation; did you mean "
                                                             "grpo.num_generations?"),
    ({"reward_funcs": [3]}, "grpo.reward_funcs"),
])
def test_bad_values_name_their_key(grpo, message):
    got = _error({"objective": "grpo", "grpo": grpo})
    assert message in got, got
