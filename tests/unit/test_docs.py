"""What the docs claim holds: every Markdown table renders as a table, `help()` of a recipe
section shows its fields' docstrings (docs/recipes.md says it does), and docs/recipes.md names
every recipe key (the README says it does)."""

from __future__ import annotations

import dataclasses
import pydoc
import re
import typing
from pathlib import Path

import pytest
from markdown_it import MarkdownIt

from homelab_ft.recipe import config, objectives

REPO = Path(__file__).resolve().parents[2]
DOCS = sorted((REPO / "docs").glob("*.md")) + [REPO / "README.md"]


def table_problems(text: str) -> list[str]:
    """Source lines that look like table rows (`| ... |`) but are not rendered inside a table (a
    blank line or a missing delimiter row turns them into a paragraph of raw text), and rows whose
    cell count differs from their header's (markdown-it pads or drops cells silently)."""
    tokens = MarkdownIt("commonmark").enable("table").parse(text)
    in_table, in_code = set(), set()
    for token in tokens:
        if token.type == "table_open":
            in_table.update(range(*token.map))
        elif token.type in ("fence", "code_block", "html_block"):
            in_code.update(range(*token.map))
    lines = text.splitlines()
    problems = []
    header_cells = None
    for i, line in enumerate(lines):
        if i in in_code or not line.lstrip().startswith("|"):
            header_cells = None
            continue
        if i not in in_table:
            problems.append(f"line {i + 1} is not part of a table: {line[:60]}")
            continue
        cells = len(re.split(r"(?<!\\)\|", line.strip().strip("|")))
        if header_cells is None:
            header_cells = cells
        elif cells != header_cells:
            problems.append(f"line {i + 1} has {cells} cells, its header {header_cells}: {line[:60]}")
    return problems


@pytest.mark.parametrize("path", DOCS, ids=lambda p: p.name)
def test_every_table_renders(path):
    assert table_problems(path.read_text(encoding="utf-8")) == []


def test_the_check_catches_a_blank_line_and_a_short_row():
    table = "| a | b |\n|---|---|\n| 1 | 2 |\n"
    assert table_problems(table) == []
    assert table_problems(table + "\n| 3 | 4 |\n") == ["line 5 is not part of a table: | 3 | 4 |"]
    assert table_problems(table + "| 3 |\n") == ["line 4 has 1 cells, its header 2: | 3 |"]
    assert table_problems("```\n| not | a table |\n```\n") == []


SECTIONS = [obj for module in (config, objectives) for obj in vars(module).values()
            if isinstance(obj, type) and dataclasses.is_dataclass(obj) and obj.__module__ == module.__name__]
"""Every recipe section's class: config's and the objectives' (DpoConfig, GrpoConfig)."""


@pytest.mark.parametrize("cls", SECTIONS, ids=lambda c: c.__name__)
def test_help_shows_every_field_and_its_docstring(cls):
    shown = pydoc.render_doc(cls, renderer=pydoc.plaintext)
    for field in dataclasses.fields(cls):
        assert f"{field.name}: " in shown
        description = cls.__pydantic_fields__[field.name].description
        if description:
            assert description.splitlines()[0] in shown, field.name


def test_help_of_train_config_as_docs_recipes_md_runs_it():
    shown = pydoc.render_doc(config.TrainConfig, renderer=pydoc.plaintext)
    assert "max_steps: PositiveInt | None = None" in shown
    assert "Optimizer steps (each is `micro_batch_size x grad_accum_steps x ranks` samples); 100" in shown
    assert "help(TrainConfig)" in (REPO / "docs" / "recipes.md").read_text()


def test_the_llama_1b_recipe_comment_is_the_plan():
    """The comment's per-GPU items are the planner's, in its order, and add up to its total."""
    from homelab_ft.plan.planner import plan_for_recipe

    path = REPO / "recipes" / "llama-1b-full-2x24gb.yaml"
    m = plan_for_recipe(config.load_recipe(path)).chosen.memory
    planned = [m.weights, m.gradients, m.optimizer, m.gathered, m.gradients_in_backward - m.gradients,
               m.activations, m.logits, m.context + m.fragmentation]
    comment = [line for line in path.read_text().splitlines() if line.startswith("#")]
    items = [re.search(r"\(?(\d+\.\d\d)\)?$", line) for line in comment]
    values = [(float(x.group(1)), x.group(0).startswith("(")) for x in items if x]
    assert [v for v, _ in values] == [round(b / 2**30, 2) for b in planned]
    peak = sum(b for b, (_, aside) in zip(planned, values, strict=True) if not aside)
    assert peak == m.total and f"`homelab-ft plan`: {m.total / 2**30:.1f} GiB per GPU" in "\n".join(comment)


def _section_type(annotation) -> type | None:
    """The config dataclass a field holds (itself, or inside `list[...]`, `X | None`), else None."""
    for arg in (annotation, *typing.get_args(annotation)):
        if isinstance(arg, type) and dataclasses.is_dataclass(arg):
            return arg
    return None


def recipe_keys() -> list[tuple[str, str | None, str]]:
    """(top-level field, key in its section or None, dotted key) for every key a recipe may set,
    read off the typed dataclasses: `train.lr`, `data.sources[].path`, `name`."""
    found = []
    hints = typing.get_type_hints(config.Recipe)
    for top in dataclasses.fields(config.Recipe):
        section = _section_type(hints[top.name])
        if section is None:
            found.append((top.name, None, top.name))
            continue
        inner = typing.get_type_hints(section)
        for field in dataclasses.fields(section):
            nested = _section_type(inner[field.name])
            found += ([(top.name, field.name, f"{top.name}.{field.name}")] if nested is None else
                      [(top.name, sub.name, f"{top.name}.{field.name}[].{sub.name}") for sub in dataclasses.fields(nested)])
    return found


def test_docs_recipes_md_names_every_recipe_key():
    """Issue 39.7: `train.eval_max_batches` and others were in no doc. A key counts as named when its
    section's row of the Sections table lists it (`` `lr` `` in the `train` row; a top-level key has a
    row of its own) or the page spells it dotted (`train.num_epochs`)."""
    text = (REPO / "docs" / "recipes.md").read_text()
    rows = {m.group(1): m.group(0) for m in re.finditer(r"^\| `([a-z_]+)` \|.*$", text, re.M)}
    keys = recipe_keys()
    assert {"train.eval_max_batches", "data.sources[].path", "name"} <= {dotted for *_, dotted in keys}
    missing = [dotted for top, key, dotted in keys
               if not (top in rows if key is None else
                       f"`{key}`" in rows.get(top, "") or re.search(rf"\b{top}\.{key}\b", text))]
    assert not missing, f"docs/recipes.md does not name {missing}"


def test_module_paths_in_the_docs_exist():
    """Issue 39.7: docs/multi-node.md named `homelab_ft.supervise` after it moved to homelab_ft.cluster."""
    for path in DOCS:
        for dotted in set(re.findall(r"\bhomelab_ft(?:\.[A-Za-z_]\w*)+", path.read_text())):
            parts = dotted.split(".")
            assert (REPO.joinpath(*parts).with_suffix(".py").is_file() or REPO.joinpath(*parts, "__init__.py").is_file()), \
                f"{path.name} names {dotted}, which is no module"
