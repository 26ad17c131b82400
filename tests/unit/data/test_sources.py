"""data/sources.py's path resolution: globs that meet symlink loops end (`**` through one hung)."""

from __future__ import annotations

import os

import pytest

from homelab_ft.data.sources import resolve_files


def _tree(tmp_path):
    """d/a.jsonl, d/sub/b.jsonl, d/sub/.hidden.jsonl, and two loops: d/sub/up -> d, d/self -> d."""
    d = tmp_path / "d"
    (d / "sub").mkdir(parents=True)
    for path in (d / "a.jsonl", d / "sub" / "b.jsonl", d / "sub" / ".hidden.jsonl"):
        path.write_text('{"text": "x"}\n')
    os.symlink(d, d / "sub" / "up")
    os.symlink(".", d / "self")
    return d


@pytest.mark.timeout(20)
def test_double_star_through_symlink_loops_ends_with_each_file(tmp_path):
    d = _tree(tmp_path)
    found = resolve_files("d/**/*.jsonl", base_dir=tmp_path, where="data.sources[0]")
    # the real files, each once, plus one pass through each link before the loop is cut; no hidden file
    real = {os.path.realpath(p) for p in found}
    assert real == {str(d / "a.jsonl"), str(d / "sub" / "b.jsonl")}
    assert str(d / "a.jsonl") in map(str, found) and str(d / "sub" / "b.jsonl") in map(str, found)
    assert len(found) <= 6


@pytest.mark.timeout(20)
def test_glob_matches_what_glob_glob_does_without_loops(tmp_path):
    import glob

    d = tmp_path / "d"
    for rel in ("a.jsonl", "x/b.jsonl", "x/y/c.csv", "x/y/z.txt", "w/.h/e.jsonl", "w/f.parquet"):
        (d / rel).parent.mkdir(parents=True, exist_ok=True)
        (d / rel).write_text("{}\n")
    os.symlink(d / "x", d / "w" / "link")  # a link that is not a loop is followed, as glob does
    for pattern in ("d/**/*.jsonl", "d/**", "d/*/*", "d/x/**/*.csv", "d/*.jsonl", "d/w/link/**/*"):
        suffixes = (".jsonl", ".json", ".csv", ".parquet")
        want = sorted(p for p in glob.glob(str(tmp_path / pattern), recursive=True) if p.endswith(suffixes))
        got = [str(p) for p in resolve_files(pattern, base_dir=tmp_path, where="w")] if want else []
        assert got == sorted(set(want)), pattern


@pytest.mark.timeout(20)
def test_folder_source_with_a_symlink_loop_ends(tmp_path):
    d = _tree(tmp_path)
    found = resolve_files("d", base_dir=tmp_path, where="data.sources[0]")
    assert {os.path.realpath(p) for p in found} >= {str(d / "a.jsonl"), str(d / "sub" / "b.jsonl")}
