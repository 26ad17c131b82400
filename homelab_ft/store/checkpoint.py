"""Resumable checkpoints: one format for one process and for many.

A checkpoint is a directory `checkpoints/step_000123/` holding
- `state/`: model (trainable parameters only: the adapters for LoRA) and optimizer, written with
  torch.distributed.checkpoint (DCP), where every rank writes only the shards it holds and a load
  on another number of ranks reshards;
- `adapter/`: for LoRA runs, the adapter as PEFT safetensors (what export and serving read);
- `rng/rank_<r>.pt`: each rank's RNG states (dropout), read back with weights_only=True;
- `objective/rank_<r>.pt`: what an objective keeps between steps on each rank, when it keeps
  anything (GRPO's sampled batch while `grpo.num_iterations` > 1 trains on it), weights_only too;
- `trainer_state.json`: step, scheduler, data position, model identity;
- `manifest.json`: size and SHA-256 of every file above (manifest.py). Written and fsynced last.

All of it is written under `.tmp-step_000123` and renamed when complete, so a crash mid-write
leaves nothing that a resume would pick; a resume verifies the manifest and falls back to the
previous intact checkpoint when the newest one was damaged afterwards. DCP's index is read with
an unpickler that admits only DCP's own types (dcp_metadata.py): nothing in a run directory runs.
A save that fails (a full disk) removes its temporary folder and keeps the previous checkpoint.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import re
import shlex
import shutil
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

from homelab_ft.errors import UserError
from homelab_ft.recipe.config import Recipe
from homelab_ft.store import dcp_metadata, manifest, model_state, ranks, runlock, staging
from homelab_ft.store.layout import STATE_FILE, RunDir

log = logging.getLogger(__name__)

_STEP_DIR = re.compile(r"^step_(\d{6,})$")
ADAPTER = "adapter"
"""A LoRA run's adapter inside each checkpoint, as PEFT safetensors (what export and serving read)."""
OBJECTIVE = "objective"
"""Each rank's objective state inside a checkpoint (`save`'s rank_state)."""
_TMP_PREFIX = ".tmp-"
"""A save in progress: `.tmp-step_000123` until it is complete and renamed."""


@dataclass(frozen=True)
class TrainerState:
    step: int
    scheduler: dict
    """LambdaLR's state at the save, for a reader: a resume rebuilds the schedule from `step` and
    the run's length (train.optim.build_scheduler), so a changed length takes effect at once."""
    sampler: dict
    model_fingerprint: str
    world_size: int
    max_steps: int | None = None
    """The run's length when it saved (train.max_steps, or what train.num_epochs meant), for a
    reader; the schedule of a resume follows its own length (train.optim.build_scheduler)."""
    data_fingerprint: dict | None = None
    """The data the run read (data/fingerprint.py): a resume after it changed is refused.
    These two are None in checkpoints written before they were recorded."""
    built_from: dict | None = None
    """The recipe values the trained tensors were built from (`built_from`: dotted key -> value), so
    a resume that cannot load them says which key changed and from what; None in older checkpoints."""


BUILT_FROM_SECTIONS = ("model", "lora", "quant")
"""The sections whose values shape (or may shape) the trained tensors, with the rung's method and
the objective: a resume refused for another model names what differs among them."""


def built_from(recipe: Recipe, *, method: str) -> dict:
    """What a checkpoint records of the recipe it trained with: the method that ran (the rung's, not
    `auto`), the objective and every key of BUILT_FROM_SECTIONS, as dotted key -> JSON value."""
    values: dict = {"method": method, "objective": recipe.objective}
    for section in BUILT_FROM_SECTIONS:
        for key, value in dataclasses.asdict(getattr(recipe, section)).items():
            values[f"{section}.{key}"] = list(value) if isinstance(value, tuple) else value
    return values


def changed_keys(old: dict, new: dict) -> list[tuple[str, object, object]]:
    """(key, old value, new value) for every key both record and that differs, in the order recorded."""
    return [(key, old[key], new[key]) for key in old if key in new and old[key] != new[key]]


