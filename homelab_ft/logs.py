"""Logging: library modules call `logging.getLogger(__name__)`; the CLI calls `configure` once.

Under torchrun every rank runs the same code, so a message logged below the CLI would appear once
per rank. A rank-zero filter (torchtune's `log_rank_zero`, as a filter so call sites stay plain
`log.info`) lets only rank 0 through, except records logged with `extra={"all_ranks": True}`
(a rank's own failure). Information goes to stdout like the tables the CLI prints; warnings and
errors go to stderr. `--quiet` also hides the progress bars, the libraries' with ours.
"""

from __future__ import annotations

import importlib
import logging
import os
import sys

ROOT = "homelab_ft"
QUIET, NORMAL, VERBOSE = -1, 0, 1
LIBRARY_BARS_ENV = ("HF_DATASETS_DISABLE_PROGRESS_BARS", "HF_HUB_DISABLE_PROGRESS_BARS")
"""datasets' switch (its tokenising `map` bars) and huggingface_hub's, which transformers' weight-loading
bar follows (`transformers.utils.logging` reads it when imported); both are read at import time."""
_hidden_by_us: set[str] = set()


class RankZeroFilter(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return os.environ.get("RANK", "0") == "0" or getattr(record, "all_ranks", False)


class _Below(logging.Filter):
    def __init__(self, level: int):
        super().__init__()
        self.level = level

    def filter(self, record: logging.LogRecord) -> bool:
        return record.levelno < self.level


class _CurrentStream(logging.StreamHandler):
    """Writes to whatever sys.stdout / sys.stderr is at the time of each record (pytest's capture,
    a redirected stream), not the object that was current when logging was configured."""

    def __init__(self, name: str):
        super().__init__(getattr(sys, name))
        self._name = name

    def emit(self, record: logging.LogRecord) -> None:
        self.stream = getattr(sys, self._name)
        super().emit(record)

    def handleError(self, record: logging.LogRecord) -> None:
        """A closed pipe (`homelab-ft train r.yaml | head`) is no logging fault to print a traceback
        for: it goes on to the CLI, which ends quietly as a print to the closed pipe would."""
        if isinstance(sys.exc_info()[1], BrokenPipeError):
            raise
        super().handleError(record)


class _Format(logging.Formatter):
    """Plain text for information (it reads like the rest of the output), a prefix otherwise."""

    def format(self, record: logging.LogRecord) -> str:
        message = record.getMessage()
        if record.levelno >= logging.WARNING:
            return f"{record.levelname.lower()}: {message}"
        if record.levelno < logging.INFO:
            return f"[{record.name}] {message}"
        return message


def configure(verbosity: int = NORMAL) -> None:
    """Route the project's loggers to stdout/stderr at the chosen level (idempotent: a second call,
    e.g. from a test calling `cli.main` again, replaces the handlers and binds the current streams)."""
    level = {QUIET: logging.WARNING, NORMAL: logging.INFO, VERBOSE: logging.DEBUG}[max(QUIET, min(VERBOSE, verbosity))]
    logger = logging.getLogger(ROOT)
    for handler in list(logger.handlers):
        logger.removeHandler(handler)
    out = _CurrentStream("stdout")
    out.addFilter(_Below(logging.WARNING))
    err = _CurrentStream("stderr")
    err.setLevel(logging.WARNING)
    for handler in (out, err):
        handler.setFormatter(_Format())
        handler.addFilter(RankZeroFilter())
        logger.addHandler(handler)
    logger.setLevel(level)
    logger.propagate = False
    _library_progress_bars(enabled=level <= logging.INFO)


def _library_progress_bars(*, enabled: bool) -> None:
    """Hide (or show again) the progress bars datasets, huggingface_hub and transformers draw.

    A library not imported yet reads the environment when it is imported, so the switch is set
    there (and reaches the processes this one starts); one already imported (a test calling
    `cli.main` twice) is told through its own function. A switch the user set is left alone.
    """
    if enabled and not _hidden_by_us:
        return
    for var in LIBRARY_BARS_ENV:
        if enabled and var in _hidden_by_us:
            os.environ.pop(var, None)
        elif not enabled and var not in os.environ:
            os.environ[var] = "1"
            _hidden_by_us.add(var)
    if enabled:
        _hidden_by_us.clear()
    switches = (("datasets", "datasets", "progress_bars"), ("huggingface_hub", "huggingface_hub.utils", "progress_bars"),
                ("transformers", "transformers.utils.logging", "progress_bar"))
    for package, module, name in switches:
        if package in sys.modules:
            getattr(importlib.import_module(module), f"{'enable' if enabled else 'disable'}_{name}")()


def info_enabled() -> bool:
    """Whether progress output is wanted (not --quiet); progress bars follow the log level."""
    return logging.getLogger(ROOT).isEnabledFor(logging.INFO)
