"""output.report_to end to end (issue 36 items 2 and 3): a tiny run reports to TensorBoard, MLflow,
W&B (offline) and trackio (when installed), is resumed, and each tracker's own store holds
metrics.jsonl's values under one run id; `homelab-ft report` then draws the run. A tracker whose
library is missing is one line before the run directory exists."""

from __future__ import annotations

import importlib.util
import json
import shutil
import subprocess

import build_recipe
import procs
import pytest
import tracker_stores

from homelab_ft.cli.main import main
from homelab_ft.train.metrics import read_metrics

pytest.importorskip("mlflow")
pytest.importorskip("wandb")
HAVE_TRACKIO = importlib.util.find_spec("trackio") is not None
TRACKERS = ["tensorboard", "mlflow", "wandb", *(["trackio"] if HAVE_TRACKIO else [])]
KEYS = ("loss", "lr", "grad_norm", "tokens_per_s", "peak_rss_gib")


def test_every_tracker_holds_the_runs_metrics_under_one_id_across_a_resume(tmp_path, tiny_model_dir, monkeypatch, capsys):
    for var in ("WANDB_API_KEY", "WANDB_MODE"):  # never online from a test, whatever the machine has
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))  # no ~/.netrc: not logged in to W&B
    monkeypatch.setenv("NETRC", str(tmp_path / "no-netrc"))
    procs.write_chat_data(tmp_path / "train.jsonl", 16)
    procs.write_chat_data(tmp_path / "eval.jsonl", 4, seed=1)
    recipe = build_recipe.write_recipe(tmp_path / "r.yaml", build_recipe.tiny_run(
        tiny_model_dir, rows=tmp_path / "train.jsonl", name="tiny-track",
        data={"eval_sources": [{"path": str(tmp_path / "eval.jsonl")}]},
        train={"max_steps": 2, "eval_every": 2}, output={"tensorboard": True, "report_to": TRACKERS}))
    run = tmp_path / "run"
    assert main(["train", str(recipe), "--run-dir", str(run)]) == 0
    first_ids = json.loads((run / "trackers.json").read_text())
    assert main(["train", str(recipe), "--run-dir", str(run), "--resume", "train.max_steps=3"]) == 0
    ids = json.loads((run / "trackers.json").read_text())
    assert ids == first_ids  # the resume continued the same tracker runs

    rows = read_metrics(run / "metrics.jsonl")
    expected = {key: {r["step"]: r[key] for r in rows if key in r} for key in (*KEYS, "eval_loss")}
    assert sorted(expected["loss"]) == [1, 2, 3] and sorted(expected["eval_loss"]) == [2, 3]

    mlflow = tracker_stores.mlflow_runs(run)
    assert list(mlflow) == [ids["mlflow"]]
    wandb = tracker_stores.wandb_runs(run)
    assert list(wandb) == [ids["run_id"]]
    tensorboard = tracker_stores.tensorboard_scalars(run)
    stores = {"mlflow": mlflow[ids["mlflow"]], "wandb": wandb[ids["run_id"]], "tensorboard": tensorboard}
    if HAVE_TRACKIO:
        trackio = tracker_stores.trackio_runs(run, project="tiny-track")
        assert list(trackio) == [ids["run_id"]]
        stores["trackio"] = trackio[ids["run_id"]]
    for name, store in stores.items():
        for key, values in expected.items():
            assert store[key] == pytest.approx(values, rel=1e-6), (name, key)

    capsys.readouterr()
    assert main(["report", str(run)]) == 0
    html = (run / "report" / "report.html").read_text()
    assert html.count("data:image/png;base64,") == 2 and "plan: predicted peak per device" in html
    _seen_in_a_browser(run / "report" / "report.html", tmp_path / "shot.png")


PLOT_COLOURS = {"loss.png: the learning rate": (44, 160, 44), "throughput.png: tokens/s": (148, 103, 189),
                "throughput.png: the plan's peak": (214, 39, 40)}
"""matplotlib's tab:green, tab:purple and tab:red, which only the drawn plots put on the page."""


