"""An export's output folder written beside its final path and swapped into place when complete.

`homelab-ft export RUN --out OUT` writes into `.OUT.homelab-ft-export-XXXXXXXX/new/` beside OUT
while holding `.OUT.homelab-ft-export.lock` (the run lock's flock, runlock.py): a second export
into the same OUT is refused instead of deleting the first one's result. OUT is replaced only once
the new export is complete, by two renames (OUT into the staging folder, the new one into OUT),
so a full disk, a signal or a crash before then leaves the previous OUT as it was.

A SIGKILL leaves the staging folder (a 1B model's merged export is ~2.5 GB); the next export into
OUT, or a train into OUT, removes it and says so with the bytes freed. It is recognised by its
name *and* the marker file written into it first, so a folder of the user's is never deleted (an
empty staging folder, what a kill between mkdir and the marker leaves, is removed with rmdir,
which cannot delete anything).
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import shutil
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from homelab_ft.errors import UserError
from homelab_ft.store import runlock

log = logging.getLogger(__name__)

TAG = "homelab-ft-export"
MARKER = ".homelab-ft-staging"
"""Written first into every staging folder (who made it, for which OUT): a sweep removes only folders holding it."""
NEW = "new"
"""The export being written, inside the staging folder."""
OLD = "old"
"""The previous OUT, moved into the staging folder for the instant between the two renames."""


def lock_file(final: Path) -> Path:
    return final.parent / f".{final.name}.{TAG}.lock"


def _pattern(final: Path) -> str:
    return f".{final.name}.{TAG}-*"


@dataclass(frozen=True)
class Staging:
    """One export's staging folder for `final`; `new` is where the export is written."""

    final: Path
    root: Path

    @property
    def new(self) -> Path:
        return self.root / NEW

    def swap(self) -> None:
        """Put the complete export in place of `final` (and its previous content, if any, out of the way)."""
        if self.final.exists():
            os.rename(self.final, self.root / OLD)
        os.rename(self.new, self.final)
        shutil.rmtree(self.root)

    def remove(self) -> None:
        """Drop the unfinished export; a previous `final` caught between the two renames goes back first."""
        _restore(self.final, self.root)
        shutil.rmtree(self.root, ignore_errors=True)


@contextlib.contextmanager
def locked(final: Path) -> Iterator[None]:
    """Hold `final`'s export lock for the with block, or refuse in one line naming the holder.

    The lock file is removed on release; a process that opened it just before checks, once it holds
    the flock, that the path still names the file it locked (else it retries), so two processes never
    both hold a lock on two different files of one name."""
    path = lock_file(final)
    for _ in range(10):
        fd = runlock.try_lock(path)
        if fd is None:
            raise UserError(f"--out {final} is being written by another homelab-ft export ({runlock.holder(path)}); "
                            "wait for it to finish, or choose another --out")
        if runlock.same_file(fd, path):
            break
        runlock.unlock(fd)
    else:
        raise UserError(f"--out {final}: its lock file {path} keeps being replaced; choose another --out")
    try:
        runlock.mark(fd)
        yield
    finally:
        with contextlib.suppress(OSError):
            path.unlink()
        runlock.unlock(fd)


def create(final: Path) -> Staging:
    """A new staging folder beside `final`, marked as ours before anything else is written."""
    root = Path(tempfile.mkdtemp(prefix=_pattern(final)[:-1], dir=final.parent))
    (root / MARKER).write_text(f"homelab-ft export into {final}, pid {os.getpid()}\n", encoding="utf-8")
    return Staging(final=final, root=root)


OLDER_PATTERN = ".{name}.tmp-????????"
"""What exports before the staging folders above left when killed: `tempfile.mkdtemp(prefix=".OUT.tmp-")`
beside OUT (8 random characters), with no marker in it."""
_EXPORT_SUFFIXES = (".safetensors", ".json", ".jinja", ".txt", ".model", ".gguf", ".md")
"""The files an export writes (weights, configs, tokenizer files, chat template, GGUF, its notes)."""


def _older_export(root: Path) -> bool:
    """A folder of OLDER_PATTERN's name that proves it is an unfinished export of ours: a model's
    config (config.json or adapter_config.json) at its top, and nothing but the files an export
    writes (`Modelfile` included), no sub-folder. A user's folder of that name holding anything
    else is left alone."""
    if not ((root / "config.json").is_file() or (root / "adapter_config.json").is_file()):
        return False
    return all(p.is_file() and not p.is_symlink() and (p.suffix in _EXPORT_SUFFIXES or p.name == "Modelfile")
               for p in root.iterdir())


def sweep(final: Path) -> int:
    """Remove the staging folders a killed export into `final` left (the caller holds `final`'s
    lock, so none is in use), older versions' too; one line each, with the bytes freed. Returns
    the bytes freed."""
    freed = 0
    for root in sorted(final.parent.glob(OLDER_PATTERN.format(name=final.name))):
        if root.is_dir() and not root.is_symlink() and _older_export(root):
            freed += _remove(root, who="an older homelab-ft")
    for root in sorted(final.parent.glob(_pattern(final))):
        if not root.is_dir() or root.is_symlink():
            continue
        if not (root / MARKER).is_file():
            with contextlib.suppress(OSError):
                root.rmdir()  # empty: killed between mkdir and the marker; anything else is not ours
            continue
        _restore(final, root)
        freed += _remove(root, who="a killed homelab-ft")
    return freed


def _remove(root: Path, *, who: str) -> int:
    """Delete one leftover staging folder, said in one line with its bytes; returns them."""
    size = tree_bytes(root)
    shutil.rmtree(root, ignore_errors=True)
    log.warning("removed %s, an unfinished export %s left (%s bytes freed)", root, who, f"{size:,}")
    return size


def sweep_if_free(final: Path) -> int:
    """`sweep` for a command that writes `final` without exporting (train's run directory): only
    while no export holds `final`'s lock."""
    if not final.parent.is_dir() or not any(
            (*final.parent.glob(_pattern(final)), *final.parent.glob(OLDER_PATTERN.format(name=final.name)))):
        return 0
    try:
        with locked(final):
            return sweep(final)
    except UserError:
        return 0  # an export into this path is running: its folder is in use


def _restore(final: Path, root: Path) -> None:
    """A previous `final` left in a staging folder (killed between the two renames of `swap`) goes back."""
    old = root / OLD
    if old.is_dir() and not final.exists():
        os.rename(old, final)
        log.warning("restored %s from %s (an export was stopped while replacing it)", final, root)


def tree_bytes(root: Path) -> int:
    return sum(p.stat().st_size for p in Path(root).rglob("*") if p.is_file() and not p.is_symlink())


def is_disk_full(err: BaseException) -> bool:
    text = str(err)
    seen = err
    while seen is not None:
        if isinstance(seen, OSError) and seen.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        seen = seen.__cause__ or seen.__context__
    # DCP gathers per-rank failures into one CheckpointException whose text holds theirs.
    return any(s in text for s in ("No space left", "Disk quota exceeded", "unexpected pos"))
