"""Arguments several subcommands share: recipe overrides, the `--cluster` file, -q/-v, the decoding
flags of `generate` and `chat`; and the parser that reports a bad argument in one line."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


class Parser(argparse.ArgumentParser):
    """argparse's parser, its errors one line (`homelab-ft generate: error: ...; see -h`), exit 2:
    the project's rule for bad input. argparse prints the whole usage first, which buries the line
    that says what to fix. Subcommands' parsers are made of the same class (add_subparsers)."""

    def error(self, message: str):
        print(f"{self.prog}: error: {message} (see {self.prog} -h)", file=sys.stderr)
        raise SystemExit(2)


def add_verbosity(p: argparse.ArgumentParser, *, default=0) -> None:
    p.add_argument("-q", "--quiet", action="count", default=default, help="only warnings and errors, no progress bars")
    p.add_argument("-v", "--verbose", action="count", default=default, help="more detail (debug messages)")


def verbosity_flags(args) -> list[str]:
    """This process's -q/-v, for the processes it starts (torchrun's workers, other nodes)."""
    return ["--quiet"] * args.quiet + ["--verbose"] * args.verbose


def overrides(p: argparse.ArgumentParser) -> None:
    p.add_argument("overrides", nargs="*", default=[], metavar="section.key=value", help="recipe overrides, e.g. train.lr=1e-4")


def run_dir(p: argparse.ArgumentParser) -> None:
    p.add_argument("--run-dir", help="run directory (default: runs/<recipe name>; the same as output.dir=DIR)")


def with_run_dir(args, overrides: list[str]) -> list[str]:
    """The overrides with `--run-dir` as the `output.dir` it stands for (last: the flag wins)."""
    return [*overrides, f"output.dir={args.run_dir}"] if args.run_dir else overrides


def cluster_file(p: argparse.ArgumentParser) -> None:
    p.add_argument("--cluster", type=Path, metavar="FILE",
                   help="cluster file written by `homelab-ft doctor`: its measured values replace the recipe's "
                        "cluster section (flags such as --gpus/--link still win)")


def with_cluster_file(args, overrides: list[str]) -> list[str]:
    """The recipe's overrides, then the --cluster file's values (which a flag after them may replace)."""
    if args.cluster is None:
        return overrides
    from homelab_ft.cluster import clusterfile

    return [*overrides, *clusterfile.overrides(args.cluster)]


def cluster_file_name(args) -> str | None:
    """The `--cluster` file's name, as the plan names where its cluster came from."""
    return args.cluster.name if args.cluster else None


def positive_int(*, below_one: str = "is below 1; give a whole number >= 1"):
    """An argparse type: a whole number >= 1; `below_one` says what a smaller one would mean."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a whole number; give one >= 1") from None
        if value < 1:
            raise argparse.ArgumentTypeError(f"{value} {below_one}")
        return value

    return parse


def _float_in(low: float, high: float, *, low_open: bool, what: str):
    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a number; {what}") from None
        if not (low < value if low_open else low <= value) or not value <= high:
            raise argparse.ArgumentTypeError(f"{value:g} is out of range; {what}")
        return value

    return parse


def _prompt(text: str) -> str:
    if not text.strip():
        raise argparse.ArgumentTypeError("the prompt is empty; give the text of the user's turn")
    return text


def sampling(p: argparse.ArgumentParser, *, prompt_required: bool) -> None:
    """The flags `generate` and `chat` share, checked as they are parsed, before any model loads."""
    conversation = "one reply to this prompt, then exit (default: a conversation on stdin, one line per turn; /exit or EOF ends it)"
    p.add_argument("--prompt", required=prompt_required, type=_prompt, help=None if prompt_required else conversation)
    p.add_argument("--system", help="system prompt" + ("" if prompt_required else " (default: the run's data.system_prompt)"))
    p.add_argument("--max-new-tokens", type=positive_int(below_one="generates nothing; give a number of tokens >= 1"), default=128, metavar="N", help="at most N tokens (>= 1)")
    p.add_argument("--temperature", type=_float_in(0.0, 100.0, low_open=False, what="give 0 (greedy) to 100"),
                   default=0.0, help="0: greedy (the default); > 0 samples")
    p.add_argument("--top-p", type=_float_in(0.0, 1.0, low_open=True, what="give a probability in (0, 1]"),
                   default=1.0, help="nucleus sampling when --temperature > 0: the smallest set of tokens "
                                      "holding this probability (default 1: all)")
    p.add_argument("--chat-template", type=Path, metavar="FILE",
                   help="a Jinja chat template to render the turns with (default: the model's own)")
    p.add_argument("--raw", action="store_true",
                   help="no chat template: the prompt is continued as plain text (a base model without one)")
    p.add_argument("--image", type=Path, action="append", default=[], metavar="PATH",
                   help="an image for the first user turn of an image-text model (repeat for several)")
