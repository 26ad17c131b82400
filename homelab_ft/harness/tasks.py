"""The lm-eval tasks homelab-ft ships: the demos' held-out rows, read from the package (no download).

Each is an lm-eval task config (the dict a task YAML holds) over a JSONL file of the package, so a
fresh machine with no network evaluates a fine-tune at once: `homelab_demo_sums` (the GRPO demo's 48
held-out sums: the last number of the reply, as numeric_answer reads it, against the answer) and `homelab_demo_json` (the SFT
demo's 48 held-out records: the reply's JSON against the record, exact after whitespace). Any other
name is lm-eval's own task, whose data must already be in the local datasets cache: the harness runs
with the Hugging Face libraries offline and turns the download it would need into one line.
"""

from __future__ import annotations

import importlib.resources
from pathlib import Path

NUMBER = r"(-?\d+)"


def _asset(name: str) -> str:
    return str(Path(str(importlib.resources.files("homelab_ft") / "assets" / "demo" / name)))


def shipped() -> dict[str, dict]:
    """The shipped tasks by name, as lm-eval task configs (generation, greedy, exact match)."""
    common = {"output_type": "generate_until", "test_split": "test", "dataset_path": "json",
              "metric_list": [{"metric": "exact_match", "aggregation": "mean", "higher_is_better": True,
                               "ignore_case": True, "ignore_punctuation": False}]}
    return {
        "homelab_demo_sums": {
            **common, "task": "homelab_demo_sums",
            "dataset_kwargs": {"data_files": {"test": _asset("sums-eval.jsonl")}},
            "doc_to_text": "{{prompt[0].content}}", "doc_to_target": "{{answer}}",
            "generation_kwargs": {"until": ["\n\n"], "max_gen_toks": 24, "do_sample": False},
            "filter_list": [{"name": "last_number", "filter": [{"function": "regex", "regex_pattern": NUMBER, "group_select": -1},
                                                                {"function": "take_first"}]}],
        },
        "homelab_demo_json": {
            **common, "task": "homelab_demo_json",
            "dataset_kwargs": {"data_files": {"test": _asset("eval.jsonl")}},
            "doc_to_text": "{{messages[0].content}}", "doc_to_target": "{{messages[1].content}}",
            "generation_kwargs": {"until": ["\n\n"], "max_gen_toks": 64, "do_sample": False},
            "filter_list": [{"name": "stripped", "filter": [{"function": "regex", "regex_pattern": r"(\{.*\})"},
                                                            {"function": "take_first"}]}],
        },
    }


def resolve(names: list[str]) -> list[str | dict]:
    """What simple_evaluate takes for each name: a shipped task's config, or lm-eval's task name."""
    ours = shipped()
    return [ours.get(name, name) for name in names]