def spelled(value) -> str:
    """A value as a recipe override spells it (YAML: lists, booleans and null in JSON's form)."""
    return value if isinstance(value, str) else json.dumps(value)


def override(key: str, value) -> str:
    return f"{key}={spelled(value)}"


def refusal(path: Path, *, recorded: TrainerState, model_fingerprint: str, settings: dict) -> str:
    """Why a checkpoint cannot be loaded into this model, naming each changed key with its old and
    new value and, only when the checkpoint says what it was trained with, the overrides that
    restore it; starting anew is offered as another --run-dir, or --overwrite said to delete the run."""
    if recorded.built_from is None:
        return (f"{path} was written for another model or method ({recorded.model_fingerprint}, here "
                f"{model_fingerprint}); it predates recording the settings it was trained with, so compare this "
                f"resume's model.*, lora.* and quant.* values with that run's and resume with those, {_ANEW}")
    changes = changed_keys(recorded.built_from, settings)
    if not changes:
        return (f"{path} was written for another model ({recorded.model_fingerprint}, here {model_fingerprint}) "
                "although the recipe's method, model.*, lora.* and quant.* values are the ones it was trained with: "
                f"the model at model.path changed since; point model.path at the model it was trained on, {_ANEW}")
    return _changed(path, changes)


_ANEW = "or start a new run with another --run-dir (--overwrite starts one here, deleting this run and its checkpoints)"

TENSOR_KEYS = ("method", "objective", "model.path")
"""Recorded keys whose change always means other trained tensors (another model, method or objective);
with adapters also ADAPTER_KEYS (another rank, other wrapped layers, DoRA's magnitudes, routers)."""
ADAPTER_KEYS = ("lora.r", "lora.target_modules", "lora.use_dora", "lora.train_router")


def check_settings(path: Path, *, settings: dict, adapters: bool) -> None:
    """Refuse, before anything is built or written, a resume from `path` whose recorded settings
    differ from `settings` (this run's `built_from`) in a key that shapes the trained tensors; the
    load's fingerprint check stays the last word (a checkpoint without recorded settings, a changed
    model folder)."""
    recorded = read_state(path).built_from
    if recorded is None:
        return
    shaping = TENSOR_KEYS + (ADAPTER_KEYS if adapters else ())
    changes = changed_keys(recorded, settings)
    if any(key in shaping for key, _, _ in changes):
        raise UserError(_changed(path, changes))


def _changed(path: Path, changes: list[tuple[str, object, object]]) -> str:
    said = ", ".join(f"{key}: {spelled(old)} -> {spelled(new)}" for key, old, new in changes)
    restore = shlex.join(override(key, old) for key, old, _ in changes)  # as a shell reads them back
    return (f"{path} was trained with other settings than this resume's ({said}), so its tensors do not fit "
            f"this model; to continue it, resume with {restore}, {_ANEW}")


def checkpoints_dir(run_dir: Path) -> Path:
    return RunDir(run_dir).checkpoints


def candidates(run_dir: Path) -> list[Path]:
    """Every `step_*` folder, newest first (temporary `.tmp-step_*` folders are never candidates)."""
    root = checkpoints_dir(run_dir)
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir() if (m := _STEP_DIR.match(p.name)) and p.is_dir()]
    return [p for _, p in sorted(found, reverse=True)]


def unfinished(run_dir: Path) -> list[Path]:
    """Temporary folders of saves that never completed (a killed run's); only the writer holding
    the run's lock may remove them (rundir.init_run_dir)."""
    root = checkpoints_dir(run_dir)
    return sorted(p for p in root.glob(f"{_TMP_PREFIX}step_*") if p.is_dir()) if root.is_dir() else []


def latest(run_dir: Path) -> Path | None:
    """The newest checkpoint with a manifest (not verified: see `newest_intact`)."""
    return next((p for p in candidates(run_dir) if (p / manifest.NAME).is_file()), None)


