"""The experiment trackers a run reports to (`output.report_to`): TensorBoard, trackio, MLflow, W&B.

MetricsLogger (metrics.py) hands every row it writes to metrics.jsonl to each tracker here, so they
all see the same numbers under the same step. Each tracker is its own library, kept local: TensorBoard
events, trackio's SQLite store and MLflow's file store live in the run folder, and W&B runs offline
(files under RUN/wandb, `wandb sync` uploads them later) unless the user is logged in and has not set
WANDB_MODE. A homelab node often has no internet, so nothing here waits on a network by default.

One tracker run per homelab run: the ids are kept in RUN/trackers.json and reused on `--resume`,
so a resumed run continues the same tracker run instead of starting a second one.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import uuid
from pathlib import Path

from homelab_ft import fsio
from homelab_ft.errors import UserError
from homelab_ft.store.layout import RunDir

log = logging.getLogger(__name__)

def check_available(names: tuple[str, ...]) -> None:
    """Preflight: every named tracker's library imports, checked before the run directory exists.

    Only looked up (importlib's find_spec), not imported: importing wandb or mlflow costs seconds.
    Each tracker's module has its name (mlflow-skinny installs `mlflow` too).
    """
    missing = [name for name in names if importlib.util.find_spec(name) is None]
    if missing:
        raise UserError(f"output.report_to: {', '.join(missing)} not installed; "
                        f"pip install 'homelab-ft[track]' (or {' '.join(missing)}), or drop it from output.report_to")


class Tracker:
    """One tracker run: `log` a step's numbers, `close` at the end. Subclasses keep it that small."""

    def log(self, step: int, scalars: dict[str, float]) -> None:
        raise NotImplementedError

    def close(self) -> None:
        raise NotImplementedError


class TensorBoard(Tracker):
    def __init__(self, layout: RunDir):
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(log_dir=str(layout.tensorboard_dir))

    def log(self, step: int, scalars: dict[str, float]) -> None:
        for key, value in scalars.items():
            self.writer.add_scalar(key, value, step)

    def text(self, step: int, tag: str, text: str) -> None:
        self.writer.add_text(tag, text, step)

    def close(self) -> None:
        self.writer.close()


class Trackio(Tracker):
    """trackio's local store (SQLite) in RUN/trackio: trackio reads TRACKIO_DIR once, when it is
    first imported (trackio/utils.py, 0.43), so the variable is set before that import."""

    def __init__(self, layout: RunDir, *, project: str, run_id: str):
        os.environ["TRACKIO_DIR"] = str(layout.trackio_dir)
        import trackio

        if Path(trackio.utils.TRACKIO_DIR) != layout.trackio_dir:
            raise UserError(f"output.report_to: trackio was imported before this run set its store to "
                            f"{layout.trackio_dir}; run one training per process")
        self._trackio = trackio
        # No space_id or server_url: the local store, never the Hub. "allow" continues the run on resume.
        self.run = trackio.init(project=project, name=run_id, resume="allow", embed=False,
                                auto_log_gpu=False, auto_log_cpu=False)

    def log(self, step: int, scalars: dict[str, float]) -> None:
        self.run.log(scalars, step=step)

    def close(self) -> None:
        self.run.finish()


class MLflow(Tracker):
    """MLflow's file store in RUN/mlflow, through MlflowClient rather than mlflow's global active run,
    so nothing leaks into another run in the same process.

    MLflow 3.18 refuses the file store unless MLFLOW_ALLOW_FILE_STORE is true (it is "in maintenance
    mode"); its replacement, SQLite, needs SQLAlchemy and Alembic, which mlflow-skinny leaves out. The
    file store still reads and writes runs, and `mlflow ui --backend-store-uri RUN/mlflow` shows them.
    """

    def __init__(self, layout: RunDir, *, project: str, run_id: str | None):
        os.environ["MLFLOW_ALLOW_FILE_STORE"] = "true"
        from mlflow.entities import Metric
        from mlflow.tracking import MlflowClient

        self._metric = Metric
        self.client = MlflowClient(tracking_uri=layout.mlflow_dir.resolve().as_uri())
        if run_id is None:
            experiment = self.client.get_experiment_by_name(project)
            experiment_id = experiment.experiment_id if experiment else self.client.create_experiment(project)
            run_id = self.client.create_run(experiment_id, run_name=project).info.run_id
        else:
            self.client.update_run(run_id, status="RUNNING")
        self.run_id = run_id

    def log(self, step: int, scalars: dict[str, float]) -> None:
        import time

        now = int(time.time() * 1000)
        metrics = [self._metric(key, float(value), now, step) for key, value in scalars.items()]
        self.client.log_batch(self.run_id, metrics=metrics)

    def close(self) -> None:
        self.client.set_terminated(self.run_id)


def wandb_mode() -> str:
    """"online" only when the user is logged in (WANDB_API_KEY or a netrc entry for the W&B host) and has
    not set WANDB_MODE; otherwise "offline", which writes RUN/wandb for `wandb sync` and never connects."""
    if os.environ.get("WANDB_MODE"):
        return "offline"
    if os.environ.get("WANDB_API_KEY"):
        return "online"
    try:
        from wandb.sdk.lib.wbauth.wbnetrc import read_netrc_auth

        return "online" if read_netrc_auth(host=os.environ.get("WANDB_BASE_URL", "https://api.wandb.ai")) else "offline"
    except Exception:  # noqa: BLE001 - a missing or unreadable netrc means not logged in
        return "offline"


class WandB(Tracker):
    def __init__(self, layout: RunDir, *, project: str, run_id: str):
        import wandb

        layout.wandb_dir.mkdir(parents=True, exist_ok=True)
        settings = wandb.Settings(silent=True, console="off", x_disable_stats=True, disable_git=True,
                                  x_save_requirements=False)
        self.run = wandb.init(project=project, name=project, id=run_id, resume="allow", dir=str(layout.wandb_dir),
                              mode=wandb_mode(), settings=settings)

    def log(self, step: int, scalars: dict[str, float]) -> None:
        self.run.log(scalars, step=step)

    def close(self) -> None:
        self.run.finish()


def open_trackers(run_dir: Path, names: tuple[str, ...], *, project: str) -> list[Tracker]:
    """Start each named tracker, reusing the run ids of RUN/trackers.json (a resume) or saving new ones.

    A tracker that fails to start is one line naming it, before any step runs.
    """
    layout = RunDir(run_dir)
    ids = json.loads(layout.trackers_file.read_text(encoding="utf-8")) if layout.trackers_file.is_file() else {}
    run_id = ids.get("run_id") or uuid.uuid4().hex[:16]
    opened: list[Tracker] = []
    try:
        for name in names:
            if name == "tensorboard":
                opened.append(TensorBoard(layout))
            elif name == "trackio":
                opened.append(Trackio(layout, project=project, run_id=run_id))
            elif name == "mlflow":
                tracker = MLflow(layout, project=project, run_id=ids.get("mlflow"))
                ids["mlflow"] = tracker.run_id
                opened.append(tracker)
            elif name == "wandb":
                opened.append(WandB(layout, project=project, run_id=run_id))
    except UserError:
        _close_all(opened)
        raise
    except Exception as exc:  # noqa: BLE001 - each library raises its own types; the user needs one line
        _close_all(opened)
        raise UserError(f"output.report_to: {name} could not start: {type(exc).__name__}: {exc}".splitlines()[0]) from exc
    if names and names != ("tensorboard",):
        ids["run_id"] = run_id
        fsio.replace_text(layout.trackers_file, json.dumps(ids, indent=1) + "\n")
    return opened


def _close_all(trackers: list[Tracker]) -> None:
    for tracker in trackers:
        try:
            tracker.close()
        except Exception:  # noqa: BLE001 - closing is best effort on the way out of a failed start
            log.debug("closing %s failed", type(tracker).__name__, exc_info=True)
