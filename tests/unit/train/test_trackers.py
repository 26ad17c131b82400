"""output.report_to (issue 36 item 2): which trackers start, the one-line refusals, W&B's mode, and
MLflow's file store holding metrics.jsonl's numbers under one run id across a resume."""

from __future__ import annotations

import importlib.util
import json

import pytest
import tracker_stores
from pydantic import ValidationError

from homelab_ft.errors import UserError
from homelab_ft.recipe.config import OutputConfig
from homelab_ft.train import trackers
from homelab_ft.train.metrics import MetricsLogger, read_metrics


@pytest.mark.parametrize(("output", "expected"), [
    ({}, ("tensorboard",)),
    ({"report_to": ("mlflow",)}, ("tensorboard", "mlflow")),
    ({"tensorboard": False, "report_to": ("wandb", "mlflow")}, ("wandb", "mlflow")),
    ({"tensorboard": False}, ()),
    ({"report_to": ("tensorboard", "trackio", "trackio")}, ("tensorboard", "trackio")),
])
def test_the_trackers_a_recipe_names(output, expected):
    assert OutputConfig(**output).trackers == expected


def test_an_unknown_tracker_is_refused_by_the_recipe():
    with pytest.raises(ValidationError, match="neptune"):
        OutputConfig(report_to=("neptune",))


def test_a_tracker_that_is_not_installed_is_one_line(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None if name == "wandb" else real(name))
    with pytest.raises(UserError) as err:
        trackers.check_available(("tensorboard", "wandb"))
    assert "wandb not installed" in str(err.value) and "homelab-ft[track]" in str(err.value)
    assert "\n" not in str(err.value)
    trackers.check_available(("tensorboard",))


@pytest.mark.parametrize(("env", "netrc", "mode"), [
    ({}, False, "offline"),
    ({"WANDB_API_KEY": "k" * 40}, False, "online"),
    ({"WANDB_API_KEY": "k" * 40, "WANDB_MODE": "online"}, False, "offline"),  # WANDB_MODE set: never online
    ({}, True, "online"),
    ({"WANDB_MODE": "disabled"}, True, "offline"),
])
def test_wandb_goes_online_only_when_logged_in_and_wandb_mode_is_unset(monkeypatch, tmp_path, env, netrc, mode):
    pytest.importorskip("wandb")
    for var in ("WANDB_API_KEY", "WANDB_MODE", "WANDB_BASE_URL"):
        monkeypatch.delenv(var, raising=False)
    for var, value in env.items():
        monkeypatch.setenv(var, value)
    monkeypatch.setenv("NETRC", str(tmp_path / "netrc"))
    monkeypatch.setenv("HOME", str(tmp_path))
    if netrc:
        (tmp_path / "netrc").write_text("machine api.wandb.ai\n  login user\n  password " + "p" * 40 + "\n")
        (tmp_path / "netrc").chmod(0o600)
        (tmp_path / ".netrc").write_text((tmp_path / "netrc").read_text())
        (tmp_path / ".netrc").chmod(0o600)
    assert trackers.wandb_mode() == mode


def test_a_rank_that_does_not_log_starts_no_tracker(tmp_path):
    logger = MetricsLogger(tmp_path, enabled=False, report_to=("tensorboard", "mlflow"))
    logger.log({"step": 1, "loss": 1.0})
    logger.close()
    assert list(tmp_path.iterdir()) == []


def test_mlflow_holds_the_same_metrics_under_one_run_across_a_resume(tmp_path):
    pytest.importorskip("mlflow")
    rows = [{"step": s, "loss": 2.0 / s, "lr": 1e-3 * s, "tokens_per_s": 100.0 + s, "samples_seen": True}
            for s in (1, 2, 3)]
    for part in (rows[:2], rows[2:]):  # the second MetricsLogger is what a --resume opens
        logger = MetricsLogger(tmp_path, enabled=True, report_to=("mlflow",), project="tiny")
        for row in part:
            logger.log(row)
        logger.close()
    ids = json.loads((tmp_path / "trackers.json").read_text())
    stored = tracker_stores.mlflow_runs(tmp_path)
    assert list(stored) == [ids["mlflow"]]
    expected = {key: {r["step"]: r[key] for r in read_metrics(tmp_path / "metrics.jsonl")}
                for key in ("loss", "lr", "tokens_per_s")}  # a bool is not a metric
    assert stored[ids["mlflow"]] == expected


def test_a_tracker_that_cannot_start_is_one_line(tmp_path):
    pytest.importorskip("mlflow")
    (tmp_path / "trackers.json").write_text(json.dumps({"run_id": "abc", "mlflow": "0" * 32}))
    with pytest.raises(UserError) as err:
        MetricsLogger(tmp_path, enabled=True, report_to=("mlflow",))
    assert str(err.value).startswith("output.report_to: mlflow could not start") and "\n" not in str(err.value)