def newest_intact(run_dir: Path, *, verbose: bool = True) -> Path | None:
    """The newest checkpoint that passes `verify`, or None when the run has none at all.

    A damaged newer one is reported in one line (what is wrong, and the step resumed instead);
    when every checkpoint is damaged this refuses with exit 2 rather than start again from step 0.
    Collective when a process group exists: every rank must call it.
    """
    return _newest_intact(run_dir, verbose=verbose, hold=False)[0]


@contextlib.contextmanager
def reading(run_dir: Path) -> Iterator[Path | None]:
    """`newest_intact`, held for the with block against the trainer's pruning (a shared flock on
    its manifest; `_prune` skips it): export reads a checkpoint for minutes, and a run with
    keep_last=1 pruned it under the export (FileNotFoundError, or "adapter does not fit the base").
    A listing that changed under us (a save and a prune in between) is read again."""
    for _ in range(3):
        listed = candidates(run_dir)
        found, fd = _newest_intact(run_dir, verbose=True, hold=True)
        if found is not None or candidates(run_dir) == listed:
            break
    try:
        yield found
    finally:
        if fd is not None:
            runlock.unlock(fd)


def _newest_intact(run_dir: Path, *, verbose: bool, hold: bool) -> tuple[Path | None, int | None]:
    damaged = []
    for path in candidates(run_dir):
        fd = _hold(path) if hold else None
        if hold and fd is None and ((path / manifest.NAME).is_file() or not path.is_dir()):
            continue  # pruned since it was listed, or being pruned now
        try:
            verify(path)
        except manifest.DamagedCheckpoint as err:
            if fd is not None:
                runlock.unlock(fd)
            damaged.append(f"{path.name} ({err})")
            continue
        if damaged and verbose and ranks.rank() == 0:
            log.warning("checkpoint %s is damaged; going back to %s (step %d)", "; ".join(damaged), path.name,
                        step_of(path))
        failure = RunDir(run_dir).read_failure()
        if failure and verbose and ranks.rank() == 0:
            log.warning("the run stopped at step %s (non-finite %s); %s is from before it", failure.get("step"),
                        failure.get("what"), path.name)
        return path, fd
    if damaged:
        raise UserError(
            f"no intact checkpoint in {checkpoints_dir(run_dir)}: {'; '.join(damaged)}; "
            "restore it from a backup, or start again with --overwrite (which deletes this run and its checkpoints)"
        )
    return None, None


def _hold(path: Path) -> int | None:
    """A shared flock on `path`'s manifest (None: no manifest, or a pruner holds it); a manifest
    unlinked between our open and our lock does not count."""
    fd = runlock.try_lock(path / manifest.NAME, shared=True, create=False)
    if fd is not None and not runlock.same_file(fd, path / manifest.NAME):
        runlock.unlock(fd)
        return None
    return fd


def verify(path: Path) -> TrainerState:
    """Raise `manifest.DamagedCheckpoint` unless `path` is exactly what its save wrote and agrees
    with itself (folder name, manifest and trainer state give one step, data position and world
    size). Files are hashed in parallel: rank r hashes every world_size-th file."""
    m = manifest.read(path)
    if m.step != step_of(path):
        raise manifest.DamagedCheckpoint(f"the folder says step {step_of(path)}, its manifest step {m.step}")
    manifest.check_sizes(path, m)
    names = sorted(m.files)
    problem = ""
    try:
        manifest.check_hashes(path, m, names[ranks.rank()::ranks.world_size()])
    except manifest.DamagedCheckpoint as err:
        problem = str(err)
    problems = [p for p in ranks.all_gather(problem) if p]
    if problems:
        raise manifest.DamagedCheckpoint(problems[0])
    state = read_state(path)
    if (state.step, state.sampler, state.world_size) != (m.step, m.data_position, m.world_size):
        raise manifest.DamagedCheckpoint(f"trainer_state.json (step {state.step}, {state.sampler}) disagrees with "
                                         f"its manifest (step {m.step}, {m.data_position})")
    try:
        dcp_metadata.read_metadata(path / "state")
    except (OSError, dcp_metadata.UnsafeMetadata) as err:
        raise manifest.DamagedCheckpoint(f"state/.metadata refused: {err}") from None
    return state


