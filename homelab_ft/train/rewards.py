"""GRPO's reward functions: plain Python, named in the recipe, resolved once and checked on every call.

A reward function has TRL's signature, so one written for TRL's `GRPOTrainer` runs here unchanged:

    def f(prompts, completions, completion_ids, **columns) -> list[float | None]

one value per completion; `columns` are the data set's other columns, one value per completion
(the row's value repeated for each of its generations). `None` means "no reward for this row": the
weighted sum leaves it out (TRL sums with nansum), and a row no function scores has no advantage.

`grpo.reward_funcs` names each function as one of:

    exact_answer                   a built-in (reward_builtins.BUILTINS)
    regex_match: {pattern: ...}    a built-in that takes parameters (reward_builtins.FACTORIES)
    rewards.py:my_reward           a function in a .py file beside the recipe (or an absolute path)
    my_package.rewards:my_reward   a function of an importable module

`resolve_rewards` turns them into `Reward`s before anything is created (preflight), so a name that
does not import stops the run in one line; a file is executed once however many entries name it.
`score` calls them and refuses, in one line naming the function and the row, a function that
raises, returns the wrong number of rewards, or returns something neither a finite number nor None.
"""

from __future__ import annotations

import difflib
import hashlib
import importlib
import importlib.util
import math
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

from homelab_ft.errors import UserError
from homelab_ft.train import reward_builtins

RewardFunc = Callable[..., Sequence]


@dataclass(frozen=True)
class Reward:
    """One resolved entry of `grpo.reward_funcs`, with its weight."""

    name: str
    """As the recipe spells it (`rewards.py:exact_answer`): what every message about it says."""
    func: RewardFunc
    weight: float = 1.0
    label: str = ""
    """Its name in metrics (`rewards/<label>/mean`): the function's own name, as TRL logs it, made
    unique within the run (`exact_answer`, `exact_answer_2`); `resolve_rewards` sets it."""


def resolve_rewards(entries: Sequence[str | Mapping], *, weights: Sequence[float] | None,
                    recipe_dir: Path, key: str = "grpo.reward_funcs") -> list[Reward]:
    """Every entry of `grpo.reward_funcs` as a `Reward`; `weights` None weighs each 1.0 (TRL's default).
    The recipe checked the counts (objective_checks.check_grpo) and that every weight is finite."""
    weights = [1.0] * len(entries) if weights is None else weights
    if len(weights) != len(entries):
        raise ValueError(f"{len(weights)} weights for {len(entries)} reward functions")
    out, seen = [], {}
    for i, (entry, weight) in enumerate(zip(entries, weights, strict=True)):
        func = resolve(entry, recipe_dir=recipe_dir, where=f"{key}[{i}]")
        label = str(getattr(func, "__name__", None) or type(func).__name__)
        seen[label] = seen.get(label, 0) + 1
        out.append(Reward(name=_spelling(entry), func=func, weight=float(weight),
                          label=label if seen[label] == 1 else f"{label}_{seen[label]}"))
    return out


def resolve(entry: str | Mapping, *, recipe_dir: Path, where: str = "grpo.reward_funcs") -> RewardFunc:
    """The function an entry names (see the module docstring); a `UserError` naming `where` if none."""
    where = f"{where} {_spelling(entry)!r}"
    if isinstance(entry, Mapping):
        return _built(entry, where=where)
    if not isinstance(entry, str) or not entry.strip():
        raise UserError(f"{where}: a built-in name, file.py:function or module:function")
    if ":" not in entry:
        return _builtin(entry, where=where)
    source, _, name = entry.rpartition(":")
    if source.endswith(".py"):
        module = _load_file(Path(source) if Path(source).is_absolute() else recipe_dir / source, where=where)
    else:
        try:
            module = importlib.import_module(source)
        except Exception as e:  # noqa: BLE001 (any failure of the user's module is one line)
            raise UserError(f"{where}: cannot import {source}: {_one_line(e)}") from e
    func = getattr(module, name, None)
    if func is None:
        found = [n for n, v in vars(module).items() if callable(v) and not n.startswith("_")]
        near = difflib.get_close_matches(name, found, n=1)
        raise UserError(f"{where}: {source} has no function {name}" + (f"; did you mean {near[0]}?" if near else ""))
    if not callable(func):
        raise UserError(f"{where}: {name} in {source} is a {type(func).__name__}, not a function")
    return func


def _spelling(entry) -> str:
    if isinstance(entry, Mapping):
        return ", ".join(f"{k}: {v}" for k, v in entry.items())
    return str(entry)


def _builtin(name: str, *, where: str) -> RewardFunc:
    if name in reward_builtins.BUILTINS:
        needed = reward_builtins.NEEDS.get(name)
        if needed and importlib.util.find_spec(needed) is None:
            raise UserError(f"{where}: {name} needs the {needed.replace('_', '-')} package, which is not installed; "
                            f"pip install {needed.replace('_', '-')} (make install does)")
        return reward_builtins.BUILTINS[name]
    if name in reward_builtins.FACTORIES:
        raise UserError(f"{where}: {name} takes parameters; write it as `{name}: {{...}}` "
                        f"({reward_builtins.FACTORIES[name].__doc__.splitlines()[0]})")
    known = sorted({*reward_builtins.BUILTINS, *reward_builtins.FACTORIES})
    near = difflib.get_close_matches(name, known, n=1)
    raise UserError(f"{where}: no built-in reward {name}" + (f"; did you mean {near[0]}?" if near else "")
                    + f" (built-ins: {', '.join(known)}; or name a function as file.py:function or module:function)")


