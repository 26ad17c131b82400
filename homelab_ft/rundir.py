"""The run directory: refuse to mix runs, then create it once every input has been checked."""

from __future__ import annotations

import logging
import shutil
from pathlib import Path

from homelab_ft import checkpoint, distributed
from homelab_ft.config import Recipe, dump_recipe, load_recipe
from homelab_ft.errors import UserError

log = logging.getLogger(__name__)


def check_run_dir(recipe: Recipe) -> Path | None:
    """Refuse to mix runs (without writing anything); returns the checkpoint to resume from.

    `train.resume: true` (--resume) needs a checkpoint to continue from; `auto` (--resume-or-start)
    continues when there is one and starts a new run otherwise."""
    run_dir = recipe.run_dir
    for part in (run_dir, *run_dir.parents):
        if part.exists() and not part.is_dir():
            raise UserError(f"output.dir: {part} is a file, not a directory; choose another --run-dir")
    saved = run_dir / "recipe.yaml"
    if recipe.train.resume:
        if saved.is_file():
            _check_same_model(load_recipe(saved), recipe, saved)
        found = checkpoint.latest(run_dir)
        if found is None and recipe.train.resume is True:
            what = "does not exist" if not run_dir.exists() else "holds no complete checkpoint"
            raise UserError(f"--resume: {run_dir} {what}, so there is nothing to resume; drop --resume to start "
                            "a new run, or pass --resume-or-start to continue when a checkpoint exists")
        return found
    if run_dir.exists() and any(run_dir.iterdir()) and not recipe.output.overwrite:
        raise UserError(
            f"output directory {run_dir} already holds a run; resume it with --resume, replace it with "
            "--overwrite, or choose another with --run-dir"
        )
    return None


def init_run_dir(recipe: Recipe, *, env, resume_from: Path | None) -> None:
    """Create (or, with overwrite, replace) the run directory once every input has been checked.

    Every rank has run the same checks; the main rank writes between two barriers, so no rank
    sees a half-made directory.
    """
    run_dir = recipe.run_dir
    distributed.barrier(env)
    if env.is_main:
        if recipe.output.overwrite and not recipe.train.resume and run_dir.exists():
            shutil.rmtree(run_dir)
        run_dir.mkdir(parents=True, exist_ok=True)
        dump_recipe(recipe, run_dir / "recipe.yaml")
        if recipe.train.resume and resume_from is None:
            log.info("no complete checkpoint in %s; starting a new run from step 0", run_dir)
    distributed.barrier(env)


def _check_same_model(old: Recipe, new: Recipe, saved: Path) -> None:
    if old.objective != new.objective:
        raise UserError(f"{saved} is a run with objective {old.objective}, not {new.objective}; resume needs the "
                        "same objective (to preference-tune an SFT result, export it and train from the export)")
    if (old.model.path, old.method) != (new.model.path, new.method):
        raise UserError(
            f"{saved} is a run of {old.model.path} ({old.method}), not {new.model.path} ({new.method}); "
            "resume needs the same model and method, or use another --run-dir"
        )
