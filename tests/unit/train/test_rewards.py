"""rewards.py and reward_builtins.py: recipe entries resolved (built-ins, a file beside the recipe,
an import path), loaded once, every mistake one line naming the entry; calls checked, naming the
function and the row; None rows left out of the weighted sum; the built-ins' answers."""

from __future__ import annotations

import math

import pytest

from homelab_ft.errors import UserError
from homelab_ft.train import reward_builtins as rb
from homelab_ft.train import rewards
from homelab_ft.train.rewards import Reward

PROMPTS = ["What is 2+2?", "Half of one?", "Capital of France?", "Say hi"]
COMPLETIONS = ["The answer is 4.", "\\boxed{\\frac{1}{2}}", "answer: Paris", "hello"]
IDS = [[1, 2, 3], [4], [5, 6], [7, 8, 9, 10]]


def _error(fn, *args, **kwargs) -> str:
    with pytest.raises(UserError) as caught:
        fn(*args, **kwargs)
    message = str(caught.value)
    assert "\n" not in message, message
    return message


def _score(funcs, **columns):
    table = rewards.score([Reward(name=getattr(f, "__name__", "f"), func=f) for f in funcs], prompts=PROMPTS,
                          completions=COMPLETIONS, completion_ids=IDS, columns=columns)
    return [row[0] for row in table] if len(funcs) == 1 else table


# Resolving ----------------------------------------------------------------------------------------------

def test_builtins_and_parameterised_builtins_resolve(tmp_path):
    got = rewards.resolve_rewards(["exact_answer", {"regex_match": {"pattern": "^hel"}}], weights=None,
                                  recipe_dir=tmp_path)
    assert [r.name for r in got] == ["exact_answer", "regex_match: {'pattern': '^hel'}"]
    assert got[0].func is rb.exact_answer and [r.weight for r in got] == [1.0, 1.0]
    assert got[1].func(PROMPTS, COMPLETIONS, IDS) == [0.0, 0.0, 0.0, 1.0]
    assert rewards.resolve("homelab_ft.train.reward_builtins:numeric_answer", recipe_dir=tmp_path) is rb.numeric_answer


def test_a_file_beside_the_recipe_is_loaded_once(tmp_path):
    (tmp_path / "rewards.py").write_text(
        "import dataclasses, pathlib\n"
        "with open(pathlib.Path(__file__).with_name('loads.txt'), 'a') as f:\n    f.write('x')\n"
        "@dataclasses.dataclass\nclass Box:\n    x: int = 0\n"  # dataclasses look the module up in sys.modules
        "def short(prompts, completions, completion_ids, **kw):\n    return [-len(c) for c in completions]\n"
        "def count(prompts, completions, completion_ids, **kw):\n    return [1] * len(completions)\n")
    got = rewards.resolve_rewards(["rewards.py:short", "rewards.py:count"], weights=[0.5, 2.0], recipe_dir=tmp_path)
    again = rewards.resolve(str(tmp_path / "rewards.py") + ":count", recipe_dir=tmp_path / "elsewhere")
    table = rewards.score(got, prompts=PROMPTS, completions=COMPLETIONS, completion_ids=IDS, columns={})
    assert table[0] == [-16.0, 1.0] and again(PROMPTS, COMPLETIONS, IDS) == [1, 1, 1, 1]
    assert rewards.weighted_sum(table, got)[0] == -16 * 0.5 + 2.0
    assert (tmp_path / "loads.txt").read_text() == "x"  # three entries, one execution of the file


