"""Where an export goes (export/target.py, store/staging.py) and the checkpoint it reads
(store/checkpoint.py's reader lock), without a model: folders made by hand."""

from __future__ import annotations

import logging
import os

import pytest

from homelab_ft.errors import UserError
from homelab_ft.export import target
from homelab_ft.store import checkpoint, manifest, runlock, staging


def _run_dir(path, *, files=("run.json",)):
    path.mkdir(parents=True)
    for name in files:
        (path / name).write_text("{}")
    return path


def test_out_refusals_name_the_run_and_the_fix(tmp_path):
    run = _run_dir(tmp_path / "runs" / "mine")
    for out, relation in ((run, "is"), (run / "exports" / "x", "is inside"), (tmp_path / "runs", "holds")):
        with pytest.raises(UserError) as err:
            target.check_out(out)
        line = str(err.value)
        assert f"--out {out} {relation} the homelab-ft run directory {run} (it holds run.json)" in line, line
        assert f"e.g. {tmp_path / 'runs' / 'mine-export'}" in line and len(line.splitlines()) == 1


def test_the_base_model_folder_is_never_an_out(tmp_path):
    base = tmp_path / "models" / "llama"
    base.mkdir(parents=True)
    for out, relation in ((base, "is"), (base / "merged", "is inside"), (tmp_path / "models", "holds")):
        with pytest.raises(UserError) as err:
            target.check_not_the_base(out, base)
        line = str(err.value)
        assert f"--out {out} {relation} the run's base model folder {base.resolve()}" in line, line
        assert f"e.g. {(tmp_path / 'models' / 'llama-finetuned').resolve()}" in line and len(line.splitlines()) == 1
    target.check_not_the_base(tmp_path / "models" / "llama-finetuned", base)  # beside it is fine


def test_a_checkpoint_copied_out_of_its_run_is_refused_too(tmp_path):
    ckpt = tmp_path / "saved"
    ckpt.mkdir()
    (ckpt / "trainer_state.json").write_text("{}")
    with pytest.raises(UserError, match="is the homelab-ft checkpoint .* trainer_state.json"):
        target.check_out(ckpt)


def test_a_project_folder_with_its_own_recipe_is_not_a_run(tmp_path):
    """recipe.yaml alone is what a user keeps beside their data: exporting below it is fine."""
    project = tmp_path / "project"
    _run_dir(project, files=("recipe.yaml",))
    target.check_out(project / "merged")
    _run_dir(project / "runs" / "a", files=("recipe.yaml", ".lock"))  # a run that died before its first step
    with pytest.raises(UserError, match="holds the homelab-ft run directory .*recipe.yaml"):
        target.check_out(project)


def test_lock_refuses_a_second_writer_and_leaves_no_file(tmp_path):
    out = tmp_path / "out"
    with staging.locked(out):
        with pytest.raises(UserError) as err, staging.locked(out):
            pass
        assert f"pid {os.getpid()}" in str(err.value) and "another homelab-ft export" in str(err.value)
    assert list(tmp_path.iterdir()) == []
    with staging.locked(out):  # free again
        pass


def test_sweep_removes_only_our_staging_folders(tmp_path, caplog):
    out = tmp_path / "out"
    killed = staging.create(out)
    (killed.root / staging.NEW).mkdir()
    (killed.root / staging.NEW / "model.safetensors").write_bytes(b"\0" * 5000)
    empty = tmp_path / f".out.{staging.TAG}-empty"  # killed between mkdir and the marker
    empty.mkdir()
    users = tmp_path / f".out.{staging.TAG}-mine"  # the pattern, but not ours: no marker
    users.mkdir()
    (users / "notes.txt").write_text("keep me")
    other = staging.create(tmp_path / "other")  # another --out's
    with caplog.at_level(logging.WARNING), staging.locked(out):
        freed = staging.sweep(out)
    assert freed >= 5000 and not killed.root.exists() and not empty.exists()
    assert (users / "notes.txt").read_text() == "keep me" and other.root.is_dir()
    assert f"removed {killed.root}" in caplog.text and "bytes freed" in caplog.text


