"""The command a stopped run prints to continue (cli.train.resume_command): issue 24, item 6."""

from __future__ import annotations

import argparse
import shlex
from pathlib import Path

from homelab_ft.cli.main import build_parser
from homelab_ft.cli.train import _train_overrides, resume_command


def _args(*argv: str) -> argparse.Namespace:
    return build_parser().parse_args(["train", *argv])


def test_the_recipe_and_its_overrides_with_resume_and_the_run_dir():
    args = _args("recipes/r.yaml", "train.lr=1e-4", "data.system_prompt=Be brief.", "--overwrite", "--cluster",
                 "c.yaml")
    said = resume_command(args, run_dir=Path("runs/x"))
    assert said == ("homelab-ft train recipes/r.yaml train.lr=1e-4 'data.system_prompt=Be brief.' --cluster c.yaml "
                    "--resume --run-dir runs/x")
    assert shlex.split(said)[4] == "data.system_prompt=Be brief."  # quoted for the shell, as typed


def test_a_torchrun_worker_says_the_same_from_the_overrides_it_received():
    # The launching process hands its workers the flags as overrides (cli.train._train_overrides).
    parent = _args("r.yaml", "train.lr=1e-4", "--run-dir", "runs/x", "--resume-or-start", "--overwrite")
    worker = _args("r.yaml", *_train_overrides(parent))
    assert resume_command(worker, run_dir=Path("runs/x")) == resume_command(parent, run_dir=Path("runs/x")) == \
        "homelab-ft train r.yaml train.lr=1e-4 --resume --run-dir runs/x"


def test_a_job_of_several_nodes_continues_through_launch():
    worker = _args("r.yaml", "train.lr=1e-4", "output.dir=runs/x")
    assert resume_command(worker, run_dir=Path("runs/x"), nodes=2) == \
        "homelab-ft launch --hosts HOSTFILE r.yaml train.lr=1e-4 train.resume=true --run-dir runs/x"