def _seen_in_a_browser(page, shot):
    """The page as headless Chromium renders it (Debian's `chromium`): not blank, and every plot's
    own line colour on screen, which a missing or broken image would not show."""
    browser = shutil.which("chromium")
    if browser is None:
        pytest.skip("no chromium to render the report (apt-get install chromium)")
    subprocess.run([browser, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
                    f"--screenshot={shot}", "--window-size=1000,2000", page.resolve().as_uri()],
                   check=True, capture_output=True, timeout=120)
    from PIL import Image

    counts = {rgb: n for n, rgb in Image.open(shot).convert("RGB").getcolors(maxcolors=1 << 24)}
    assert len(counts) > 50, "the screenshot is blank"
    for what, colour in PLOT_COLOURS.items():
        near = sum(n for rgb, n in counts.items() if max(abs(a - b) for a, b in zip(rgb, colour, strict=True)) <= 12)
        assert near > 200, f"{what} is not on screen ({near} pixels of {colour})"


def test_a_tracker_that_is_not_installed_is_one_line_before_the_run_exists(tmp_path, tiny_model_dir, monkeypatch,
                                                                          capsys):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a))
    procs.write_chat_data(tmp_path / "train.jsonl", 8)
    recipe = build_recipe.write_recipe(tmp_path / "r.yaml", build_recipe.tiny_run(
        tiny_model_dir, rows=tmp_path / "train.jsonl", output={"report_to": ["wandb"]}))
    assert main(["train", str(recipe), "--run-dir", str(tmp_path / "run")]) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("homelab-ft:")]
    assert len(err) == 1 and "output.report_to: wandb not installed" in err[0]
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("before", ["none", "empty"])
def test_a_tracker_that_cannot_start_leaves_no_run_and_the_same_command_runs_again(tmp_path, tiny_model_dir,
                                                                                   monkeypatch, capsys, before):
    """A tracker whose library imports but fails to start (a locked store, a bad setting): one line,
    exit 2, and the folder this command made is gone (one that existed empty stays, empty), so
    running the same command again, once the tracker is fixed, trains without --overwrite."""
    from homelab_ft.train import trackers

    def broken(*args, **kwargs):
        raise OSError("database is locked")

    monkeypatch.setattr(trackers, "MLflow", broken)
    procs.write_chat_data(tmp_path / "train.jsonl", 8)
    recipe = build_recipe.write_recipe(tmp_path / "r.yaml", build_recipe.tiny_run(
        tiny_model_dir, rows=tmp_path / "train.jsonl", train={"max_steps": 1},
        output={"report_to": ["tensorboard", "mlflow"]}))
    run = tmp_path / "run"
    if before == "empty":
        run.mkdir()
    command = ["train", str(recipe), "--run-dir", str(run)]
    assert main(command) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("homelab-ft:")]
    assert len(err) == 1 and "output.report_to: mlflow could not start: OSError: database is locked" in err[0]
    assert (list(run.iterdir()) == []) if before == "empty" else not run.exists()
    monkeypatch.undo()
    assert main(command) == 0
    assert read_metrics(run / "metrics.jsonl")[-1]["step"] == 1 and (run / "trackers.json").is_file()


def test_a_tracker_that_cannot_start_on_resume_keeps_the_run(tmp_path, tiny_model_dir, monkeypatch, capsys):
    """On --resume the folder holds a run: a tracker that fails to start changes none of its files
    but recipe.yaml, which records the resume's recipe as every resume does (a tracker started
    before the failing one may add its own, as TensorBoard's new events file)."""
    from homelab_ft.train import trackers

    procs.write_chat_data(tmp_path / "train.jsonl", 8)
    recipe = build_recipe.write_recipe(tmp_path / "r.yaml", build_recipe.tiny_run(
        tiny_model_dir, rows=tmp_path / "train.jsonl", train={"max_steps": 1, "save_every": 1},
        output={"report_to": ["tensorboard", "mlflow"]}))
    run = tmp_path / "run"
    assert main(["train", str(recipe), "--run-dir", str(run)]) == 0
    before = {p: p.read_bytes() for p in run.rglob("*") if p.is_file() and p.name not in (".lock", "recipe.yaml")}

    def broken(*args, **kwargs):
        raise OSError("database is locked")

    monkeypatch.setattr(trackers, "MLflow", broken)
    assert main(["train", str(recipe), "--run-dir", str(run), "--resume", "train.max_steps=2"]) == 2
    assert "mlflow could not start" in capsys.readouterr().err
    assert {p: p.read_bytes() for p in before} == before
