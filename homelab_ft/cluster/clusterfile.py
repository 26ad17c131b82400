"""The cluster file: what `homelab-ft doctor` measured, in a form `plan` and `train` take (`--cluster`).

It is YAML with two sections. `cluster:` holds exactly the keys of a recipe's `cluster:` section
(config.ClusterConfig: nodes, GPUs, memory, link bandwidth and latency), so it is validated by the
same typed config and applied like command-line overrides: the measured values replace the
recipe's guesses, and flags given beside `--cluster` still win. `measured:` is the record behind
those numbers (per node: versions, GPUs, disk; per link: each collective and size) for people to
read; nothing reads it back.

Torch-free, like the planner.
"""

from __future__ import annotations

import json
import os
import tempfile
from dataclasses import fields
from pathlib import Path
from typing import Any

import yaml

from homelab_ft.errors import UserError
from homelab_ft.recipe import bounded_yaml
from homelab_ft.recipe.config import ClusterConfig

FORMAT = "homelab-ft-cluster/1"
_KEYS = tuple(f.name for f in fields(ClusterConfig))


def write(path: str | Path, *, cluster: dict[str, Any], measured: dict[str, Any], header: str = "") -> None:
    """Write the file atomically (a temporary file renamed over it): a crash leaves the old one."""
    unknown = sorted(set(cluster) - set(_KEYS))
    if unknown:
        raise ValueError(f"not cluster keys: {unknown}")
    ClusterConfig(**cluster)  # what we write must load back
    path = Path(path)
    text = "".join(f"# {line}\n" for line in header.splitlines())
    text += yaml.safe_dump({"format": FORMAT, "cluster": cluster, "measured": measured}, sort_keys=False)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            fh.write(text)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def read(path: str | Path) -> dict[str, Any]:
    """The `cluster:` values of a cluster file, checked; a one-line UserError naming the file otherwise."""
    path = Path(path)
    fix = "run `homelab-ft doctor --hosts HOSTFILE --out FILE` to measure the cluster, or pass a file it wrote"
    if not path.is_file():
        raise UserError(f"--cluster {path}: no such file; {fix}")
    try:
        raw = bounded_yaml.safe_load(path.read_text(encoding="utf-8"))
    except bounded_yaml.YAMLBoundError as err:
        line = f"line {err.problem_mark.line + 1}: " if err.problem_mark is not None else ""
        raise UserError(f"--cluster {path}: {line}{err.problem}; {fix}") from None
    except (yaml.YAMLError, UnicodeDecodeError) as err:
        raise UserError(f"--cluster {path}: not a readable YAML file ({type(err).__name__}); {fix}") from None
    if not isinstance(raw, dict) or raw.get("format") != FORMAT or not isinstance(raw.get("cluster"), dict):
        raise UserError(f"--cluster {path}: not a homelab-ft cluster file (expected `format: {FORMAT}` and a "
                        f"`cluster:` mapping); {fix}")
    values = raw["cluster"]
    unknown = sorted(set(values) - set(_KEYS))
    if unknown:
        raise UserError(f"--cluster {path}: cluster.{unknown[0]} is not a cluster setting (known: {', '.join(_KEYS)}); "
                        f"remove it or {fix}")
    try:
        ClusterConfig(**values)
    except Exception as err:  # pydantic's ValidationError: first line of the explanation
        detail = str(err).splitlines()
        reason = (detail[2] if len(detail) > 2 else detail[0]).split(" [type=")[0].strip()
        field = detail[1].strip() if len(detail) > 1 else "?"
        raise UserError(f"--cluster {path}: cluster.{field}: {reason}; fix the value or {fix}") from None
    return values


def overrides(path: str | Path) -> list[str]:
    """The file's `cluster:` values as `cluster.key=value` recipe overrides (values as JSON, which YAML reads).

    Its `inter_link_gbit` is a measured collective bandwidth, so it is marked as such
    (`inter_link_measured`): the planner uses it as it is instead of taking ~90% of a nominal speed."""
    values = read(path)
    out = [f"cluster.{key}={json.dumps(value)}" for key, value in values.items() if value is not None]
    if values.get("inter_link_gbit") is not None and "inter_link_measured" not in values:
        out.append("cluster.inter_link_measured=true")
    return out
