"""hvdkit's log: one format, results on stdout, diagnostics on stderr, rank 0 unless asked.

Two loggers under ``hvdkit``:

- ``hvdkit.result`` (:func:`result`): what a run produced, the lines people and scripts read
  (epoch loss, throughput, the closing ``done:`` line) -> **stdout**;
- ``hvdkit`` (:func:`diag`, :func:`warn`, :func:`debug`): set-up, resume, checkpoints,
  elastic resets, warnings -> **stderr**.

As a library hvdkit leaves your logging alone: its loggers have only a ``NullHandler`` and
propagate to yours, as the standard library's guidance for libraries asks. The ``hvdkit``
command (and ``python -m hvdkit``) is an application and installs its console handlers with
:func:`install_console`: every line is ``[hvdkit] message`` (``[hvdkit r3] message`` from a
rank other than 0). Either way, at the default level INFO only global rank 0's records pass
(a filter on the loggers themselves); a record made with ``every_rank=True`` (facts about
each rank, such as an elastic worker's pid) passes on every rank, and ``--log-level DEBUG``
lets every rank log everything.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable

from .config import LOG_LEVELS

__all__ = ["LEVELS", "configure", "install_console", "result", "diag", "warn", "debug"]

LEVELS = LOG_LEVELS
_DIAG = logging.getLogger("hvdkit")
_RESULT = logging.getLogger("hvdkit.result")
_rank: Callable[[], int] = lambda: 0  # noqa: E731 - replaced by configure()


class _Format(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        rank = _rank()
        return f"[hvdkit{f' r{rank}' if rank else ''}] {record.getMessage()}"


class _RankFilter(logging.Filter):
    """Rank 0's records, records marked every_rank, and at DEBUG everything."""

    def filter(self, record: logging.LogRecord) -> bool:
        return (_rank() == 0 or getattr(record, "every_rank", False)
                or _DIAG.getEffectiveLevel() <= logging.DEBUG)


class _Live(logging.Handler):
    """Writes to ``sys.stdout``/``sys.stderr`` as they are at each record (not as they were
    when configured), so redirected or captured streams are honoured; flushes every line."""

    def __init__(self, stream_name: str) -> None:
        super().__init__()
        self.stream_name = stream_name
        self.setFormatter(_Format())

    def emit(self, record: logging.LogRecord) -> None:
        try:
            stream = getattr(sys, self.stream_name)
            stream.write(self.format(record) + "\n")
            stream.flush()
        except Exception:  # logging's own policy for a failing handler
            self.handleError(record)


_DIAG.addHandler(logging.NullHandler())
for _logger in (_DIAG, _RESULT):
    _logger.addFilter(_RankFilter())


def configure(level: str = "INFO", rank: Callable[[], int] | None = None) -> None:
    """Set hvdkit's level and how to learn this process's rank (a callable: elastic ranks change).

    Touches only hvdkit's own loggers.
    """
    global _rank
    if level.upper() not in LEVELS:
        raise ValueError(f"log level {level!r} is not one of {', '.join(LEVELS)}")
    if rank is not None:
        _rank = rank
    _DIAG.setLevel(level.upper())


def install_console() -> None:
    """The ``hvdkit`` command's console: results to stdout, diagnostics to stderr, one format.

    For hvdkit's own processes only (it stops hvdkit's records from propagating further).
    """
    if any(isinstance(h, _Live) for h in _DIAG.handlers):
        return
    _DIAG.addHandler(_Live("stderr"))
    _DIAG.propagate = False
    _RESULT.addHandler(_Live("stdout"))
    _RESULT.propagate = False  # not also to the stderr handler of its parent
    if _DIAG.level == logging.NOTSET:
        _DIAG.setLevel(logging.INFO)


def result(msg: str) -> None:
    """A result line (stdout)."""
    _RESULT.info(msg)


def diag(msg: str, every_rank: bool = False) -> None:
    """A diagnostic line (stderr)."""
    _DIAG.info(msg, extra={"every_rank": every_rank})


def warn(msg: str, every_rank: bool = False) -> None:
    """``WARNING: msg`` (stderr)."""
    _DIAG.warning(f"WARNING: {msg}", extra={"every_rank": every_rank})


def debug(msg: str) -> None:
    """Only with ``--log-level DEBUG``, from every rank (stderr)."""
    _DIAG.debug(msg)
