"""Stopping a run on SIGTERM / SIGINT without losing it.

Without this, SIGTERM (`docker stop`, systemd, a scheduler's preemption, `kill`) ended a run in
0.16 s with no message and no checkpoint, and Ctrl-C lost everything since the last save. Here
the signal only sets a flag; the loop looks at it after each optimizer step, all ranks agree
through one all-reduce (8 bytes per step: a rank that got no signal, or got it a step later,
stops at the same step as the others, or the next save would deadlock), then the loop writes a
checkpoint and raises `errors.Stopped`.

A second signal stops at once (KeyboardInterrupt, no checkpoint) for a step that will not end.
A second one within `SAME_REQUEST_S` of the first counts as the same request: Ctrl-C in a
terminal reaches every process of the job, and torchrun then forwards its own copy to workers.
"""

from __future__ import annotations

import logging
import signal
import threading
import time

log = logging.getLogger(__name__)

SIGNALS = (signal.SIGTERM, signal.SIGINT)
SAME_REQUEST_S = 3.0

_active: list[StopRequest] = []
"""The request whose handlers are installed (signals are per process, so is this)."""


def requested() -> int:
    """The signal that asked this process to stop, or 0."""
    return _active[-1].signum if _active else 0


class StopRequest:
    """Context manager around the training loop; `signum` is 0 until a stop is requested."""

    def __init__(self, *, announce: bool = True):
        self.signum = 0
        self._at = 0.0
        self._announce = announce
        self._previous: dict[int, object] = {}

    def __enter__(self) -> StopRequest:
        if threading.current_thread() is threading.main_thread():  # handlers only install there
            for sig in SIGNALS:
                self._previous[sig] = signal.signal(sig, self._handle)
        _active.append(self)
        return self

    def __exit__(self, *exc) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()
        _active.remove(self)

    def _handle(self, signum: int, _frame) -> None:
        now = time.monotonic()
        if self.signum and now - self._at > SAME_REQUEST_S:
            raise KeyboardInterrupt
        if not self.signum:
            self.signum, self._at = signum, now
            if self._announce:
                log.warning("%s received: stopping after the step in progress (send it again to stop at once)",
                            signal.Signals(signum).name)


def wait_for_request(*, seconds: float) -> int:
    """Wait up to `seconds` for a stop request (torchrun signals the surviving ranks within its
    0.1 s monitor interval of a rank's death); returns the signal or 0."""
    deadline = time.monotonic() + seconds
    while not requested() and time.monotonic() < deadline:
        time.sleep(0.05)
    return requested()


def name(signum: int) -> str:
    return signal.Signals(signum).name
