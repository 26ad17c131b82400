"""`homelab-ft report RUN` (issue 36 item 3): the page and its PNGs from a run folder's files, the
plan's peak beside the measured one, eval scores, DPO/GRPO panels only when present, one-line
refusals, and a report that is never left half written."""

from __future__ import annotations

import base64
import json
import re

import pytest

from homelab_ft.cli.main import main
from homelab_ft.errors import UserError
from homelab_ft.report import page, plots
from homelab_ft.rung import Rung
from homelab_ft.store.layout import RunDir, RunInfo

PNG = b"\x89PNG\r\n\x1a\n"
PREDICTED = 3 * 2**30


def _run(tmp_path, *, rows, evals=()):
    layout = RunDir(tmp_path / "run")
    layout.root.mkdir()
    layout.write_info(RunInfo(rung=Rung(method="lora", strategy="no_shard", cpu_offload=False), model_dir="/m",
                              world_size=1, params=1000))
    layout.write_plan({"chosen": {"memory": {"total": PREDICTED}, "reason": "LoRA fits"}})
    layout.metrics_file.write_text("".join(json.dumps(r) + "\n" for r in rows))
    for result in evals:
        layout.eval_dir.mkdir(exist_ok=True)
        (layout.eval_dir / f"{result['task']}.json").write_text(json.dumps(result))
    return layout


SFT = [{"step": s, "loss": 2.0 / s, "lr": 1e-3, "grad_norm": 1.0, "tokens_per_s": 500.0 + s,
        "peak_rss_gib": 1.0 + s / 10} for s in (1, 2, 3)] + [{"step": 3, "eval_loss": 0.9},
                                                            {"step": 2, "samples": [{"prompt": "p"}]}]


def _images(html: str) -> list[bytes]:
    return [base64.b64decode(m) for m in re.findall(r'src="data:image/png;base64,([^"]+)"', html)]


def test_an_sft_run_gets_loss_and_throughput_with_the_plan_and_its_scores(tmp_path):
    layout = _run(tmp_path, rows=SFT, evals=[{"task": "homelab_demo_json", "scores": {"exact_match": 0.75, "alias": "x"},
                                              "baseline": {"homelab_demo_json": {"exact_match": 0.125}}}])
    path = page.write_report(layout.root)
    assert path == layout.report_dir / "report.html"
    html = path.read_text()
    assert sorted(p.name for p in layout.report_dir.iterdir()) == ["loss.png", "report.html", "throughput.png"]
    assert [img[:8] for img in _images(html)] == [PNG, PNG]  # embedded: the page opens alone
    assert (layout.report_dir / "loss.png").read_bytes() == _images(html)[0]
    assert "3.00 GiB (LoRA fits)" in html and "1.30 GiB" in html  # predicted and measured peak
    assert "2.0000 (step 1) -&gt; 0.6667 (step 3)" in html and "0.9000 (step 3)" in html
    assert "<td>homelab_demo_json</td><td>exact_match</td><td>0.1250</td><td>0.7500</td>" in html
    assert "alias" not in html and "Objective" not in html


def test_dpo_and_grpo_metrics_get_their_panels_with_their_eval_twins(tmp_path):
    rows = [{**r, "reward_margin": 0.1 * r["step"], "rewards/exact/mean": 0.5} for r in SFT[:3]]
    rows.append({"step": 3, "eval_loss": 0.8, "eval_reward_margin": 0.2})
    assert plots.objective_keys(rows) == ["reward_margin", "rewards/exact/mean"]
    layout = _run(tmp_path, rows=rows)
    html = page.write_report(layout.root).read_text()
    assert (layout.report_dir / "objective.png").is_file() and len(_images(html)) == 3


def test_a_new_report_replaces_the_old_one_whole_and_a_failed_one_leaves_it(tmp_path, monkeypatch):
    layout = _run(tmp_path, rows=SFT)
    page.write_report(layout.root)
    old = (layout.report_dir / "report.html").read_text()

    def broken(fig, path):
        raise OSError("disk full")

    monkeypatch.setattr(plots, "save", broken)
    with pytest.raises(OSError):
        page.write_report(layout.root)
    assert (layout.report_dir / "report.html").read_text() == old
    assert sorted(p.name for p in layout.root.iterdir() if p.name.startswith(".report")) == []
    monkeypatch.undo()
    layout.metrics_file.write_text("".join(json.dumps(r) + "\n" for r in SFT[:2]))
    assert "steps logged</th><td>2<" in page.write_report(layout.root).read_text()
    assert not [p for p in layout.root.iterdir() if p.name.startswith(".report")]


def test_a_run_without_steps_yet_is_one_line(tmp_path):
    layout = _run(tmp_path, rows=[])
    layout.metrics_file.unlink()
    with pytest.raises(UserError, match="no metrics.jsonl yet"):
        page.write_report(layout.root)
    assert not layout.report_dir.exists()


def test_the_command_writes_the_page_and_refuses_a_folder_that_is_not_a_run(tmp_path, capsys):
    layout = _run(tmp_path, rows=SFT)
    assert main(["report", str(layout.root)]) == 0
    assert str(layout.report_dir / "report.html") in capsys.readouterr().out
    (tmp_path / "notarun").mkdir()
    assert main(["report", str(tmp_path / "notarun")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "is not a homelab-ft run directory" in err
    assert not (tmp_path / "notarun" / "report").exists()
