"""The run directory as a type: every file a run leaves, named once, and run.json read back typed.

A run directory holds
- `recipe.yaml`: the resolved recipe the run trained with (what a resume compares against);
- `run.json`: the rung that ran, plus the model folder, process count and parameter count (`RunInfo`);
- `plan.json`: the planner's report, when the run was planned;
- `metrics.jsonl`, `tensorboard/`, `loss.png`: what people read (train/metrics.py);
- `trackio/`, `mlflow/`, `wandb/`, `trackers.json`: the other trackers' stores and run ids (train/trackers.py);
- `report/`: `homelab-ft report`'s report.html and PNGs;
- `checkpoints/step_*/`: resumable checkpoints (checkpoint.py);
- `.lock`: held by the one writer while it trains (runlock.py);
- `diverged.json`: the step a non-finite loss or gradient norm stopped the run at (train/divergence.py).

`RunDir.marker` and `checkpoint_marker` say what makes a folder a run or a checkpoint, so that
export can refuse an `--out` over one (export/target.py).

Export reads the rung from run.json rather than the recipe: a recipe may say `method: auto`, the
run.json says what the planner chose. Torch-free, so the CLI can name these paths without loading torch.
"""

from __future__ import annotations

import json
from dataclasses import MISSING, dataclass, fields
from pathlib import Path

from homelab_ft.errors import UserError
from homelab_ft.locate import json_object
from homelab_ft.recipe.config import Recipe, load_recipe
from homelab_ft.recipe.io import dump_recipe
from homelab_ft.rung import Rung, RungError
from homelab_ft.store import manifest

STATE_FILE = "trainer_state.json"
"""A checkpoint's step, run length, scheduler, data position and model identity; rewritten by every save."""


def checkpoint_marker(path: Path) -> str | None:
    """The file that makes `path` a checkpoint (checkpoint.py's layout, also one copied out of its
    run), or None: its trainer state, or a manifest beside DCP's `state/`."""
    path = Path(path)
    if (path / STATE_FILE).is_file():
        return STATE_FILE
    if (path / manifest.NAME).is_file() and (path / "state").is_dir():
        return manifest.NAME
    return None


@dataclass(frozen=True)
class RunInfo:
    """What run.json records: the rung that ran and what the trainer found when it started."""

    rung: Rung
    model_dir: str
    """The resolved model folder (a cache snapshot for a hub id)."""
    world_size: int
    """Processes the run trained on last (a resume may change it, keeping the global batch)."""
    params: int
    """Parameters of the whole model, trainable or not."""

    def to_dict(self) -> dict:
        """The rung's fields flat beside the others, the layout run.json has always had."""
        return {**self.rung.to_dict(), "model_dir": self.model_dir, "world_size": self.world_size, "params": self.params}

    @classmethod
    def from_dict(cls, data: dict) -> RunInfo:
        """Raises KeyError naming the first missing key, or RungError for a rung that cannot run."""
        required = [f.name for f in fields(Rung) if f.default is MISSING] + ["model_dir", "world_size", "params"]
        for key in required:
            if key not in data:
                raise KeyError(key)
        return cls(rung=Rung.from_dict(data), model_dir=str(data["model_dir"]), world_size=int(data["world_size"]),
                   params=int(data["params"]))


@dataclass(frozen=True)
class RunDir:
    """One run directory; `RunDir(recipe.run_dir)`. Naming a path creates nothing."""

    root: Path

    def __post_init__(self) -> None:
        object.__setattr__(self, "root", Path(self.root))

    @property
    def recipe_file(self) -> Path:
        return self.root / "recipe.yaml"

    @property
    def info_file(self) -> Path:
        return self.root / "run.json"

    @property
    def plan_file(self) -> Path:
        return self.root / "plan.json"

    @property
    def metrics_file(self) -> Path:
        return self.root / "metrics.jsonl"

    @property
    def tensorboard_dir(self) -> Path:
        return self.root / "tensorboard"

    @property
    def loss_plot(self) -> Path:
        return self.root / "loss.png"

    @property
    def trackio_dir(self) -> Path:
        """trackio's local store (`output.report_to`, train/trackers.py)."""
        return self.root / "trackio"

    @property
    def mlflow_dir(self) -> Path:
        """MLflow's file store: `mlflow ui --backend-store-uri RUN/mlflow`."""
        return self.root / "mlflow"

    @property
    def wandb_dir(self) -> Path:
        """W&B's run files (offline runs: `wandb sync RUN/wandb/wandb/offline-run-*`)."""
        return self.root / "wandb"

    @property
    def trackers_file(self) -> Path:
        """The tracker run ids, kept so a resume continues the same tracker runs."""
        return self.root / "trackers.json"

    @property
    def report_dir(self) -> Path:
        """`homelab-ft report`'s report.html and its PNGs (report.py)."""
        return self.root / "report"

    @property
    def eval_dir(self) -> Path:
        """`homelab-ft eval`'s scores, one `<task>.json` each (harness/run.py)."""
        return self.root / "eval"

    @property
    def checkpoints(self) -> Path:
        return self.root / "checkpoints"

    @property
    def lock_file(self) -> Path:
        return self.root / ".lock"

    @property
    def failure_file(self) -> Path:
        """Written when the run stopped at a non-finite step (train/divergence.py): the step, what
        was not finite, and the checkpoint from before it; a --resume removes it."""
        return self.root / "diverged.json"

    def read_failure(self) -> dict | None:
        """diverged.json, or None when the run has not diverged (or it cannot be read: it only informs)."""
        try:
            data = json.loads(self.failure_file.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return None
        return data if isinstance(data, dict) else None

    def marker(self) -> str | None:
        """The file that makes this a run directory, or None: `run.json` (written when training
        starts), or `recipe.yaml` beside `.lock` (what a run that died before its first step leaves).
        A `recipe.yaml` alone is not enough: it is also what a user keeps in a project folder."""
        if self.info_file.is_file():
            return self.info_file.name
        if self.recipe_file.is_file() and self.lock_file.is_file():
            return self.recipe_file.name
        return None

    def read_recipe(self) -> Recipe:
        if not self.recipe_file.is_file():
            raise UserError(f"{self.root} is not a homelab-ft run directory (no {self.recipe_file.name}); "
                            "give the directory a train run wrote")
        return load_recipe(self.recipe_file)

    def write_recipe(self, recipe: Recipe) -> None:
        dump_recipe(recipe, self.recipe_file)

    def read_info(self) -> RunInfo:
        """run.json, typed; a missing or unreadable one is one UserError naming the file and the fix."""
        path = self.info_file
        if not path.is_file():
            raise UserError(f"{self.root} is not a homelab-ft run directory (no {path.name}); give the directory a "
                            "train run wrote")
        fix = "it is written when training starts; train the run again (--resume keeps its checkpoints)"
        data = json_object(path, fix=fix)
        try:
            return RunInfo.from_dict(data)
        except KeyError as err:
            raise UserError(f"{path} has no {err.args[0]!r}; {fix}") from None
        except RungError as err:
            raise UserError(f"{path} records a rung that cannot run ({err}); {fix}") from None
        except (TypeError, ValueError) as err:
            raise UserError(f"{path} holds a value of the wrong type ({err}); {fix}") from None

    def write_info(self, info: RunInfo) -> None:
        self.info_file.write_text(json.dumps(info.to_dict(), indent=1))

    def write_plan(self, plan: dict) -> None:
        """The planner's report (`Plan.to_dict()`), as `homelab-ft plan --json` prints it."""
        self.plan_file.write_text(json.dumps(plan, indent=2))
