"""The one error type for user mistakes.

Anything the user can fix (a recipe key, a path, a dataset row, a cluster flag) raises
`UserError` with a message that says what to change. The CLI prints it on one line and exits 2;
tracebacks are reserved for our own bugs.
"""

from __future__ import annotations


class UserError(Exception):
    """A mistake in the user's input; the message names the file/key and the fix."""

    exit_code = 2
    label = "error"
    """The word the CLI prints before the message."""


class Stopped(UserError):
    """The run stopped on a signal after saving what it could; exit 128 + the signal's number
    (143 for SIGTERM, 130 for SIGINT), as a shell reports a process the signal ended."""

    label = "stopped"

    def __init__(self, message: str, *, signum: int):
        super().__init__(message)
        self.exit_code = 128 + signum


class Diverged(UserError):
    """The run reached a step whose loss or gradient norm is not finite (train/divergence.py): the
    step was not applied, the checkpoints before it are kept, and the settings that usually cause it
    are named. Exit 3: neither refused input (2, nothing started) nor a signal (128 + N) nor our own
    bug (a traceback, exit 1), so a script can tell "lower the learning rate and resume" apart."""

    exit_code = 3
    label = "diverged"
