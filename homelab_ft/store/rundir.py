"""The run directory: refuse to mix runs, then create it once every input has been checked."""

from __future__ import annotations

import contextlib
import logging
import shlex
import shutil
from pathlib import Path

from homelab_ft.errors import UserError
from homelab_ft.recipe.config import Recipe, load_recipe
from homelab_ft.store import checkpoint, manifest, runlock, staging
from homelab_ft.store.layout import RunDir

log = logging.getLogger(__name__)

FIXED_ON_RESUME = (
    "train.seed", "train.lr", "train.weight_decay",
    "train.betas", "train.warmup_steps", "train.lr_schedule", "train.min_lr_ratio", "train.max_grad_norm",
    "train.optimizer", "data.packing", "data.max_length", "data.shuffle",
)
"""Recipe fields a resume cannot change: the optimizer and scheduler state restored from the
checkpoint (AdamW's param groups, LambdaLR's base_lrs) and the data position were built from the
saved values, so a new value would be ignored or would silently change which rows come next.
The rows per optimizer step (micro_batch_size x grad_accum_steps x processes) are fixed too, but
not how they are split: a run may resume on another number of processes with the same global batch
(DCP reshards, and the data position is counted in rows). `train.max_steps` and `train.num_epochs`
may change: the remaining steps then follow the schedule of a run of the new length from the
resumed step (train.optim.build_scheduler; docs/recipes.md, "Resuming with another length")."""


def check_run_dir(recipe: Recipe) -> Path | None:
    """Refuse to mix runs (without writing anything); returns the checkpoint to resume from.

    `train.resume: true` (--resume) needs a checkpoint to continue from; `auto` (--resume-or-start)
    continues when there is one and starts a new run otherwise. Collective under a process group
    (the checkpoint's files are hashed by all ranks together)."""
    check_before_launch(recipe)
    if not recipe.train.resume:
        return None
    found = checkpoint.newest_intact(recipe.run_dir)
    if found is None and recipe.train.resume is True:
        run_dir = recipe.run_dir
        what = "does not exist" if not run_dir.exists() else "holds no complete checkpoint"
        raise UserError(f"--resume: {run_dir} {what}, so there is nothing to resume; drop --resume to start "
                        "a new run, or pass --resume-or-start to continue when a checkpoint exists")
    return found


def check_before_launch(recipe: Recipe) -> None:
    """The run-directory refusals that need no process group and read no checkpoint: a file where
    the directory should be, another live writer, another run in the directory, a resume of
    another model or with optimisation overrides."""
    run_dir = recipe.run_dir
    for part in (run_dir, *run_dir.parents):
        if part.exists() and not part.is_dir():
            raise UserError(f"output.dir: {part} is a file, not a directory; choose another --run-dir")
    saved = RunDir(run_dir).recipe_file
    runlock.check_free(run_dir)
    if recipe.train.resume:
        if saved.is_file():
            old = load_recipe(saved)
            _check_same_model(old, recipe, saved)
            check_resume_overrides(old, recipe, saved=saved)
        return
    if run_dir.exists() and any(run_dir.iterdir()) and not recipe.output.overwrite:
        raise UserError(f"output directory {run_dir} already holds a run; {_resume_offer(run_dir, recipe)}choose another "
                        "--run-dir, or pass --overwrite to delete this run and its checkpoints and start anew")


def _resume_offer(run_dir: Path, recipe: Recipe) -> str:
    """`resume it with --resume, ` when there is a checkpoint to resume from, with the overrides that
    restore what this recipe changes of what it was trained with (checkpoint.built_from) and of what a
    resume cannot change (FIXED_ON_RESUME, from the run's recipe.yaml); else nothing. Its hashes are
    not checked here (a resume does, and falls back to an older intact one)."""
    newest = checkpoint.latest(run_dir)
    if newest is None:
        return ""
    try:
        recorded = checkpoint.read_state(newest).built_from
        old = load_recipe(RunDir(run_dir).recipe_file) if RunDir(run_dir).recipe_file.is_file() else None
    except (manifest.DamagedCheckpoint, UserError):
        return ""
    restore = []
    if recorded is not None:  # None: an older checkpoint, which does not say what it was trained with
        here = checkpoint.built_from(recipe, method=recipe.method)
        if recipe.method == "auto":  # the planner decides it; the recorded one is the rung's
            here.pop("method")
        restore += [checkpoint.override(key, before) for key, before, _ in checkpoint.changed_keys(recorded, here)]
    for dotted in FIXED_ON_RESUME if old is not None else ():
        section, key = dotted.split(".")
        before, after = getattr(getattr(old, section), key), getattr(getattr(recipe, section), key)
        if before != after:
            restore.append(checkpoint.override(dotted, list(before) if isinstance(before, tuple) else before))
    return f"resume it with {shlex.join(['--resume', *restore])}, "


