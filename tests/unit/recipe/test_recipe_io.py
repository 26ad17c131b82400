"""recipe_io.py on its own: it explains any strict pydantic dataclass tree it is given, applies
overrides to plain dicts, and reads and writes YAML mappings; config.py's tests cover recipes."""

from __future__ import annotations

import pytest
from pydantic import ConfigDict, TypeAdapter, ValidationError
from pydantic.dataclasses import dataclass

from homelab_ft.errors import UserError
from homelab_ft.recipe.io import apply_overrides, explain, read_yaml_mapping, write_yaml

_STRICT = ConfigDict(extra="forbid")


@dataclass(frozen=True, config=_STRICT)
class Inner:
    width: int = 1
    depth: int = 2


@dataclass(frozen=True, config=_STRICT)
class Outer:
    inner: Inner = Inner()
    items: list[Inner] | None = None


def _message(raw: dict) -> str:
    with pytest.raises(ValidationError) as err:
        TypeAdapter(Outer).validate_python(raw)
    return explain(err.value, root=Outer)


def test_unknown_keys_name_the_nearest_field_of_the_given_root():
    assert _message({"inner": {"widht": 3}}) == "unknown key inner.widht; did you mean inner.width?"
    assert _message({"items": [{"deep": 3}]}) == "unknown key items[0].deep; did you mean items[0].depth?"
    assert _message({"inner": {"zzz": 3}}) == "unknown key inner.zzz; valid keys: depth, width"


def test_a_wrong_value_names_the_key_and_what_it_accepts():
    assert _message({"inner": {"width": "wide"}}).startswith("inner.width = 'wide': input should be a valid integer")


def test_overrides_nest_parse_scalars_and_leave_the_input_alone():
    raw = {"train": {"lr": 1.0}}
    out = apply_overrides(raw, ["train.lr=0.0001", "data.packing=true", "name=[run", "model.tokenizer="])
    # text that is not valid YAML stays the text; an empty value is None
    assert out == {"train": {"lr": 0.0001}, "data": {"packing": True}, "name": "[run", "model": {"tokenizer": None}}
    assert raw == {"train": {"lr": 1.0}}
    with pytest.raises(UserError, match="is not key=value"):
        apply_overrides({}, ["train.lr"])
    with pytest.raises(UserError, match="train.lr is not a section"):
        apply_overrides({"train": {"lr": 1}}, ["train.lr.x=2"])


def test_yaml_round_trip_keeps_key_order_and_refuses_non_mappings(tmp_path):
    path = tmp_path / "r.yaml"
    write_yaml({"name": "a", "model": {"path": "smollm2"}, "data": {}}, path)
    assert list(read_yaml_mapping(path)) == ["name", "model", "data"]
    path.write_text("- a\n- b\n", encoding="utf-8")
    with pytest.raises(UserError, match="a recipe is a mapping of sections"):
        read_yaml_mapping(path)
    with pytest.raises(UserError, match="not found"):
        read_yaml_mapping(tmp_path / "missing.yaml")


# A self-referencing anchor (it gave a 3,000-line RecursionError) and an alias bomb (9 levels of 10
# aliases each: 10**9 values, which hung) are refused in one line, fast, before anything walks them.
_RECURSIVE = "name: x\nmodel: &m\n  path: m\n  again: *m\n"
_BOMB = "a0: &a0 [x, x, x, x, x, x, x, x, x, x]\n" + "".join(
    f"a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * 10)}]\n" for i in range(1, 10))


@pytest.mark.timeout(20)
@pytest.mark.parametrize("text, says", [
    (_RECURSIVE, "refers to itself"), (_BOMB, "expand to more than"),
    ("name: " + "[" * 200 + "]" * 200 + "\n", "nest deeper than"),  # past the bound, within Python's stack
    ("name: " + "[" * 5000 + "]" * 5000 + "\n", "nest deeper than"),  # past Python's stack in PyYAML's composer
])
def test_recursive_anchors_and_alias_bombs_are_one_line(tmp_path, text, says):
    path = tmp_path / "r.yaml"
    path.write_text(text)
    with pytest.raises(UserError) as err:
        read_yaml_mapping(path)
    message = str(err.value)
    assert str(path) in message and says in message and "\n" not in message


def test_ordinary_aliases_still_read(tmp_path):
    path = tmp_path / "r.yaml"
    path.write_text("base: &b {lr: 1.0e-4, seed: 3}\ntrain: *b\nlist: [*b, *b]\n")
    raw = read_yaml_mapping(path)
    assert raw["train"] == {"lr": 1.0e-4, "seed": 3} and raw["list"] == [raw["base"]] * 2