def read_state(path: Path) -> TrainerState:
    try:
        return TrainerState(**json.loads((path / STATE_FILE).read_text()))
    except (OSError, ValueError, TypeError) as err:
        raise manifest.DamagedCheckpoint(f"trainer_state.json is unreadable ({type(err).__name__})") from None


def step_of(path: Path) -> int:
    """The step of a `step_N` checkpoint folder, from its name (`verify` checks it against the manifest)."""
    return int(_STEP_DIR.match(path.name).group(1))


def save(run_dir: Path, *, model, optimizer, state: TrainerState, keep_last: int,
         rank_state: dict | None = None) -> Path:
    """Write a checkpoint for `state.step` on every rank; returns its final path.

    On failure (a full disk most often: `OSError: No space left` from our writes, or torch.save's
    `inline_container.cc ... unexpected pos`) the temporary folder is removed, the previous
    checkpoints stay, and a disk that is too small ends the run with a UserError giving the bytes
    needed and free. `rank_state`: this rank's objective state (tensors, numbers, strings, lists and
    dicts of them), written to objective/rank_<r>.pt and given back by `load_rank_state`.
    """
    root = checkpoints_dir(run_dir)
    final = root / f"step_{state.step:06d}"
    tmp = root / f"{_TMP_PREFIX}{final.name}"
    rank = ranks.rank()
    flat = model_state.differs_across_ranks(sorted(model_state.trainable_state(model)))  # pipeline stages (model_state.optimizer_state)
    payload = {"model": model_state.trainable_state(model), "optim": model_state.optimizer_state(model, optimizer, flat=flat)}
    expected_bytes = int(_sum_over_ranks(_tensor_bytes(payload)))
    try:
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)  # left by a crash at this very step
            tmp.mkdir(parents=True)
        ranks.barrier()
        _write(tmp, payload=payload, model=model, state=state, rank_state=rank_state)
    except BaseException as err:  # DCP's CheckpointException derives from BaseException
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        if not isinstance(err, (Exception, CheckpointException)):
            raise
        # A previous checkpoint says exactly what one takes; the tensors alone are a lower bound.
        previous = latest(run_dir)
        needed = max(expected_bytes, _tree_bytes(previous) if previous else 0)
        free = shutil.disk_usage(root).free
        if staging.is_disk_full(err) or free < needed:
            raise UserError(
                f"checkpoint of step {state.step} not saved: {root} has {free:,} bytes free and a checkpoint "
                f"needs about {needed:,}; free some space (or lower train.keep_last), then resume with --resume "
                f"from {previous.name if previous else 'the start'}"
            ) from None
        raise
    if rank == 0:
        if final.exists():  # a re-run of the same step after a resume from an earlier one
            shutil.rmtree(final)
        os.replace(tmp, final)
        manifest.fsync_dir(root)
        _prune(root, keep_last=keep_last)
    ranks.barrier()
    return final


def _write(tmp: Path, *, payload: dict, model, state: TrainerState, rank_state: dict | None = None) -> None:
    """Every rank writes its part, then hashes (and fsyncs) its share of the files; rank 0 writes
    the manifest last."""
    rank = ranks.rank()
    with _single_process_ok():
        dcp.save(payload, checkpoint_id=tmp / "state", no_dist=ranks.is_alone())
    (tmp / "rng").mkdir(exist_ok=True)
    torch.save(_rng_state(), tmp / "rng" / f"rank_{rank}.pt")
    if rank_state is not None:
        (tmp / OBJECTIVE).mkdir(exist_ok=True)
        torch.save(rank_state, tmp / OBJECTIVE / f"rank_{rank}.pt")
    model_state.save_adapter(model, tmp / ADAPTER)
    if rank == 0:
        (tmp / STATE_FILE).write_text(json.dumps(state.__dict__, indent=1))
    ranks.barrier()
    names = manifest.list_files(tmp)
    mine = {name: manifest.hash_file(tmp / name, fsync=True) for name in names[rank::ranks.world_size()]}
    files = {k: v for part in ranks.all_gather(mine) for k, v in part.items()}
    if rank == 0:
        manifest.fsync_dirs(tmp)
        manifest.write(tmp, manifest.Manifest(step=state.step, data_position=state.sampler,
                                              world_size=state.world_size, files=files))