def test_sweep_removes_an_older_versions_unfinished_export_only_with_proof(tmp_path, caplog):
    """Before the marked staging folders, a killed export left `.OUT.tmp-XXXXXXXX` (mkdtemp): swept
    when it holds a model's config and only the files an export writes, kept otherwise."""
    out = tmp_path / "out"
    older = tmp_path / ".out.tmp-a1b2c3d4"
    older.mkdir()
    (older / "config.json").write_text("{}")
    (older / "model.safetensors").write_bytes(b"\0" * 4000)
    (older / "tokenizer.json").write_text("{}")
    notes = tmp_path / ".out.tmp-notes123"  # the name, but a user's folder: no model config
    notes.mkdir()
    (notes / "todo.txt").write_text("keep me")
    mixed = tmp_path / ".out.tmp-mixed123"  # a config, but also a file no export writes
    mixed.mkdir()
    (mixed / "config.json").write_text("{}")
    (mixed / "thesis.docx").write_text("keep me")
    with caplog.at_level(logging.WARNING), staging.locked(out):
        freed = staging.sweep(out)
    assert freed >= 4000 and not older.exists()
    assert (notes / "todo.txt").read_text() == "keep me" and (mixed / "thesis.docx").read_text() == "keep me"
    assert f"removed {older}, an unfinished export an older homelab-ft left" in caplog.text
    assert staging.sweep_if_free(out) == 0  # nothing of ours left


def test_a_previous_out_caught_between_the_two_renames_goes_back(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "model.safetensors").write_bytes(b"old")
    stage = staging.create(out)
    os.rename(out, stage.root / staging.OLD)  # the first rename of swap(), then a SIGKILL
    with staging.locked(out):
        staging.sweep(out)
    assert (out / "model.safetensors").read_bytes() == b"old" and not stage.root.exists()


def test_swap_replaces_the_previous_out_only_when_complete(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "a").write_text("old")
    stage = staging.create(out)
    stage.new.mkdir()
    (stage.new / "a").write_text("new")
    stage.swap()
    assert (out / "a").read_text() == "new" and [p.name for p in tmp_path.iterdir()] == ["out"]


def _fake_checkpoints(root, steps):
    for step in steps:
        path = root / f"step_{step:06d}"
        path.mkdir(parents=True)
        (path / manifest.NAME).write_text("{}")
    return root


def test_pruning_skips_a_checkpoint_an_export_reads(tmp_path, caplog):
    root = _fake_checkpoints(tmp_path / "checkpoints", (1, 2, 3))
    fd = runlock.try_lock(root / "step_000001" / manifest.NAME, shared=True, create=False)
    try:
        with caplog.at_level(logging.INFO):
            checkpoint._prune(root, keep_last=1)
    finally:
        runlock.unlock(fd)
    assert sorted(p.name for p in root.iterdir()) == ["step_000001", "step_000003"]
    assert "kept step_000001 past train.keep_last: an export is reading it" in caplog.text
    checkpoint._prune(root, keep_last=1)  # the next save, once the export is done
    assert [p.name for p in root.iterdir()] == ["step_000003"]


def test_sigint_mid_export_removes_the_staging_folder(tmp_path):
    import signal

    from homelab_ft.errors import Stopped

    out = tmp_path / "out"
    before = signal.getsignal(signal.SIGINT)  # Python's default; SIG_IGN in an xdist worker
    with pytest.raises(Stopped) as err, target.writing(out) as writing:
        (writing.begin() / "model.safetensors").write_bytes(b"\0" * 100)
        os.kill(os.getpid(), signal.SIGINT)
        for _ in range(1000):  # the handler runs between bytecodes of the main thread
            pass
        raise AssertionError("the signal did not stop the export")
    assert err.value.exit_code == 130 and str(err.value) == f"SIGINT during export: removed the unfinished export; {out} was not written"
    assert list(tmp_path.iterdir()) == []
    assert signal.getsignal(signal.SIGINT) is before  # restored


def test_a_signal_after_commit_waits_for_the_export(tmp_path):
    import signal

    out = tmp_path / "out"
    with target.writing(out) as writing:
        (writing.begin() / "config.json").write_text("{}")
        writing.commit()
        os.kill(os.getpid(), signal.SIGTERM)
        for _ in range(1000):
            pass
    assert [p.name for p in tmp_path.iterdir()] == ["out"] and (out / "config.json").is_file()


def _library_call(*, then):
    """A C extension calling back into Python while the signal arrives: it turns the handler's
    exception into its own (safetensors' load_file raised ValueError) or drops it."""
    import signal

    try:
        os.kill(os.getpid(), signal.SIGTERM)
        for _ in range(1000):
            pass
    except BaseException:
        if then == "raise":
            raise ValueError("could not determine the shape of object type 'torch.storage.UntypedStorage'") from None


@pytest.mark.parametrize("then", ["raise", "drop"])
def test_a_signal_a_library_mangles_or_drops_still_stops_the_export(tmp_path, then):
    from homelab_ft.errors import Stopped

    out = tmp_path / "out"
    with pytest.raises(Stopped) as err, target.writing(out) as writing:
        (writing.begin() / "model.safetensors").write_bytes(b"\0" * 100)
        _library_call(then=then)
        writing.commit()
    assert err.value.exit_code == 143 and str(err.value).startswith("SIGTERM during export")
    assert list(tmp_path.iterdir()) == []
