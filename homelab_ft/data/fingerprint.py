"""What a run's data was, recorded in each checkpoint, so `--resume` knows when it changed.

A resume restores the sampler's position: "the next 40 micro-batches of this shuffled order".
That position only means something for the rows it was computed from. If a file was edited,
appended to or replaced, the same position points at other rows (some seen twice, some never),
and a resume used to continue silently. The fingerprint holds every file a source resolved to
(path, size and SHA-256 of its bytes, the bytes the tokeniser read) and the data settings that
shape the rows, and `check_resume` compares the checkpoint's with today's before anything runs.

Hashing reads each file once more: about a second per GB on one core, small beside tokenising.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
from pathlib import Path

from homelab_ft.data.sources import resolve_files
from homelab_ft.errors import UserError
from homelab_ft.recipe.config import DataConfig

log = logging.getLogger(__name__)

_NOT_DATA = ("cache_dir",)
"""DataConfig fields that do not change which rows a run sees: where the tokenised cache lives."""


def of(cfg: DataConfig, *, base_dir: Path | None) -> dict:
    """{"settings": hash of the data settings, "files": [[path, size, sha256], ...], "hub": [...]}."""
    settings = {k: v for k, v in dataclasses.asdict(cfg).items() if k not in _NOT_DATA}
    files: list[list] = []
    hub: list[str] = []
    for section, sources in (("sources", cfg.sources), ("eval_sources", cfg.eval_sources)):
        for i, src in enumerate(sources):
            target = resolve_files(src.path, base_dir=base_dir, where=f"data.{section}[{i}]")
            if isinstance(target, str):  # a hub dataset read from the local cache: named, not hashed
                hub.append(f"{target}:{src.split}")
                continue
            paths = target if isinstance(target, list) else sorted(p for p in target.rglob("*") if p.is_file())
            files += [[str(p), p.stat().st_size, _sha256(p)] for p in paths]
    return {"settings": hashlib.sha256(json.dumps(settings, sort_keys=True, default=str).encode()).hexdigest(),
            "files": files, "hub": hub}


def _sha256(path: Path) -> str:
    with open(path, "rb") as fh:
        return hashlib.file_digest(fh, "sha256").hexdigest()


def changes(old: dict, new: dict) -> list[str]:
    """What differs between two fingerprints, one short phrase each (empty when the data is the same)."""
    said = []
    if old.get("settings") != new.get("settings"):
        said.append("the data settings changed")
    before = {path: (size, digest) for path, size, digest in old.get("files", [])}
    after = {path: (size, digest) for path, size, digest in new.get("files", [])}
    for path in sorted(before.keys() - after.keys()):
        said.append(f"{path} is no longer read")
    for path in sorted(after.keys() - before.keys()):
        said.append(f"{path} is new")
    for path in sorted(before.keys() & after.keys()):
        (old_size, old_hash), (new_size, new_hash) = before[path], after[path]
        if old_size != new_size:
            said.append(f"{path} changed ({old_size:,} -> {new_size:,} bytes)")
        elif old_hash != new_hash:
            said.append(f"{path} changed (same size, other bytes)")
    if old.get("hub", []) != new.get("hub", []):
        said.append(f"the hub datasets changed ({', '.join(old.get('hub', [])) or 'none'} -> "
                    f"{', '.join(new.get('hub', [])) or 'none'})")
    return said


def check_resume(recorded: dict | None, current: dict, *, checkpoint: Path, allow_change: bool) -> None:
    """Refuse a resume whose data is not what the checkpoint's position was computed from, unless
    the user said so (`--allow-data-change`), in which case the run's log says what changed.

    A checkpoint written before fingerprints were recorded (`recorded` None) cannot be compared:
    the log says so and the resume goes on, as it always did.
    """
    if recorded is None:
        log.warning("%s records no data fingerprint (written by an older homelab-ft); the data cannot be "
                    "compared with what it was trained on", checkpoint)
        return
    said = changes(recorded, current)
    if not said:
        return
    what = "; ".join(said[:3]) + (f"; and {len(said) - 3} more" if len(said) > 3 else "")
    if not allow_change:
        raise UserError(f"--resume: the data differs from what {checkpoint} was trained on ({what}), so its data "
                        "position would point at other rows; restore the data, start a new run with another "
                        "--run-dir, or pass --allow-data-change to continue anyway")
    log.warning("--allow-data-change: continuing from %s although the data changed (%s); the data position "
                "restored from it now points at other rows", checkpoint, what)
