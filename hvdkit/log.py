"""hvdkit's log: one format, results on stdout, diagnostics on stderr, rank 0 unless asked.

Two loggers under ``hvdkit``:

- ``hvdkit.result`` (:func:`result`): what a run produced, the lines people and scripts read
  (epoch loss, throughput, the closing ``done:`` line) -> **stdout**;
- ``hvdkit`` (:func:`diag`, :func:`warn`, :func:`debug`): set-up, resume, checkpoints,
  elastic resets, warnings -> **stderr**.

Every line is ``[hvdkit] message`` (``[hvdkit r3] message`` from a rank other than 0). At the
default level INFO only global rank 0 speaks, as every side effect in hvdkit is rank 0's;
a record made with ``every_rank=True`` (facts about each rank, such as an elastic worker's
pid) passes on every rank. ``--log-level DEBUG`` lets every rank log everything.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable

__all__ = ["LEVELS", "configure", "result", "diag", "warn", "debug"]

LEVELS = ("DEBUG", "INFO", "WARNING")
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
        self.addFilter(_RankFilter())

    def emit(self, record: logging.LogRecord) -> None:
        try:
            stream = getattr(sys, self.stream_name)
            stream.write(self.format(record) + "\n")
            stream.flush()
        except Exception:  # noqa: BLE001 - logging's own policy for a failing handler
            self.handleError(record)


def configure(level: str = "INFO", rank: Callable[[], int] | None = None) -> None:
    """Set the level and how to learn this process's rank (a callable: elastic ranks change)."""
    global _rank
    if level.upper() not in LEVELS:
        raise ValueError(f"log level {level!r} is not one of {', '.join(LEVELS)}")
    if rank is not None:
        _rank = rank
    _DIAG.setLevel(level.upper())
    if not _DIAG.handlers:
        _DIAG.addHandler(_Live("stderr"))
        _DIAG.propagate = False
        _RESULT.addHandler(_Live("stdout"))
        _RESULT.propagate = False  # not also to the stderr handler of its parent


def result(msg: str) -> None:
    """A result line (stdout)."""
    configure_once()
    _RESULT.info(msg)


def diag(msg: str, every_rank: bool = False) -> None:
    """A diagnostic line (stderr)."""
    configure_once()
    _DIAG.info(msg, extra={"every_rank": every_rank})


def warn(msg: str, every_rank: bool = False) -> None:
    """``WARNING: msg`` (stderr)."""
    configure_once()
    _DIAG.warning(f"WARNING: {msg}", extra={"every_rank": every_rank})


def debug(msg: str) -> None:
    """Only with ``--log-level DEBUG``, from every rank (stderr)."""
    configure_once()
    _DIAG.debug(msg)


def configure_once() -> None:
    if not _DIAG.handlers:
        configure(logging.getLevelName(_DIAG.level) if _DIAG.level else "INFO")