@pytest.mark.parametrize("entry,files,message", [
    ("exakt_answer", {}, "no built-in reward exakt_answer; did you mean exact_answer?"),
    ("regex_match", {}, "regex_match takes parameters; write it as `regex_match: {...}`"),
    ({"regex_match": {"patern": "x"}}, {}, "unexpected keyword argument 'patern'"),
    ({"regex_match": {"pattern": "(["}}, {}, "pattern '([' is not a regular expression"),
    ({"exact_answer": {}}, {}, "exact_answer takes no parameters"),
    ({"json_object": {"required_keys": "name"}}, {}, "required_keys is a list of key names"),
    ("missing.py:f", {}, "missing.py does not exist"),
    ("rewards.py:exact_anwser", {"rewards.py": "def exact_answer(**kw): pass\n"},
     "rewards.py has no function exact_anwser; did you mean exact_answer?"),
    ("rewards.py:LIMIT", {"rewards.py": "LIMIT = 3\n"}, "LIMIT in rewards.py is a int, not a function"),
    ("broken.py:f", {"broken.py": "import no_such_module_here\n"},
     "raised ModuleNotFoundError: No module named 'no_such_module_here'"),
    ("no_such_pkg.rewards:f", {}, "cannot import no_such_pkg.rewards: ModuleNotFoundError"),
    ("", {}, "a built-in name, file.py:function or module:function"),
])
def test_an_entry_that_does_not_resolve_is_one_line(tmp_path, entry, files, message):
    for name, text in files.items():
        (tmp_path / name).write_text(text)
    got = _error(rewards.resolve_rewards, ["exact_answer", entry], weights=None, recipe_dir=tmp_path)
    assert got.startswith("grpo.reward_funcs[1] ") and message in got, got


def test_weights_are_one_per_function(tmp_path):
    with pytest.raises(ValueError, match="2 weights for 1 reward functions"):  # the recipe refuses it first
        rewards.resolve_rewards(["exact_answer"], weights=[1, 2], recipe_dir=tmp_path)


# Calling ------------------------------------------------------------------------------------------------

def test_rows_without_a_reward_are_left_out_of_the_weighted_sum():
    funcs = [Reward(name="a", func=lambda completions, **kw: [1.0, None, True, None], weight=2.0),
             Reward(name="b", func=lambda completions, **kw: [0.5, 0.25, None, None], weight=-1.0)]
    table = rewards.score(funcs, prompts=PROMPTS, completions=COMPLETIONS, completion_ids=IDS, columns={})
    assert table == [[1.0, 0.5], [None, 0.25], [1.0, None], [None, None]]
    assert rewards.weighted_sum(table, funcs) == [1.5, -0.25, 2.0, None]


def test_columns_reach_the_function():
    seen = {}

    def f(prompts, completions, completion_ids, **columns):
        seen.update(columns)
        return [0.0] * len(completions)

    _score([f], answer=["4", "0.5", "Paris", "hi"])
    assert seen == {"answer": ["4", "0.5", "Paris", "hi"]}


def _raises_on_paris(prompts, completions, completion_ids, **kw):
    return [1 / (c != "answer: Paris") for c in completions]


@pytest.mark.parametrize("func,message", [
    (_raises_on_paris, "reward _raises_on_paris raised ZeroDivisionError: division by zero on row 2 "
                       "(prompt 'Capital of France?')"),
    (lambda **kw: [1.0] * 3, "reward <lambda> returned 3 rewards for 4 completions"),
    (lambda **kw: 1.0, "reward <lambda> returned a float, not a list"),
    (lambda **kw: [0.0, math.inf, 0.0, 0.0], "reward <lambda> returned inf on row 1 (prompt 'Half of one?')"),
    (lambda **kw: [0.0, 0.0, 0.0, math.nan], "returned nan on row 3 (prompt 'Say hi'); a finite number, or None"),
    (lambda **kw: [0.0, "1", 0.0, 0.0], "returned '1' (str) on row 1"),
    (rb.exact_answer, "reward exact_answer raised ValueError: exact_answer reads the reference from an 'answer' "
                      "(or 'solution') column"),
])
def test_a_bad_call_is_one_line_naming_the_function_and_the_row(func, message):
    got = _error(_score, [func])
    assert message in got, got


# Built-ins ----------------------------------------------------------------------------------------------

def test_exact_answer_reads_the_answer_and_skips_rows_without_a_reference():
    assert _score([rb.exact_answer], answer=["4", "\\frac{1}{2}", "paris", None]) == [1.0, 1.0, 1.0, None]
    assert _score([rb.exact_answer], solution=["5", "1/2", "#### Paris", ""]) == [0.0, 0.0, 1.0, None]


