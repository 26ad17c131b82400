from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from homelab_ft.errors import UserError
from homelab_ft.recipe.config import load_recipe, recipe_from_dict
from homelab_ft.recipe.io import dump_recipe

RECIPES = sorted(Path(__file__).resolve().parents[3].joinpath("recipes").glob("*.yaml"))


def error_of(raw: dict, overrides=()) -> str:
    with pytest.raises(UserError) as info:
        recipe_from_dict(raw, overrides=overrides)
    return str(info.value)


@pytest.mark.parametrize(
    "raw, expected",
    [
        ({"trian": {}}, "unknown key trian; did you mean train?"),
        ({"train": {"lrr": 1}}, "unknown key train.lrr; did you mean train.lr?"),
        ({"data": {"sources": [{"pth": "x"}]}}, "unknown key data.sources[0].pth; did you mean data.sources[0].path?"),
        ({"train": {"zzz": 1}}, "valid keys:"),
        ({"method": "qlroa"}, "method = 'qlroa'"),
        ({"train": {"max_steps": 0}}, "train.max_steps = 0"),
        ({"lora": {"target_modules": 3}}, "lora.target_modules = 3"),
        ({"cluster": {"nodes": "two"}}, "cluster.nodes"),
    ],
)
def test_errors_name_the_dotted_key(raw, expected):
    assert expected in error_of(raw)


def test_defaults_live_in_the_dataclasses():
    recipe = recipe_from_dict({})
    assert recipe.method == "auto" and recipe.train.lr == 2e-4 and recipe.lora.target_modules == "all-linear"
    assert recipe.run_dir == Path("runs/run")


def test_overrides_are_typed_yaml_scalars():
    recipe = recipe_from_dict({}, overrides=["train.lr=1e-4", "data.packing=true", "lora.target_modules=[q_proj,v_proj]"])
    assert recipe.train.lr == 1e-4 and recipe.data.packing is True
    assert recipe.lora.target_modules == ["q_proj", "v_proj"]
    assert "unknown key train.lrr" in error_of({}, overrides=["train.lrr=1"])
    assert "not a section" in error_of({"method": "lora"}, overrides=["method.x=1"])


def test_frozen():
    recipe = recipe_from_dict({})
    with pytest.raises(dataclasses.FrozenInstanceError):
        recipe.train.lr = 1.0  # type: ignore[misc]


def test_resolved_recipe_round_trips(tmp_path):
    recipe = recipe_from_dict({"name": "x", "train": {"lr": 3e-4}, "data": {"sources": [{"path": "a.jsonl", "limit": 5}]}})
    dump_recipe(recipe, tmp_path / "r.yaml")
    assert load_recipe(tmp_path / "r.yaml") == recipe


@pytest.mark.parametrize("path", RECIPES, ids=lambda p: p.stem)
def test_shipped_recipes_load(path):
    load_recipe(path)


@pytest.mark.parametrize("raw, message", [
    ({"objective": "dpo", "method": "lora"}, "data.images trains with objective: sft"),
    ({"data": {"packing": True}}, "data.images rows are not packed"),
    ({"train": {"sample_every": 5}}, "train.sample_every samples replies to text prompts"),
    ({"data": {"image_min_pixels": 100, "image_max_pixels": 50}}, "data.image_min_pixels=100 is above"),
])
def test_image_rows_refuse_what_they_cannot_run_in_one_line(raw, message):
    raw = {**raw, "data": {"images": True, **raw.get("data", {})}}
    with pytest.raises(UserError, match=message):
        recipe_from_dict(raw)
