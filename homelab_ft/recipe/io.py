"""Recipe files in and out, and the messages that make strict loading usable. Torch-free.

config.py defines what a recipe is (the sections, every default once); this module reads the YAML
mapping a recipe file holds, applies `section.key=value` command-line overrides to it, turns
pydantic's first validation error into one line a user can act on (the dotted key, and for an
unknown key the nearest valid one), and writes a recipe back as YAML. It knows no section: the
dataclass tree it explains is passed in.
"""

from __future__ import annotations

import dataclasses
import difflib
import inspect
from pathlib import Path
from typing import Any, get_args, get_origin, get_type_hints

import yaml
from pydantic import ValidationError

from homelab_ft.errors import UserError
from homelab_ft.recipe import bounded_yaml


def read_yaml_mapping(path: Path) -> dict[str, Any]:
    """The mapping of sections a recipe file holds; a UserError naming the file otherwise."""
    if not path.is_file():
        what = "is a directory" if path.is_dir() else "not found"
        raise UserError(f"recipe {path} {what}; pass a YAML file such as recipes/smollm2-lora-cpu.yaml")
    try:
        raw = bounded_yaml.safe_load(path.read_text(encoding="utf-8"))
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f" line {mark.line + 1}" if mark is not None else ""
        problem = getattr(err, "problem", None) or str(err).splitlines()[0]
        raise UserError(f"{path}:{where} is not valid YAML: {problem}") from None
    except UnicodeDecodeError:
        raise UserError(f"{path} is not UTF-8 text; save the recipe as UTF-8") from None
    if raw is None or raw == {}:
        raise UserError(f"{path}: the recipe is empty; start from one in recipes/ (e.g. recipes/smollm2-lora-cpu.yaml; "
                        "`homelab-ft recipes` lists them)")
    if not isinstance(raw, dict):
        raise UserError(f"{path}: a recipe is a mapping of sections (model:, data:, train: ...), got a {type(raw).__name__}")
    return raw


def write_yaml(data: dict[str, Any], path: Path) -> None:
    """Keys in the order given (the sections' field order), so a written recipe reads like one."""
    path.write_text(yaml.safe_dump(data, sort_keys=False), encoding="utf-8")


def recipe_to_dict(recipe) -> dict[str, Any]:
    """A `config.Recipe` as plain data (for the run directory's resolved recipe and for JSON)."""
    data = dataclasses.asdict(recipe)
    data["train"]["betas"] = list(data["train"]["betas"])
    return data


def dump_recipe(recipe, path: Path) -> None:
    write_yaml(recipe_to_dict(recipe), path)


def apply_overrides(raw: dict[str, Any], overrides) -> dict[str, Any]:
    """`train.lr=1e-4 data.packing=true` -> nested dict updates; values parsed as YAML scalars."""
    raw = _deepcopy(raw)
    for item in overrides:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise UserError(f"override {item!r} is not key=value; write e.g. train.lr=1e-4")
        parts = key.strip().split(".")
        node = raw
        for depth, part in enumerate(parts[:-1]):
            child = node.get(part)
            if child is None:
                child = node[part] = {}
            if not isinstance(child, dict):
                raise UserError(f"override {item!r}: {'.'.join(parts[: depth + 1])} is not a section")
            node = child
        try:
            node[parts[-1]] = bounded_yaml.safe_load(value) if value.strip() else None
        except yaml.YAMLError:
            node[parts[-1]] = value
    return raw


def _deepcopy(obj):
    if isinstance(obj, dict):
        return {k: _deepcopy(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_deepcopy(v) for v in obj]
    return obj


# --------------------------------------------------------------------------------------------
# error messages


_UNKNOWN = {"unexpected_keyword_argument", "extra_forbidden"}


def explain(err: ValidationError, *, root: type) -> str:
    """Turn pydantic's first error into one line: dotted key, what was wrong, what to write.
    `root`: the dataclass validated (config.Recipe), whose fields name the valid keys."""
    errors = err.errors()
    # An unknown key explains a "missing" one next to it (`pth:` for `path:`), so report it first.
    unknown = [e for e in errors if e["type"] in _UNKNOWN]
    first = (unknown or errors)[0]
    loc = [str(p) for p in first["loc"]]
    dotted = _dotted(loc)
    kind = first["type"]
    if kind in _UNKNOWN:
        valid = _valid_keys(loc[:-1], root=root)
        hint = difflib.get_close_matches(loc[-1], valid, n=1, cutoff=0.6)
        fix = f"did you mean {_dotted(loc[:-1] + [hint[0]])}?" if hint else f"valid keys: {', '.join(valid)}"
        return f"unknown key {dotted}; {fix}"
    if kind == "missing" or kind == "missing_argument":
        return f"{dotted} is required"
    if kind == "value_error" and first.get("ctx", {}).get("error") is not None:
        return str(first["ctx"]["error"])  # a section's own check (__post_init__) names its keys
    value = first.get("input")
    shown = repr(value) if not isinstance(value, dict) else "a mapping"
    return f"{dotted} = {shown}: {first['msg'].lower()}"


def _dotted(loc: list[str]) -> str:
    out = ""
    for part in loc:
        if part.isdigit():
            out += f"[{part}]"
        elif "[" in part or "-" in part:  # pydantic's validator names: literal['x'], list[str], function-after
            continue
        else:
            out += ("." if out else "") + part
    return out or "<top level>"


def _valid_keys(loc: list[str], *, root: type) -> list[str]:
    """Field names of the dataclass that `loc` points into."""
    cls: Any = root
    for part in loc:
        if part.isdigit():
            continue
        hints = get_type_hints(cls, include_extras=False)
        if part not in hints:
            break
        cls = _dataclass_in(hints[part])
        if cls is None:
            return []
    return sorted(f.name for f in dataclasses.fields(cls))


def _dataclass_in(annotation) -> Any:
    if dataclasses.is_dataclass(annotation):
        return annotation
    origin = get_origin(annotation)
    if origin is not None:
        for arg in get_args(annotation):
            found = _dataclass_in(arg)
            if found is not None:
                return found
    return None


def with_field_docs(cls: type) -> str:
    """The class docstring followed by every field (`name: type = default`) and the docstring
    written under it, so `help(TrainConfig)` shows them: pydantic reads those docstrings into each
    field's `description` (use_attribute_docstrings), but help() shows only the class's `__doc__`."""
    own = cls.__doc__ if cls.__doc__ and not cls.__doc__.startswith(f"{cls.__name__}(") else ""  # not the dataclass signature
    lines = [inspect.cleandoc(own), "", "Fields:"] if own else ["Fields:"]
    for field in dataclasses.fields(cls):
        info = cls.__pydantic_fields__[field.name]
        default = f"{info.default_factory.__name__}()" if info.default_factory else repr(info.default)
        lines.append(f"    {field.name}: {field.type} = {default}")
        lines += [f"        {line}" for line in (info.description or "").splitlines()]
    return "\n".join(lines)


def attach_field_docs(namespace: dict) -> None:
    """`with_field_docs` on every dataclass defined in a module (pass its `globals()`)."""
    module = namespace["__name__"]
    for obj in list(namespace.values()):
        if isinstance(obj, type) and dataclasses.is_dataclass(obj) and obj.__module__ == module:
            obj.__doc__ = with_field_docs(obj)