def init_run_dir(recipe: Recipe, *, resume_from: Path | None) -> None:
    """Create (or, with overwrite, replace) the run directory once every input has been checked.

    The main rank alone calls it, between two barriers of the caller's (train.trainer), so no
    rank sees a half-made directory; the store itself knows nothing of process groups.
    """
    run_dir = recipe.run_dir
    layout = RunDir(run_dir)
    runlock.acquire(run_dir)  # creates the directory; held until trainer.train returns
    if recipe.output.overwrite and not recipe.train.resume:
        for child in run_dir.iterdir():
            if child.name == layout.lock_file.name:
                continue
            if child.is_dir() and not child.is_symlink():
                shutil.rmtree(child)
            else:
                child.unlink()
    # With the lock held nobody else writes here: a temporary checkpoint folder is what a
    # killed save left behind, and only takes space.
    for leftover in checkpoint.unfinished(run_dir):
        shutil.rmtree(leftover, ignore_errors=True)
    staging.sweep_if_free(run_dir)  # an export into this path that a SIGKILL ended
    layout.write_recipe(recipe)
    failure = layout.read_failure() if recipe.train.resume else None
    if failure is not None:  # this resume is the retry the stop line asked for; it records its own
        log.warning("the previous run stopped at step %s (non-finite %s); resuming from %s", failure.get("step"),
                    failure.get("what"), resume_from.name if resume_from else "step 0")
        layout.failure_file.unlink()
    if recipe.train.resume and resume_from is None:
        log.info("no complete checkpoint in %s; starting a new run from step 0", run_dir)


def starts_anew(recipe: Recipe, *, resume_from: Path | None) -> bool:
    """Whether this run makes its directory from nothing: there is none yet (or an empty one), or
    --overwrite deletes the old run. Asked before `init_run_dir`; such a run may `discard` its
    directory when it fails to start, since nothing in it existed before this command."""
    if resume_from is not None:
        return False
    run_dir = recipe.run_dir
    if recipe.output.overwrite and not recipe.train.resume:
        return True
    return not run_dir.exists() or not any(run_dir.iterdir())


def discard(run_dir: Path, *, existed: bool) -> None:
    """Remove what a run that `starts_anew` wrote before it failed to start (a tracker that could
    not start, trainer.py), so the same command can simply be run again: without it the folder
    would hold a run with no step, which `train` refuses without --overwrite. Its lock goes too;
    the folder itself stays when it `existed` before (empty, or emptied by --overwrite)."""
    for child in list(run_dir.iterdir()) if run_dir.is_dir() else ():
        if child.is_dir() and not child.is_symlink():
            shutil.rmtree(child, ignore_errors=True)
        else:
            child.unlink(missing_ok=True)
    if not existed:
        with contextlib.suppress(OSError):
            run_dir.rmdir()


def _check_same_model(old: Recipe, new: Recipe, saved: Path) -> None:
    if old.objective != new.objective:
        raise UserError(f"{saved} is a run with objective {old.objective}, not {new.objective}; resume needs the "
                        "same objective (to preference-tune an SFT result, export it and train from the export)")
    if (old.model.path, old.method) != (new.model.path, new.method):
        raise UserError(
            f"{saved} is a run of {old.model.path} ({old.method}), not {new.model.path} ({new.method}); "
            "resume needs the same model and method, or use another --run-dir"
        )


def check_resume_overrides(old: Recipe, new: Recipe, *, saved: Path) -> None:
    """Refuse a --resume whose recipe changes what the restored optimizer, schedule or data
    position were built from (FIXED_ON_RESUME): the saved recipe must describe what ran."""
    for dotted in FIXED_ON_RESUME:
        section, key = dotted.split(".")
        before, after = getattr(getattr(old, section), key), getattr(getattr(new, section), key)
        if before != after:
            raise UserError(
                f"--resume cannot change {dotted} ({after} here, {before} in {saved}): the optimizer, schedule and "
                f"data position in the checkpoint were built with {before}; resume without it, or start a new run "
                "with another --run-dir"
            )
    before, after = _rows_per_step(old), _rows_per_step(new)
    if before != after:
        raise UserError(
            f"--resume cannot change the rows per optimizer step (train.micro_batch_size x train.grad_accum_steps x "
            f"processes: {after} here, {before} in {saved}); keep the product, or start a new run with another --run-dir"
        )


def _rows_per_step(recipe: Recipe) -> int:
    """The stages of a pipeline read the same rows: only its data-parallel replicas add rows."""
    stages = recipe.sharding.pipeline_stages
    replicas = recipe.world_size // (stages if isinstance(stages, int) else 1)
    return recipe.train.micro_batch_size * recipe.train.grad_accum_steps * replicas
