"""The package's shape, checked: one subpackage per stage, imports only in the allowed directions,
no import cycles, and modules and functions short enough to read.

A run flows recipe -> plan -> model -> data -> loop -> checkpoint -> export; each stage is a
subpackage, and the shared vocabulary (errors, config, rung, locate, logs) sits at the root. The
directions below are docs/architecture.md's; a new import that breaks one fails here, naming it.
Lazy imports inside functions count too: they are still dependencies, only deferred.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "homelab_ft"

ALLOWED = {
    "root": {"root"},
    "plan": {"plan", "root"},
    "data": {"data", "root"},
    "model": {"model", "root"},
    "store": {"store", "root"},
    "distributed": {"distributed", "model", "root"},
    "train": {"train", "store", "distributed", "model", "data", "root"},
    "export": {"export", "store", "model", "root"},
    "harness": {"harness", "root"},
    "report": {"report", "train", "store", "root"},
    "cluster": {"cluster", "plan", "distributed", "root"},
    "cli": None,  # the commands may import anything
    "demo": None,
}
MAX_MODULE_LINES = 600
MAX_FUNCTION_LINES = 80


def _modules() -> dict[str, Path]:
    found = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        found[name] = path
    return found


ROOT_PACKAGES = {"recipe", "rules"}
"""Folders of the shared vocabulary: the recipe's sections and the planner-runtime rules, root
like errors.py or rung.py (torch-free, imported by every stage, importing no stage)."""


def _stage(module: str) -> str:
    if module == "homelab_ft.__main__":  # `python -m homelab_ft`: the CLI's entry point
        return "cli"
    parts = module.split(".")
    if len(parts) > 2 or (len(parts) == 2 and (PACKAGE / parts[1]).is_dir()):
        return "root" if parts[1] in ROOT_PACKAGES else parts[1]
    return "root"


def _imports(path: Path, known: dict[str, Path]) -> set[str]:
    """Every homelab_ft module this file imports, at the top or inside a function."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "homelab_ft":
            for alias in node.names:
                child = f"{node.module}.{alias.name}"
                out.add(child if child in known else node.module)
        elif isinstance(node, ast.Import):
            out.update(a.name for a in node.names if a.name.split(".")[0] == "homelab_ft")
    return out


def _graph() -> dict[str, set[str]]:
    known = _modules()
    return {name: {t for t in _imports(path, known) if t != name} for name, path in known.items()}


def test_every_module_sits_in_a_stage():
    stages = {_stage(m) for m in _modules()} - {"root"}
    assert stages <= set(ALLOWED), f"a subpackage the layout does not name: {stages - set(ALLOWED)}"
    assert not [p for p in PACKAGE.rglob("*") if p.is_dir() and p.name == "build"], ".gitignore ignores build/"


def test_imports_follow_the_allowed_directions():
    wrong = []
    for module, targets in _graph().items():
        allowed = ALLOWED[_stage(module)]
        if allowed is None:
            continue
        wrong += [f"{module} -> {t}" for t in sorted(targets) if t != "homelab_ft" and _stage(t) not in allowed]
    assert not wrong, "imports against the layout (docs/architecture.md):\n" + "\n".join(wrong)


def test_no_import_cycles():
    graph = _graph()
    cycles, index, low, stack, on_stack = [], {}, {}, [], set()

    def visit(v: str) -> None:  # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in graph:
                continue
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = set()
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.add(w)
                if w == v:
                    break
            # a package's front door importing its own modules is not a cycle a reader trips over
            if len(component) > 1:
                cycles.append(sorted(component))

    for v in graph:
        if v not in index:
            visit(v)
    assert not cycles, f"import cycles: {cycles}"


def test_plan_and_the_root_import_no_torch_at_module_level():
    """`homelab-ft plan` stays torch-free: nothing plan/ or the root imports at the top pulls torch in."""
    heavy = {"torch", "transformers", "peft", "datasets", "bitsandbytes", "accelerate"}
    wrong = []
    for module, path in _modules().items():
        if _stage(module) not in ("plan", "root"):
            continue
        for node in ast.parse(path.read_text()).body:
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            wrong += [f"{module}: {n}" for n in names if n.split(".")[0] in heavy]
    assert not wrong, wrong


def test_modules_and_functions_are_short():
    long_modules, long_functions = [], []
    for module, path in _modules().items():
        source = path.read_text()
        if (n := len(source.splitlines())) > MAX_MODULE_LINES:
            long_modules.append(f"{module}: {n} lines")
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                length = node.end_lineno - node.lineno + 1
                if length > MAX_FUNCTION_LINES:
                    long_functions.append(f"{module}.{node.name}: {length} lines")
    assert not long_modules and not long_functions, (long_modules, long_functions)


def test_nothing_below_the_cli_prints():
    """Below cli/ code logs (`logging`) and raises `UserError`; only the commands print. A module run
    as its own program (`python -m homelab_ft.cluster.supervise`, torchrun's agent) may print in its
    `main`."""
    wrong = []
    for module, path in _modules().items():
        if _stage(module) in ("cli", "demo"):
            continue
        tree = ast.parse(path.read_text())
        entry = {n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "main"}
        allowed = {id(x) for fn in entry for x in ast.walk(fn)}
        wrong += [f"{module}:{node.lineno}" for node in ast.walk(tree)
                  if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "print" and id(node) not in allowed]
    assert not wrong, f"print() below the CLI: {wrong}"


def test_every_module_is_in_its_package_map():
    """Each package's `__init__` docstring is its map: every module and sub-package in the folder is
    named there (as a word), so a reader who opens the front door finds every room."""
    missing = []
    for init in sorted(PACKAGE.rglob("__init__.py")):
        folder = init.parent
        doc = ast.get_docstring(ast.parse(init.read_text())) or ""
        names = [p.stem for p in folder.glob("*.py") if p.stem not in ("__init__", "__main__")]
        names += [p.name for p in folder.iterdir() if (p / "__init__.py").is_file()]
        missing += [f"{folder.relative_to(PACKAGE.parent)}/{n}" for n in sorted(names)
                    if not re.search(rf"(?<![\w.]){re.escape(n)}(?![\w])", doc)]
    assert not missing, f"modules missing from their package's __init__ docstring: {missing}"


def test_test_modules_have_unique_names():
    """pytest imports test files by basename (no packages under tests/): two test_x.py in different
    folders stop the whole collection with an 'import file mismatch'."""
    names = [p.name for p in (PACKAGE.parent / "tests").rglob("test_*.py")]
    assert len(names) == len(set(names)), sorted({n for n in names if names.count(n) > 1})