@pytest.mark.parametrize("completion,reference,want", [
    ("so \\boxed{\\frac{1}{2}}", "0.5", 1.0),
    ("The total is 1,000 apples", "#### 1000", 1.0),
    ("The answer is 42.", "42", 1.0),
    ("answer: $12.50", "12.5", 1.0),
    ("answer: 3/4", "0.75", 1.0),
    ("answer: 50%", "50", 1.0),
    ("first 7, then 8", "7", 0.0),
    ("no number here", "7", 0.0),
    ("answer: 41", "42", 0.0),
    ("anything", "not a number", None),
])
def test_numeric_answer(completion, reference, want):
    assert rb.numeric_answer([""], [completion], [[1]], answer=[reference]) == [want]


def test_json_regex_think_and_length_builtins():
    texts = ['{"name": "a", "age": 3}', '```json\n[1, 2]\n```', "{name: a}", '{"name": "b"}']
    assert rb.json_valid(PROMPTS, texts) == [1.0, 1.0, 0.0, 1.0]
    assert rb.json_object(["name", "age"])(PROMPTS, texts) == [1.0, 0.0, 0.0, 0.0]
    assert rb.regex_match(r"\d+", full=True)(PROMPTS, ["12", "a12", "", "7"]) == [1.0, 0.0, 0.0, 1.0]
    think = ["<think>\nwhy\n</think>\nyes", "<think>a</think><think>b</think>", "no think", "<think>open"]
    assert rb.think_format(PROMPTS, think) == [1.0, 0.0, 0.0, 0.0]
    # DAPO eq. 13 with L_max 100, L_cache 20: free up to 80 tokens, -1 past 100
    lengths = [[0] * n for n in (50, 80, 90, 100, 110)]
    assert rb.overlong_penalty(100, 20)(None, None, lengths) == [0.0, 0.0, -0.5, -1.0, -1.0]


def test_conversational_completions_are_read_as_their_last_message():
    conv = [[{"role": "assistant", "content": "answer: 4"}], [{"role": "assistant", "content": "3"}]]
    assert rb.numeric_answer(["", ""], conv, answer=["4", "4"]) == [1.0, 0.0]


@pytest.mark.parametrize(("completion", "solution", "want"), [
    (r"so the answer is $\boxed{\frac{\sqrt{2}}{2}}$", r"$\frac{1}{\sqrt{2}}$", 1.0),  # two spellings, one value
    (r"$\boxed{x^2 + 2x + 1}$", r"$(x+1)^2$", 1.0),
    (r"$\boxed{[0, 1)}$", r"$[0,1)$", 1.0),
    (r"$\boxed{0.5}$", r"$\frac{1}{2}$", 1.0),
    (r"$\boxed{\frac{1}{3}}$", r"$\frac{1}{2}$", 0.0),
    ("the answer is 1/2 I think", r"$\frac{1}{2}$", 0.0),  # no LaTeX anchor in the completion: not guessed
    (r"$\boxed{3}$", "no formula here at all", None),  # a reference math-verify cannot read: no reward
])
def test_math_answer_compares_symbolically_as_trls_accuracy_reward(completion, solution, want):
    (got,) = rb.math_answer(["p"], [completion], solution=[solution])
    assert got == want


def test_math_answer_reads_the_solution_column_and_resolves_by_name(tmp_path, monkeypatch):
    func = rewards.resolve("math_answer", recipe_dir=tmp_path)
    chat = [[{"role": "assistant", "content": r"$\boxed{4}$"}]]
    assert func(["p"], chat, [[1]], answer=["$4$"]) == [1.0]
    assert func(["p"], chat, [[1]], solution=["$5$"], answer=["$4$"]) == [0.0]  # TRL's column first
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "math_verify" else real(name, *a))
    with pytest.raises(UserError, match="math_answer needs the math-verify package.*pip install math-verify"):
        rewards.resolve("math_answer", recipe_dir=tmp_path)