def _tensor_bytes(tree) -> int:
    """Bytes of this rank's tensors in a (nested) state dict: what it writes to `state/`."""
    from torch.distributed.tensor import DTensor

    if isinstance(tree, dict):
        return sum(_tensor_bytes(v) for v in tree.values())
    if isinstance(tree, (list, tuple)):
        return sum(_tensor_bytes(v) for v in tree)
    if isinstance(tree, torch.Tensor):
        local = tree.to_local() if isinstance(tree, DTensor) else tree
        return local.numel() * local.element_size()
    return 0


def _tree_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in Path(path).rglob("*") if p.is_file())


def _sum_over_ranks(value: int) -> int:
    return sum(ranks.all_gather(value))


def load(path: Path, *, model, optimizer, model_fingerprint: str, settings: dict) -> TrainerState:
    """Restore model, optimizer and this rank's RNG from `path` (verified by `newest_intact`);
    returns the trainer state. `settings` is this run's `built_from`, named in a refusal."""
    state = read_state(path)
    if state.model_fingerprint != model_fingerprint:
        raise UserError(refusal(path, recorded=state, model_fingerprint=model_fingerprint, settings=settings))
    # The model's tensors are loaded in place (each rank its own shards, resharded by DCP when the
    # number of ranks changed); a trainable tensor missing from the checkpoint fails the load.
    reader = dcp_metadata.SafeFileSystemReader(path / "state")
    flat = model_state.NESTED_KEY not in reader.read_metadata().state_dict_metadata
    target = {"model": model_state.trainable_state(model), "optim": model_state.optimizer_state(model, optimizer, flat=flat)}
    with _single_process_ok(), torch.no_grad():
        dcp.load(target, storage_reader=dcp_metadata.SafeFileSystemReader(path / "state"), no_dist=ranks.is_alone())
    set_optimizer_state_dict(model, model_state.optimizers(optimizer), target["optim"],
                             options=StateDictOptions(flatten_optimizer_state_dict=flat))
    rng_file = path / "rng" / f"rank_{ranks.rank()}.pt"
    if rng_file.is_file():  # absent when resuming on more ranks than the run was written with
        _set_rng_state(torch.load(rng_file, weights_only=True))
    return state


def load_rank_state(path: Path) -> dict | None:
    """This rank's objective state saved with the checkpoint at `path`, or None (none was kept, or
    the run was written with fewer ranks)."""
    file = path / OBJECTIVE / f"rank_{ranks.rank()}.pt"
    return torch.load(file, weights_only=True) if file.is_file() else None


@contextlib.contextmanager
def _single_process_ok():
    """DCP warns on every single-process save/load; one process is a supported case here."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def _prune(root: Path, *, keep_last: int) -> None:
    """Keep the newest `keep_last` checkpoints; one an export is reading (`reading`) stays until a
    later save finds it free."""
    steps = sorted(p for p in root.iterdir() if _STEP_DIR.match(p.name) and (p / manifest.NAME).is_file())
    for old in steps[:-keep_last]:
        fd = runlock.try_lock(old / manifest.NAME, create=False)
        if fd is None:
            log.info("kept %s past train.keep_last: an export is reading it; a later save removes it", old.name)
            continue
        try:
            shutil.rmtree(old, ignore_errors=True)
        finally:
            runlock.unlock(fd)


def _rng_state() -> dict:
    state = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["cpu"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
