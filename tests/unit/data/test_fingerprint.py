"""data/fingerprint.py: what a run read, and the phrase that says how it changed."""

from __future__ import annotations

import pytest

from homelab_ft.data import fingerprint
from homelab_ft.errors import UserError
from homelab_ft.recipe.config import DataConfig, SourceConfig


def _cfg(*paths: str, **kw) -> DataConfig:
    return DataConfig(sources=[SourceConfig(path=p) for p in paths], **kw)


def test_files_sizes_hashes_and_settings(tmp_path):
    (tmp_path / "a.jsonl").write_text('{"text": "one"}\n')
    (tmp_path / "b.jsonl").write_text('{"text": "two"}\n')
    first = fingerprint.of(_cfg("*.jsonl"), base_dir=tmp_path)
    assert [f[0] for f in first["files"]] == [str(tmp_path / "a.jsonl"), str(tmp_path / "b.jsonl")]
    assert fingerprint.changes(first, fingerprint.of(_cfg("*.jsonl"), base_dir=tmp_path)) == []
    assert fingerprint.changes(first, fingerprint.of(_cfg("*.jsonl", cache_dir="elsewhere"), base_dir=tmp_path)) == []
    assert fingerprint.changes(first, fingerprint.of(_cfg("*.jsonl", max_length=64), base_dir=tmp_path)) == [
        "the data settings changed"]

    (tmp_path / "a.jsonl").write_text('{"text": "ONE"}\n')
    (tmp_path / "b.jsonl").write_text('{"text": "two, longer"}\n')
    (tmp_path / "c.jsonl").write_text('{"text": "three"}\n')
    said = fingerprint.changes(first, fingerprint.of(_cfg("*.jsonl"), base_dir=tmp_path))
    assert said == [f"{tmp_path / 'c.jsonl'} is new", f"{tmp_path / 'a.jsonl'} changed (same size, other bytes)",
                    f"{tmp_path / 'b.jsonl'} changed (16 -> 24 bytes)"]


def test_check_resume_refuses_allows_and_tolerates_old_checkpoints(tmp_path, caplog):
    (tmp_path / "a.jsonl").write_text('{"text": "one"}\n')
    old = fingerprint.of(_cfg("a.jsonl"), base_dir=tmp_path)
    (tmp_path / "a.jsonl").write_text('{"text": "one"}\n{"text": "two"}\n')
    new = fingerprint.of(_cfg("a.jsonl"), base_dir=tmp_path)
    with pytest.raises(UserError, match=r"--resume: the data differs .*a.jsonl changed \(16 -> 32 bytes\).*--allow-data-change"):
        fingerprint.check_resume(old, new, checkpoint=tmp_path / "step_2", allow_change=False)
    fingerprint.check_resume(old, new, checkpoint=tmp_path / "step_2", allow_change=True)
    fingerprint.check_resume(None, new, checkpoint=tmp_path / "step_2", allow_change=False)  # written before fingerprints
    fingerprint.check_resume(new, new, checkpoint=tmp_path / "step_2", allow_change=False)
