"""metrics.jsonl after a kill -9 mid-write (issue 23 point 4): the last line may be torn."""

from __future__ import annotations

import json
import logging

import pytest

from homelab_ft.train.metrics import MetricsLogger, plot_loss, read_metrics

ROWS = [{"step": s, "loss": 2.0 - s / 10} for s in range(1, 5)]
TORN = ['{"step": 5, "lo', '{"step": 5, "loss": 1.5}']  # cut mid-row; a whole row that lost only its newline


def _write(path, tail: str) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in ROWS) + tail, encoding="utf-8")


def test_a_torn_last_line_is_left_out_with_a_warning(tmp_path, caplog):
    path = tmp_path / "metrics.jsonl"
    _write(path, TORN[0])
    with caplog.at_level(logging.WARNING):
        assert read_metrics(path) == ROWS
    assert "torn last line" in caplog.text and str(path) in caplog.text


def test_a_cut_inside_a_utf8_character_is_torn(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_bytes(b"".join(json.dumps(r).encode() + b"\n" for r in ROWS) + '{"samples": "é'.encode()[:-1])
    assert read_metrics(path) == ROWS


def test_a_last_row_without_its_newline_is_still_read(tmp_path):
    path = tmp_path / "metrics.jsonl"
    _write(path, TORN[1])
    assert read_metrics(path) == [*ROWS, {"step": 5, "loss": 1.5}]


def test_a_bad_line_before_the_last_is_not_a_torn_write(tmp_path):
    """Only the last line can be torn by a kill; damage elsewhere is not ours to guess at."""
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1, "loss": 2.0}\nnot json\n{"step": 2, "loss": 1.9}\n', encoding="utf-8")
    with pytest.raises(ValueError):
        read_metrics(path)


@pytest.mark.parametrize("tail", TORN)
def test_resume_truncates_a_torn_last_line(tmp_path, tail):
    _write(tmp_path / "metrics.jsonl", tail)
    logger = MetricsLogger(tmp_path, enabled=True, report_to=())
    logger.truncate_after(3)
    logger.log({"step": 4, "loss": 1.6})
    lines = (tmp_path / "metrics.jsonl").read_text(encoding="utf-8").splitlines()
    assert [json.loads(line) for line in lines] == [*ROWS[:3], {"step": 4, "loss": 1.6}]
    assert not (tmp_path / "metrics.jsonl.tmp").exists()


def test_resume_drops_the_torn_tail_even_when_keeping_every_row(tmp_path):
    """The next row is appended after the torn bytes otherwise, and the file is torn mid-way for good."""
    _write(tmp_path / "metrics.jsonl", TORN[0])
    logger = MetricsLogger(tmp_path, enabled=True, report_to=())
    logger.truncate_after(10)
    logger.log({"step": 5, "loss": 1.5})
    assert read_metrics(tmp_path / "metrics.jsonl") == [*ROWS, {"step": 5, "loss": 1.5}]


def test_the_loss_plot_survives_a_torn_last_line(tmp_path):
    _write(tmp_path / "metrics.jsonl", TORN[0])
    plot_loss(tmp_path / "metrics.jsonl", tmp_path / "loss.png")
    assert (tmp_path / "loss.png").stat().st_size > 0
