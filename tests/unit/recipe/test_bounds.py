"""Every numeric recipe field, found by introspection, against nan, inf, -inf, 0, a negative and a
huge value: each is refused in one line naming the field, or listed in ACCEPTED with the reason."""

from __future__ import annotations

import dataclasses
import math
import typing

import pytest

from homelab_ft.errors import UserError
from homelab_ft.recipe.config import Recipe, recipe_from_dict

_ZERO_IS_OFF = "0 means off / none (documented in the field)"
_HUGE_IS_A_CHOICE = "finite and in range: no physical upper bound (a size, weight or scale the user chooses)"

ACCEPTED = {
    # (dotted field, value label): why the value is legitimate
    **{(f, "zero"): _ZERO_IS_OFF for f in (
        "train.warmup_steps", "train.eval_every", "train.sample_every", "train.save_every", "train.loss_chunk_tokens", "train.skip_nonfinite_steps",
        "train.weight_decay", "train.max_grad_norm", "train.min_lr_ratio", "dpo.label_smoothing", "dpo.sft_weight",
        "lora.dropout", "data.eval_fraction", "planner.headroom", "grpo.beta",
        "grpo.log_completions_every", "dpo.simpo_gamma")},
    ("train.seed", "zero"): "0 is a seed every RNG takes",
    ("grpo.max_staleness", "zero"): "0: the trainer waits for the rollout node (the default)",
    ("train.betas[0]", "zero"): "AdamW takes beta1 = 0 (no momentum: RMSprop-like)",
    ("train.betas[1]", "zero"): "AdamW takes beta2 = 0 (the second moment is the last gradient squared)",
    ("cluster.inter_latency_ms", "zero"): "a latency of 0 is an ideal link the planner can price",
    ("cluster.intra_latency_ms", "zero"): "a latency of 0 is an ideal link the planner can price",
    **{(f, "huge"): _HUGE_IS_A_CHOICE for f in (
        "lora.alpha", "dpo.beta", "grpo.beta", "data.sources[].weight", "data.eval_sources[].weight", "train.num_epochs",
        "train.weight_decay", "train.max_grad_norm", "dpo.sft_weight", "dpo.simpo_gamma", "dpo.desirable_weight",
        "dpo.undesirable_weight", "cluster.vram_gib", "cluster.host_ram_gib",
        "cluster.inter_link_gbit", "cluster.gpu_tflops", "cluster.cpu_gflops_per_core", "cluster.inter_latency_ms", "cluster.intra_link_gbit",
        "cluster.intra_latency_ms")},
}

_LABELS = ("nan", "inf", "-inf", "zero", "negative", "huge")


def _value(label: str, *, is_int: bool):
    return {"nan": math.nan, "inf": math.inf, "-inf": -math.inf, "zero": 0, "negative": -1,
            "huge": 2**70 if is_int else 1e30}[label]


def _leaves(hint) -> list:
    """The plain types and literal values a (possibly Annotated / Optional / Union) hint accepts."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is typing.Annotated:
        return _leaves(args[0])
    if origin is typing.Literal:
        return [type(a) for a in args]
    if origin in (typing.Union, getattr(__import__("types"), "UnionType", None), list, tuple, dict):
        return [leaf for a in args if a is not Ellipsis for leaf in _leaves(a)]
    return [hint]


def _numeric(hint) -> bool:
    return any(leaf in (int, float) for leaf in _leaves(hint))


def _required(cls) -> dict:
    return {f.name: "x.jsonl" for f in dataclasses.fields(cls)
            if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING}


def numeric_fields(cls=Recipe, path=()):
    """(dotted name, raw-recipe builder, is_int) for every numeric field reachable from Recipe."""
    hints = typing.get_type_hints(cls, include_extras=True)
    for field in dataclasses.fields(cls):
        hint = hints[field.name]
        inner = typing.get_args(hint)[0] if typing.get_origin(hint) is list else hint
        if dataclasses.is_dataclass(inner):
            step = (field.name, list) if inner is not hint else (field.name,)
            yield from numeric_fields(inner, path + (step,))
        elif typing.get_origin(hint) is tuple and _numeric(hint):
            default = getattr(cls(**_required(cls)), field.name)
            for i, arg in enumerate(typing.get_args(hint)):
                yield (_dotted(path, f"{field.name}[{i}]"),
                       _builder(path, field.name, lambda v, i=i, d=default: (*d[:i], v, *d[i + 1:])), int in _leaves(arg))
        elif _numeric(hint):
            yield _dotted(path, field.name), _builder(path, field.name, lambda v: v), float not in _leaves(hint)


def _dotted(path, name):
    return ".".join([step[0] + ("[]" if len(step) > 1 else "") for step in path] + [name])


def _builder(path, name, wrap):
    def build(value):
        leaf = {name: wrap(value)}
        for step in reversed(path):
            leaf = {step[0]: [{**_required_for(path, step), **leaf}]} if len(step) > 1 else {step[0]: leaf}
        return leaf
    return build


def _required_for(path, step):
    return {"path": "x.jsonl"}  # SourceConfig, the one dataclass in a list, requires its path


FIELDS = list(numeric_fields())


def test_the_walk_finds_the_fields():
    names = {name for name, _, _ in FIELDS}
    assert {"train.lr", "train.seed", "train.betas[0]", "lora.alpha", "dpo.beta", "grpo.beta", "data.sources[].weight",
            "quant.bits", "cluster.nodes"} <= names
    assert {name for name, _ in ACCEPTED} <= names  # the table names no field that does not exist


@pytest.mark.parametrize("label", _LABELS)
@pytest.mark.parametrize("name, build, is_int", FIELDS, ids=[f[0] for f in FIELDS])
def test_every_numeric_value_is_refused_or_documented(name, build, is_int, label):
    raw = build(_value(label, is_int=is_int))
    if (name, label) in ACCEPTED:
        recipe_from_dict(raw)
        return
    with pytest.raises(UserError) as info:
        recipe_from_dict(raw)
    message = str(info.value)
    assert "\n" not in message
    assert name.split(".")[-1].split("[")[0] in message, message


@pytest.mark.parametrize("raw, expected", [
    ({"train": {"lr": math.inf}}, "train.lr = inf: input should be a finite number"),
    ({"lora": {"alpha": math.inf}}, "lora.alpha = inf: input should be a finite number"),
    ({"dpo": {"beta": math.inf}}, "dpo.beta = inf: input should be a finite number"),
    ({"train": {"betas": [0.9, 1.0]}}, "train.betas[1] = 1.0: input should be less than 1"),
    ({"train": {"seed": 2**64}}, "train.seed = 18446744073709551616: input should be less than 4294967296"),
    ({"train": {"lr": 3.0}}, "train.lr = 3.0: input should be less than or equal to 1"),
])
def test_issue_23_values_are_one_line_refusals(raw, expected):
    with pytest.raises(UserError) as info:
        recipe_from_dict(raw)
    assert str(info.value) == f"recipe: {expected}"
