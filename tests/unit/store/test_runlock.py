"""The run directory's lock: a live train refuses a second writer; ranks probing at once do not."""

from __future__ import annotations

import pytest

from homelab_ft.errors import UserError
from homelab_ft.store import runlock
from homelab_ft.store.layout import RunDir


def test_probes_by_every_rank_at_once_do_not_refuse_each_other(tmp_path):
    lock = RunDir(tmp_path).lock_file
    lock.write_text("host vm pid 1 since 2026-12-02 16:59:43\n")  # copied from another run
    other_rank = runlock.try_lock(lock, shared=True)  # another rank's probe, at this moment
    assert other_rank is not None
    try:
        runlock.check_free(tmp_path)
    finally:
        runlock.unlock(other_rank)


def test_a_live_train_refuses_another_writer_and_names_it(tmp_path):
    runlock.acquire(tmp_path)
    try:
        with pytest.raises(UserError, match="in use by this process already"):
            runlock.check_free(tmp_path)
        fd = runlock._held.pop(tmp_path.resolve())  # as another process would see it
        try:
            with pytest.raises(UserError, match=r"in use by a running homelab-ft train \(host .* pid \d+"):
                runlock.check_free(tmp_path)
        finally:
            runlock._held[tmp_path.resolve()] = fd
    finally:
        runlock.release(tmp_path)
    runlock.check_free(tmp_path)  # free again
    assert RunDir(tmp_path).lock_file.read_text() == ""