def _built(entry: Mapping, *, where: str) -> RewardFunc:
    if len(entry) != 1:
        raise UserError(f"{where}: one built-in per entry, as `regex_match: {{pattern: ...}}`")
    ((name, params),) = entry.items()
    factory = reward_builtins.FACTORIES.get(name)
    if factory is None:
        if name in reward_builtins.BUILTINS:
            raise UserError(f"{where}: {name} takes no parameters; write it as a plain name")
        return _builtin(str(name), where=where)
    if not isinstance(params, Mapping):
        raise UserError(f"{where}: the parameters of {name} are a mapping, as `{name}: {{...}}`")
    try:
        return factory(**params)
    except TypeError as e:  # a parameter it does not take, or one missing: say which it takes
        raise UserError(f"{where}: {_one_line(e)}; it is {factory.__doc__.splitlines()[0]}") from e
    except ValueError as e:
        raise UserError(f"{where}: {_one_line(e)}") from e


_LOADED: dict[Path, ModuleType] = {}
"""Reward files already executed, by resolved path: two entries in one file, or a second resolve (the
trainer after preflight), reuse the module instead of running its top level again."""


def _load_file(path: Path, *, where: str) -> ModuleType:
    path = path.resolve()
    if path in _LOADED:
        return _LOADED[path]
    if not path.is_file():
        raise UserError(f"{where}: {path} does not exist (a .py file is read beside the recipe)")
    # A name of its own per file, registered in sys.modules while it runs (dataclasses and pickling
    # look a module up there), so two rewards.py of two recipes never collide.
    name = f"homelab_ft_rewards_{hashlib.sha1(str(path).encode()).hexdigest()[:12]}_{path.stem}"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except Exception as e:  # noqa: BLE001 (any failure of the user's file is one line)
        del sys.modules[name]
        raise UserError(f"{where}: importing {path} raised {_one_line(e)}") from e
    _LOADED[path] = module
    return module


def score(rewards: Sequence[Reward], *, prompts: Sequence, completions: Sequence,
          completion_ids: Sequence[Sequence[int]], columns: Mapping[str, Sequence]) -> list[list[float | None]]:
    """Each completion's reward from each function ([row][function]; None where a function gave none),
    every value checked."""
    count = len(completions)
    table: list[list[float | None]] = [[] for _ in range(count)]
    for reward in rewards:
        values = _call(reward, prompts=prompts, completions=completions, completion_ids=completion_ids, columns=columns)
        for row, value in enumerate(values):
            table[row].append(_checked(reward, value, row=row, prompts=prompts))
    return table


def _call(reward: Reward, *, prompts, completions, completion_ids, columns) -> Sequence:
    try:
        values = reward.func(prompts=prompts, completions=completions, completion_ids=completion_ids, **columns)
    except Exception as e:  # noqa: BLE001 (the user's function: named with the row that fails it)
        row = _failing_row(reward, prompts=prompts, completions=completions, completion_ids=completion_ids,
                           columns=columns)
        at = f"on row {row} ({_excerpt(prompts[row])})" if row is not None else f"on a batch of {len(completions)}"
        raise UserError(f"reward {reward.name} raised {_one_line(e)} {at}") from e
    if isinstance(values, (str, bytes, Mapping)) or not hasattr(values, "__len__"):
        raise UserError(f"reward {reward.name} returned a {type(values).__name__}, not a list of one reward "
                        "per completion")
    if len(values) != len(completions):
        raise UserError(f"reward {reward.name} returned {len(values)} rewards for {len(completions)} completions; "
                        "return one per completion (None for a row it does not score)")
    return list(values)


def _failing_row(reward: Reward, *, prompts, completions, completion_ids, columns) -> int | None:
    """The first row that makes the function raise on its own (asked only once it has failed)."""
    for row in range(len(completions)):
        try:
            reward.func(prompts=prompts[row:row + 1], completions=completions[row:row + 1],
                        completion_ids=completion_ids[row:row + 1], **{k: v[row:row + 1] for k, v in columns.items()})
        except Exception:  # noqa: BLE001
            return row
    return None


def _checked(reward: Reward, value, *, row: int, prompts) -> float | None:
    if value is None:
        return None
    try:  # a bool is 1.0 or 0.0, a numpy or 0-d torch number its value, as torch.tensor(values) in TRL
        if isinstance(value, (str, bytes)):
            raise TypeError
        value = float(value)
    except (TypeError, ValueError, RuntimeError):
        raise UserError(f"reward {reward.name} returned {value!r} ({type(value).__name__}) on row {row} "
                        f"({_excerpt(prompts[row])}); a number, or None for no reward") from None
    if not math.isfinite(value):
        raise UserError(f"reward {reward.name} returned {value} on row {row} ({_excerpt(prompts[row])}); "
                        "a finite number, or None for a row it cannot score")
    return value


def weighted_sum(table: Sequence[Sequence[float | None]], rewards: Sequence[Reward]) -> list[float | None]:
    """Each row's reward: the weighted sum of its functions' values, None ones left out (TRL's nansum);
    None where no function scored the row (grpo_loss.advantages then gives it no advantage)."""
    out = []
    for values in table:
        scored = [r.weight * v for r, v in zip(rewards, values, strict=True) if v is not None]
        out.append(math.fsum(scored) if scored else None)
    return out


def _excerpt(prompt, limit: int = 40) -> str:
    text = " ".join(reward_builtins.text_of(prompt).split())
    return "prompt " + repr(text if len(text) <= limit else text[:limit] + "...")


def _one_line(e: BaseException) -> str:
    message = str(e).strip().splitlines()
    return f"{type(e).__name__}: {message[0]}" if message else type(e).__name__
