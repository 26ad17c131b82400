"""File-system failures as one line: what happened to which path, and what to do.

Every command reads and writes files a user owns: recipes, hostfiles, data, run directories,
exports. When the file system says no (a full disk, a read-only mount, a directory where a file
should be), the user needs the path and the fix, not a traceback from wherever the write
happened. `describe` turns an OSError into that line; the CLI's one handler (cli/main.py) uses it
for every command, and readers of text the user wrote (`read_text`) name the file when it is
not UTF-8. Our own files (run.json, trainer_state.json) go through `locate.json_object`.
`as_folder_files` gives a written file the mode its folder's other files get (safetensors' writer
creates its files readable by their owner only). `replace_text` writes a small file whole or not at all.
"""

from __future__ import annotations

import errno
import os
from pathlib import Path

from homelab_ft.errors import UserError

FIXES = {
    errno.ENOSPC: "free space there, or choose a path on another disk",
    errno.EDQUOT: "free space within your quota, or choose a path on another disk",
    errno.EROFS: "choose a path on a writable file system (or remount it read-write)",
    errno.EACCES: "fix its permissions, or choose another path",
    errno.EPERM: "fix its permissions or attributes (lsattr), or choose another path",
    errno.EISDIR: "a directory is where a file should be; give a file's path",
    errno.ENOTDIR: "a part of the path is a file, not a directory; fix the path",
    errno.EEXIST: "remove what is there, or choose another path",
    errno.ENOENT: "fix the path",
    errno.ENAMETOOLONG: "choose a shorter path",
    errno.ELOOP: "fix the symbolic links, or the path",
    errno.EMFILE: "raise the open-files limit (ulimit -n) and run again",
}
"""The errors a user can fix, each with its fix. Anything else is not a user mistake we can name
and keeps its traceback."""


def describe(err: OSError) -> str | None:
    """`path: what happened; the fix` for an error a user can fix, None otherwise."""
    fix = FIXES.get(err.errno)
    if fix is None:
        return None
    where = err.filename if err.filename is not None else "a file"
    also = f" (and {err.filename2})" if err.filename2 is not None else ""
    return f"{where}{also}: {err.strerror or 'failed'}; {fix}"


def read_text(path: Path, *, what: str) -> str:
    """A text file the user wrote (`what` names it: a hostfile, a template), as UTF-8; bytes that are
    not UTF-8 are one UserError naming the file and the byte's position."""
    try:
        return Path(path).read_text(encoding="utf-8")
    except UnicodeDecodeError as err:
        raise UserError(f"{what} {path} is not UTF-8 text (byte 0x{err.object[err.start]:02x} at offset "
                        f"{err.start:,}); save it as UTF-8") from None


def new_file_mode() -> int:
    """The mode `open()` gives a new file here: 0o666 less the process's umask (0o644 under the usual 022)."""
    mask = os.umask(0o022)  # the one portable way to read the umask is to set it, and set it back at once
    os.umask(mask)
    return 0o666 & ~mask


def as_folder_files(*paths: Path) -> None:
    """Give each file the mode a file `open()` creates beside it gets (`new_file_mode`).

    safetensors 0.8's `save_file` (and `save_pretrained`, which calls it) creates its file with mode
    600 whatever the umask, so `model.safetensors` was readable by its owner alone while config.json
    beside it was 644: an Ollama service account or a container's user could not read the export. Every writer of files meant for others (exports, a checkpoint's adapter)
    calls this after writing."""
    mode = new_file_mode()
    for path in paths:
        os.chmod(path, mode)


def replace_text(path: Path, text: str) -> None:
    """Write `path` whole through a temporary file beside it (this process's own, so two writers of one
    cache entry never share one) renamed over it: a kill or a full disk leaves the old file or the new
    one, never half of either, and no temporary file behind."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        tmp.write_text(text, encoding="utf-8")
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
