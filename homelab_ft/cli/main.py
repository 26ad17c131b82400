"""`homelab-ft`: the parser, the entry point and its error handling; each subcommand lives in a
module beside this one (plan.py, train.py, cluster.py, export.py). Thin: parse, call one function, print.

A `UserError` anywhere below becomes one line on stderr and exit code 2, and so does a file-system
error a user can fix (fsio.describe: a full disk, a read-only or missing path); anything else is
our bug and keeps its traceback. A reader that goes away (`homelab-ft plan r.yaml | head -1`) ends the
command quietly with 141, the status `head`'s writer gets from SIGPIPE in a shell.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import warnings

from homelab_ft import fsio
from homelab_ft.cli.args import Parser, add_verbosity
from homelab_ft.errors import UserError
from homelab_ft.torch_support import check_torch

EXIT_BROKEN_PIPE = 128 + 13
"""128 + SIGPIPE: what a shell reports for `yes | head -1`'s writer, so `set -o pipefail` scripts see the same."""


def main(argv: list[str] | None = None) -> int:
    _offline_and_quiet_libraries()
    code = _run(argv)
    from homelab_ft.cluster.handoff import under_torchrun

    if under_torchrun():
        # FSDP2 processes on CPU can abort at interpreter exit after the process group is
        # destroyed (see comm.teardown); leave with the real exit code instead.
        from homelab_ft.distributed.comm import exit_now

        exit_now(code)
    return code


def _offline_and_quiet_libraries() -> None:
    """homelab-ft never downloads: the Hugging Face libraries are told so before they load.

    Three messages every run would print are silenced: bitsandbytes' note that an optional CPU
    kernel package is missing (it serves the AVX512-BF16 path that quant.after_load turns off);
    the `kernels` package's note, from that same bitsandbytes import once transformers >= 5.25
    installs `kernels`, that offline it skips a Hub publisher check (for a kernel it then does not
    find, so bitsandbytes keeps its own); and a FutureWarning that peft 0.21 triggers by calling a
    renamed transformers 5 method. Either note would put a second line before a one-line error.
    """
    for var in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_DATASETS_OFFLINE"):
        os.environ.setdefault(var, "1")
    logging.getLogger("bitsandbytes.backends.cpu.ops").setLevel(logging.ERROR)
    logging.getLogger("kernels").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """The parsed command line; overrides may come after options (`train r.yaml --resume
    train.lr=1e-4`), which argparse's positional handling alone does not allow."""
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    stray = [a for a in extra if "=" not in a or a.startswith("-")]
    if stray or (extra and not hasattr(args, "overrides")):
        parser.error(f"unrecognized arguments: {' '.join(stray or extra)}")
    if extra:
        args.overrides = list(args.overrides) + extra
    return args


def _run(argv: list[str] | None) -> int:
    args = parse_args(argv)
    from homelab_ft import logs

    logs.configure(args.verbose - args.quiet)
    try:
        check_torch()
        code = args.func(args) or 0
        sys.stdout.flush()  # a closed pipe shows here, inside the try, not at interpreter exit
        return code
    except BrokenPipeError:
        # The reader is gone: point stdout at /dev/null so the interpreter's own final flush
        # does not raise again (the recipe in Python's signal module documentation).
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return EXIT_BROKEN_PIPE
    except UserError as err:
        if str(err):  # empty on the ranks that leave the telling to rank 0
            print(f"homelab-ft: {err.label}: {err}", file=sys.stderr)
        return err.exit_code
    except KeyboardInterrupt:
        print("homelab-ft: interrupted", file=sys.stderr)
        return 130
    except OSError as err:  # a full disk, a read-only target, a file where a folder should be ...
        line = fsio.describe(err)
        if line is None:
            raise
        logging.getLogger(__name__).debug("file-system error", exc_info=True)
        print(f"homelab-ft: error: {line}", file=sys.stderr)
        return UserError.exit_code
    except UnicodeDecodeError as err:  # a reader that does not name its file (fsio.read_text does)
        logging.getLogger(__name__).debug("undecodable file", exc_info=True)
        print(f"homelab-ft: error: a file is not UTF-8 text ({err}); save it as UTF-8 (-v names the reader)",
              file=sys.stderr)
        return UserError.exit_code


def build_parser() -> argparse.ArgumentParser:
    from homelab_ft.cli import chat, cluster, evaluate, export, plan, report, train

    parser = Parser(prog="homelab-ft", description="Fine-tune open-weight LLMs on your own hardware.")
    add_verbosity(parser)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for add in (plan.add_plan, train.add_train, export.add_export, export.add_generate, train.add_demo,
                plan.add_recipes, plan.add_data, cluster.add_launch, cluster.add_doctor, chat.add_chat,
                evaluate.add_eval, report.add_report):
        add(sub)
    # Every subcommand, nested ones too (`data inspect`), takes -q/-v after its own arguments
    # (`homelab-ft data inspect r.yaml -q`); SUPPRESS keeps a -q given before the command.
    for _, command in subcommands(parser):
        if "--quiet" not in command._option_string_actions:
            add_verbosity(command, default=argparse.SUPPRESS)
    return parser


def subcommands(parser: argparse.ArgumentParser, path: tuple[str, ...] = ()):
    """(name path, parser) of every subcommand below `parser`, depth first: ("data",), ("data", "inspect")."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, command in action.choices.items():
                yield (*path, name), command
                yield from subcommands(command, (*path, name))
