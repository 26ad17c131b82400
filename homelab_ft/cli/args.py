"""Arguments several subcommands share: recipe overrides, the `--cluster` file, -q/-v."""

from __future__ import annotations

import argparse
from pathlib import Path


def add_verbosity(p: argparse.ArgumentParser, *, default=0) -> None:
    p.add_argument("-q", "--quiet", action="count", default=default, help="only warnings and errors, no progress bars")
    p.add_argument("-v", "--verbose", action="count", default=default, help="more detail (debug messages)")


def verbosity_flags(args) -> list[str]:
    """This process's -q/-v, for the processes it starts (torchrun's workers, other nodes)."""
    return ["--quiet"] * args.quiet + ["--verbose"] * args.verbose


def overrides(p: argparse.ArgumentParser) -> None:
    p.add_argument("overrides", nargs="*", metavar="section.key=value", help="recipe overrides, e.g. train.lr=1e-4")


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
