"""One writer per run directory.

Two `train` commands into one run directory (or a `--resume` while the first still runs) would
interleave `metrics.jsonl`, delete each other's temporary checkpoints and leave a `recipe.yaml`
describing the other run. The main rank therefore holds an exclusive `flock` on
`<run_dir>/.lock` for the run's life, with its host and pid written inside so a refusal can name
the holder. The kernel drops a flock when its process dies (kill -9, OOM killer, reboot), so a
lock left by a dead run is taken over without asking; we only say whose it was.

flock is per open file: the same process taking the lock twice is refused too, which is what a
second run started from the same Python process (the tests, a notebook) needs.

The same mechanism (`try_lock`, `mark`, `holder`) locks an export's `--out` (store/staging.py) and,
shared, a checkpoint an export is reading against the trainer's pruning (store/checkpoint.py).
"""

from __future__ import annotations

import fcntl
import logging
import os
import socket
import time
from pathlib import Path

from homelab_ft.errors import UserError
from homelab_ft.store.layout import RunDir

log = logging.getLogger(__name__)

_held: dict[Path, int] = {}
"""Run directory -> the open descriptor that holds its lock (this process's)."""


def holder(path: Path) -> str:
    """Who holds (or last held) the lock file `path`, as its holder wrote it (`mark`)."""
    try:
        text = path.read_text(encoding="utf-8").strip()
    except OSError:
        return "another process"
    return text or "another process"


def try_lock(path: Path, *, shared: bool = False, create: bool = True) -> int | None:
    """The open descriptor holding a flock on `path` (exclusive, or `shared` for readers), or None
    when another open file holds it, or when `path` is missing and not `create`d. The lock lasts
    until `unlock` or the process's death."""
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644) if create else os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        if create:
            raise
        return None
    try:
        fcntl.flock(fd, (fcntl.LOCK_SH if shared else fcntl.LOCK_EX) | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return None
    return fd


def mark(fd: int) -> None:
    """Write who holds the lock into its file, so a refusal can name the holder."""
    me = f"host {socket.gethostname()} pid {os.getpid()} since {time.strftime('%Y-%m-%d %H:%M:%S')}"
    os.ftruncate(fd, 0)
    os.pwrite(fd, (me + "\n").encode(), 0)
    os.fsync(fd)


def same_file(fd: int, path: Path) -> bool:
    """Whether `path` still names the file `fd` holds (a lock file removed and made again is another file)."""
    try:
        return os.path.samestat(os.fstat(fd), os.stat(path))
    except FileNotFoundError:
        return False


def unlock(fd: int) -> None:
    fcntl.flock(fd, fcntl.LOCK_UN)
    os.close(fd)


def in_use(run_dir: Path) -> str | None:
    """The holder of the run directory's lock while a live train holds it, else None."""
    path = RunDir(run_dir).lock_file
    if not path.is_file():
        return None
    fd = try_lock(path, shared=True, create=False)
    if fd is None:
        return holder(path) if path.is_file() else None
    unlock(fd)
    return None


def check_free(run_dir: Path) -> None:
    """Refuse (exit 2, writing nothing) when another live process holds the run directory.

    The probe takes a *shared* lock: every rank of a launch checks the same directory at once
    (a shared file system, or one machine), and two exclusive probes would refuse each other. A
    live train's exclusive lock still blocks it; the main rank takes that lock only after every
    rank's checks have passed a barrier (train.trainer)."""
    path = RunDir(run_dir).lock_file
    if not path.is_file():
        return
    if Path(run_dir).resolve() in _held:
        raise UserError(f"{run_dir} is in use by this process already ({holder(path)}); use another --run-dir")
    fd = try_lock(path, shared=True)
    if fd is None:
        raise UserError(
            f"{run_dir} is in use by a running homelab-ft train ({holder(path)}); wait for it to finish, stop it, "
            "or choose another --run-dir"
        )
    unlock(fd)


def acquire(run_dir: Path) -> None:
    """Take the run directory's lock for this process (creating the directory if needed)."""
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    path = RunDir(run_dir).lock_file
    check_free(run_dir)
    previous = holder(path) if path.is_file() and path.stat().st_size else None
    fd = try_lock(path)
    if fd is None:
        raise UserError(f"{run_dir} is in use by a running homelab-ft train ({holder(path)}); choose another --run-dir")
    mark(fd)
    _held[run_dir.resolve()] = fd
    if previous:
        log.warning("took over the lock of %s left by a run that is no longer running (%s)", run_dir, previous)


def release(run_dir: Path) -> None:
    """Drop this process's lock on `run_dir` (the file stays; its contents say who had it last)."""
    fd = _held.pop(Path(run_dir).resolve(), None)
    if fd is not None:
        os.ftruncate(fd, 0)
        unlock(fd)
