"""Flags every command shares: -q/-v after any subcommand's arguments, -q without progress bars,
a closed pipe ending quietly, and `data inspect` refusing a model folder as `train` does."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import build_recipe
import procs
import pytest

from homelab_ft import logs
from homelab_ft.cli.main import EXIT_BROKEN_PIPE, build_parser, main, parse_args, subcommands

REPO = Path(__file__).resolve().parents[3]


def argv_for(path: tuple[str, ...], command) -> list[str]:
    """The shortest argument list `command` accepts: its required positionals and options."""
    argv = list(path)
    for action in command._actions:
        if action.option_strings and not action.required:
            continue
        if not action.option_strings and action.nargs in ("?", "*") or action.dest == "help":
            continue
        value = str(action.choices[0]) if action.choices else "1"
        argv += [action.option_strings[0], value] if action.option_strings else [value]
    return argv


def leaf_commands():
    return [(path, command) for path, command in subcommands(build_parser())
            if not any(a.__class__.__name__ == "_SubParsersAction" for a in command._actions)]


def test_the_walk_reaches_nested_subcommands():
    names = {" ".join(path) for path, _ in leaf_commands()}
    assert {"plan", "train", "data inspect", "export", "generate", "doctor"} <= names


@pytest.mark.parametrize("path,command", leaf_commands(), ids=lambda x: " ".join(x) if isinstance(x, tuple) else "")
def test_every_subcommand_takes_quiet_and_verbose_after_its_arguments(path, command):
    argv = argv_for(path, command)
    assert parse_args([*argv, "-q"]).quiet == 1
    assert parse_args([*argv, "-v", "-v"]).verbose == 2
    args = parse_args(["-q", *argv])  # before the command still counts
    assert (args.quiet, args.verbose) == (1, 0)


def test_quiet_hides_the_libraries_progress_bars(monkeypatch):
    import datasets
    import huggingface_hub.utils
    import transformers.utils.logging

    for var in logs.LIBRARY_BARS_ENV:
        monkeypatch.delenv(var, raising=False)
    try:
        logs.configure(logs.QUIET)
        assert datasets.is_progress_bar_enabled() is False
        assert huggingface_hub.utils.are_progress_bars_disabled()
        assert not transformers.utils.logging.is_progress_bar_enabled()
        assert all(os.environ[var] == "1" for var in logs.LIBRARY_BARS_ENV)  # for libraries imported later
    finally:
        logs.configure(logs.NORMAL)
    assert datasets.is_progress_bar_enabled() and transformers.utils.logging.is_progress_bar_enabled()
    assert not any(var in os.environ for var in logs.LIBRARY_BARS_ENV)


def inspect_recipe(tmp_path: Path, model: Path) -> Path:
    data = tmp_path / "d.jsonl"
    data.write_text(json.dumps({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yes"}]}) + "\n")
    return build_recipe.write_recipe(tmp_path / "r.yaml", build_recipe.tiny_run(
        model, method="auto", rows=data, lora=None, data={"cache_dir": str(tmp_path / "cache")}, train=None, output=None))


def test_data_inspect_quiet_in_a_fresh_process_draws_no_bars(tmp_path, tiny_model_dir):
    """The tokenising bars of `datasets` come from a library imported after the flags are read."""
    recipe = inspect_recipe(tmp_path, tiny_model_dir)
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    for var in logs.LIBRARY_BARS_ENV:
        env.pop(var, None)
    proc = subprocess.run([sys.executable, "-m", "homelab_ft", "data", "inspect", str(recipe), "--no-color", "-q"],
                          capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "tokenised now" in proc.stdout
    assert "tokenising" not in proc.stderr and "%|" not in proc.stderr, proc.stderr


def test_closed_pipe_ends_quietly():
    """`homelab-ft plan r.yaml | head -1`: the reader is gone before the plan is printed. (The shape
    derived here first: the fresh process then plans from the cache, without torch's import.)"""
    procs.plan_here(str(REPO / "recipes" / "llama-1b-full-2x24gb.yaml"))
    read_end, write_end = os.pipe()
    os.close(read_end)
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.run([sys.executable, "-m", "homelab_ft", "plan", str(REPO / "recipes" / "llama-1b-full-2x24gb.yaml")],
                          stdout=write_end, stderr=subprocess.PIPE, text=True, env=env, timeout=120)
    os.close(write_end)
    assert proc.stderr == ""
    assert proc.returncode == EXIT_BROKEN_PIPE


def test_data_inspect_refuses_a_config_only_folder_as_train_does(capsys, tmp_path, tiny_model_dir):
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text((tiny_model_dir / "config.json").read_text())
    recipe = inspect_recipe(tmp_path, model)
    messages = []
    for argv in (["data", "inspect", str(recipe)], ["train", str(recipe), "--run-dir", str(tmp_path / "run")]):
        assert main(argv) == 2
        messages.append(capsys.readouterr().err.strip())
    assert messages[0] == messages[1]
    assert "has config.json but no weights" in messages[0] and len(messages[0].splitlines()) == 1


def test_a_log_line_to_a_closed_pipe_stops_the_command_without_a_logging_traceback(monkeypatch, capsys):
    """Information is logged to stdout: a closed pipe there reaches the CLI's quiet exit, not
    logging's "--- Logging error ---" traceback on stderr (and the command does not run on)."""
    import logging

    class ClosedPipe:
        def write(self, text):
            raise BrokenPipeError(32, "Broken pipe")

        def flush(self):
            pass

    logs.configure(logs.NORMAL)
    monkeypatch.setattr(sys, "stdout", ClosedPipe())
    with pytest.raises(BrokenPipeError):
        logging.getLogger("homelab_ft.cli.test").info("a line for a reader that is gone")
    monkeypatch.undo()
    assert "Logging error" not in capsys.readouterr().err
