"""Where an export is written, and what may not happen to it there.

Before this, `export RUN --out RUN --overwrite` deleted the run's checkpoints, recipe and metrics,
and `--out RUN/checkpoints/step_N --overwrite` replaced the newest checkpoint with the export;
SIGTERM killed an export at once and left a hidden ~0.5 GB temporary folder; two exports into one
`--out` both exited 0, one having deleted the other's result; a full disk was a 24-line traceback.

Now an `--out` that is, holds or lies inside a run directory or a checkpoint is refused (the store
says what those look like: layout.py), with or without --overwrite, before anything is written; the
export is written into a staging folder under `--out`'s lock and swapped in when complete
(store/staging.py); SIGTERM / SIGINT remove the staging folder and end with one line and exit
128 + the signal, as a stopped train does (errors.Stopped); ENOSPC, EROFS and EACCES are one line
naming the path and the fix, and leave the previous `--out` as it was.
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import signal
import threading
from collections.abc import Iterator
from pathlib import Path

from homelab_ft.errors import Stopped, UserError
from homelab_ft.store import staging
from homelab_ft.store.layout import RunDir, checkpoint_marker

SIGNALS = (signal.SIGTERM, signal.SIGINT)
NOT_WRITABLE = {
    errno.EROFS: "is on a read-only file system; choose an --out on a writable one (or remount it read-write)",
    errno.EACCES: "is not accessible (permission denied); choose an --out you can write, or fix its permissions",
    errno.EPERM: "is not accessible (operation not permitted); choose an --out you can write, or fix its permissions",
}
"""errno -> what it says about the path, and the fix."""


def check_out(out: Path) -> None:
    """Refuse an `--out` that is a file, or is, holds or lies inside a run directory or a checkpoint."""
    out = Path(out)
    for part in (out, *out.parents):
        if part.exists() and not part.is_dir():
            what = f"--out {out}" if part == out else f"--out {out}: {part}"
            raise UserError(f"{what} is a file, not a directory; give a directory path for the export")
    resolved = out.resolve()
    for part in (resolved, *resolved.parents):
        if found := _what(part):
            _refuse(out, relation="is" if part == resolved else "is inside", path=part, found=found)
    if resolved.is_dir():  # what an --overwrite would delete (symlinks are not followed by that either)
        for root, dirs, _ in os.walk(resolved):
            for path in (Path(root) / name for name in dirs):
                if not path.is_symlink() and (found := _what(path)):
                    _refuse(out, relation="holds", path=path, found=found)


def check_not_the_base(out: Path, model_dir: Path) -> None:
    """Refuse an `--out` that is, lies inside or holds the run's base model folder (run.json's
    model_dir): the export would be mixed with the base's files, and an --overwrite would delete
    the base the run was trained from and every later export needs."""
    resolved, base = Path(out).resolve(), Path(model_dir).resolve()
    if resolved == base or base in resolved.parents:
        relation = "is" if resolved == base else "is inside"
    elif resolved in base.parents:
        relation = "holds"
    else:
        return
    raise UserError(f"--out {out} {relation} the run's base model folder {base} (run.json's model_dir); export never "
                    f"writes into or over it, with or without --overwrite: choose an --out outside it, e.g. "
                    f"{base.parent / (base.name + '-finetuned')}")


def _what(path: Path) -> tuple[str, str] | None:
    """("checkpoint" | "run directory", the file that says so), or None."""
    if marker := checkpoint_marker(path):
        return "checkpoint", marker
    if marker := RunDir(path).marker():
        return "run directory", marker
    return None


def _refuse(out: Path, *, relation: str, path: Path, found: tuple[str, str]) -> None:
    kind, marker = found
    run = path.parents[1] if kind == "checkpoint" and path.parent.name == "checkpoints" else path
    raise UserError(f"--out {out} {relation} the homelab-ft {kind} {path} (it holds {marker}); export never writes "
                    f"over a run's files, with or without --overwrite: choose an --out outside it, e.g. "
                    f"{run.parent / (run.name + '-export')}")


class Target:
    """An export under way into `out`: `begin` makes the staging folder, `commit` swaps it in."""

    def __init__(self, out: Path):
        self.out = out
        self._staging: staging.Staging | None = None

    def begin(self) -> Path:
        """The folder to write the export into."""
        self._staging = staging.create(self.out)
        self._staging.new.mkdir()
        return self._staging.new

    def commit(self) -> None:
        """Put the complete export in place; a signal from here on waits (the work is done)."""
        check_out(self.out)  # a train may have made a run directory there since the export began
        if _stop.signum:  # a library swallowed the signal's exception: the export stops all the same
            raise _Signalled(_stop.signum)
        _stop.deferred = True
        self._staging.swap()
        self._staging = None

    def abandon(self) -> None:
        if self._staging is not None:
            self._staging.remove()
            self._staging = None


@contextlib.contextmanager
def writing(out: Path) -> Iterator[Target]:
    """Hold `out` for one export: its lock, leftovers of killed exports removed, signals and disk
    errors turned into one line, and the staging folder removed unless the export was committed."""
    out = Path(out)
    target = Target(out)
    try:
        with _stop_on_signal():
            out.parent.mkdir(parents=True, exist_ok=True)
            with staging.locked(out):
                staging.sweep(out)
                try:
                    yield target
                finally:
                    target.abandon()
    except BaseException as err:
        if _stop.signum and not _stop.deferred:
            # Whatever came out: a C extension that called back into Python while the handler
            # raised turns `_Signalled` into its own error (safetensors' load_file: a ValueError).
            name = signal.Signals(_stop.signum).name
            raise Stopped(f"{name} during export: removed the unfinished export; {out} "
                          f"{'is unchanged' if out.exists() else 'was not written'}", signum=_stop.signum) from None
        if isinstance(err, UserError) or not isinstance(err, Exception):
            raise
        # safetensors and torch.save report a full disk as their own errors, not OSError
        if (line := _disk_error(err, out)) is None:
            raise
        raise UserError(line) from None


def _disk_error(err: BaseException, out: Path) -> str | None:
    """One line for a full disk or a read-only target, or None for anything else (our bug)."""
    kept = "the previous export in it is unchanged" if out.exists() else "nothing was left behind"
    if staging.is_disk_full(err):
        free = _free_bytes(out.parent)
        return (f"export to {out} not written: no space left on the disk of {out.parent} ({free:,} bytes free); "
                f"free some space, or choose an --out on another disk; {kept}")
    if isinstance(err, OSError) and err.errno in NOT_WRITABLE:
        path = Path(err.filename) if err.filename and err.errno != errno.EROFS else out.parent
        return f"export to {out} not written: {path} {NOT_WRITABLE[err.errno]}; {kept}"
    return None


def _free_bytes(path: Path) -> int:
    try:
        return shutil.disk_usage(path).free
    except OSError:
        return 0


class _Signalled(BaseException):
    """Raised in the main thread by the signal handler: a BaseException, so that no library's
    `except Exception` swallows it. A C extension may still turn it into its own error or drop it;
    `writing` and `commit` go by `_stop.signum`, which the handler sets first."""

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum


class _StopState:
    def __init__(self):
        self.signum = 0
        self.deferred = False


_stop = _StopState()


@contextlib.contextmanager
def _stop_on_signal() -> Iterator[None]:
    """SIGTERM / SIGINT raise `_Signalled` once; a second one while the staging folder is removed
    is ignored, and one after `commit` waits for the export to finish (it is complete by then)."""
    _stop.signum, _stop.deferred = 0, False
    if threading.current_thread() is not threading.main_thread():  # handlers only install there
        yield
        return

    def handle(signum: int, _frame) -> None:
        if _stop.signum:
            return
        _stop.signum = signum
        if not _stop.deferred:
            raise _Signalled(signum)

    previous = {sig: signal.signal(sig, handle) for sig in SIGNALS}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
