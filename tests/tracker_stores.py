"""Read a run's tracker stores back, each through its own library, for the tests of output.report_to.

Each reader returns `{run_id: {metric: {step: value}}}`, so a test compares the ids (one per homelab
run, across resume) and the values against metrics.jsonl.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path


def mlflow_runs(run_dir: Path) -> dict[str, dict[str, dict[int, float]]]:
    """Every run of RUN/mlflow's file store, through MlflowClient."""
    import os

    from mlflow.tracking import MlflowClient

    os.environ["MLFLOW_ALLOW_FILE_STORE"] = "true"
    client = MlflowClient(tracking_uri=(Path(run_dir) / "mlflow").resolve().as_uri())
    out = {}
    for experiment in client.search_experiments():
        for run in client.search_runs([experiment.experiment_id]):
            out[run.info.run_id] = {key: {m.step: m.value for m in client.get_metric_history(run.info.run_id, key)}
                                    for key in run.data.metrics}
    return out


_BLOCK = 32768
"""W&B's transaction log (`run-<id>.wandb`) is LevelDB's log format: 32 KiB blocks of records, each
with a 7-byte header (CRC32, length, type: 1 full, 2 first, 3 middle, 4 last), after a 7-byte file
header `:W&B` + magic + version. wandb 0.31 reads it in Go (wandb-core) only, so the test reads it here
and parses each record with wandb's own protobuf."""


def _records(path: Path):
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    assert data[:4] == b":W&B", data[:7]
    pos, pending = 7, b""
    while pos + 7 <= len(data):
        left = _BLOCK - pos % _BLOCK
        if left < 7:  # a block's tail too short for a header is padding
            pos += left
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if length == 0 and kind == 0:
            pos += left
            continue
        pending += data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            pending = b""
            yield record


def wandb_runs(run_dir: Path) -> dict[str, dict[str, dict[int, float]]]:
    """Every offline run under RUN/wandb, its history rows by step (wandb's own `_` keys left out)."""
    out: dict[str, dict[str, dict[int, float]]] = {}
    for path in sorted((Path(run_dir) / "wandb" / "wandb").glob("offline-run-*/run-*.wandb")):
        run_id = None
        for record in _records(path):
            kind = record.WhichOneof("record_type")
            if kind == "run":
                run_id = record.run.run_id
            elif kind == "history":
                step = record.history.step.num
                for item in record.history.item:
                    key = item.key or "/".join(item.nested_key)
                    if not key.startswith("_"):
                        out.setdefault(run_id, {}).setdefault(key, {})[step] = json.loads(item.value_json)
    return out


def tensorboard_scalars(run_dir: Path) -> dict[str, dict[int, float]]:
    """RUN/tensorboard's scalars by tag and step (the newest event wins a step written twice)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(Path(run_dir) / "tensorboard"))
    events.Reload()
    return {tag: {e.step: e.value for e in events.Scalars(tag)} for tag in events.Tags()["scalars"]}


def trackio_runs(run_dir: Path, *, project: str) -> dict[str, dict[str, dict[int, float]]]:
    """RUN/trackio's runs of `project`, through trackio's own SQLite reader."""
    import os

    os.environ["TRACKIO_DIR"] = str(Path(run_dir) / "trackio")
    from trackio.sqlite_storage import SQLiteStorage

    out = {}
    for name in SQLiteStorage.get_runs(project):
        rows = SQLiteStorage.get_logs(project, name)
        out[name] = {}
        for row in rows:
            for key, value in row.items():
                if key not in ("step", "timestamp") and isinstance(value, (int, float)):
                    out[name].setdefault(key, {})[row["step"]] = value
    return out
