"""Preemption: turn SIGUSR1/SIGTERM into "finish this step, checkpoint, requeue".

Slurm sends the signal named by ``#SBATCH --signal=USR1@90`` to every task
some seconds before the time limit, and SIGTERM when a job is preempted or
cancelled. The handler only records the signal; the training loop polls
:attr:`PreemptionGuard.requested` once per step and all ranks agree through
``backend.any_true`` so that they stop at the same step.
"""

from __future__ import annotations

import os
import signal
import subprocess
import threading
import time
from types import FrameType
from typing import Any

from .log import diag

__all__ = ["PreemptionGuard", "catch_early", "requeue_slurm_job", "EXIT_PREEMPTED", "STOP_FILE_VAR"]

# Exit status of a run that stopped early on a signal (checkpoint saved) and was NOT
# requeued: non-zero, so Slurm does not report COMPLETED for unfinished work.
# 75 is EX_TEMPFAIL in sysexits.h: "try again later" (the checkpoint makes that cheap).
EXIT_PREEMPTED = 75

REQUEUE_SIGNALS = (signal.SIGUSR1,)
STOP_SIGNALS = (signal.SIGUSR1, signal.SIGTERM)


# A file whose appearance means SIGUSR1, for ranks no signal can reach: an elastic job's
# workers are started by horovodrun over ssh, not by Slurm, so the batch shell traps the
# signal and creates this file instead (see slurm/_header.sbatch).
STOP_FILE_VAR = "HVDKIT_STOP_FILE"
_STOP_FILE_POLL_S = 1.0


# USR1s that arrived while no guard was active: during set-up, between an elastic reset and
# the loop's re-entry, or after the last step. Slurm sends USR1 at a fixed time before the
# limit whatever the run is doing, and its default action kills the process (exit 138, the
# job FAILED), so once training has started hvdkit never leaves it at the default.
_pending: list[int] = []


def _remember(signum: int, frame: FrameType | None) -> None:
    _pending.append(signum)


def catch_early() -> None:
    """From now on a USR1 outside a :class:`PreemptionGuard` is remembered, not fatal; the
    next guard acts on it at its first step. (Main thread only; elsewhere a no-op.)"""
    if threading.current_thread() is not threading.main_thread():
        return
    for sig in REQUEUE_SIGNALS:
        if signal.getsignal(sig) in (signal.SIG_DFL, None):
            signal.signal(sig, _remember)


class PreemptionGuard:
    """Context manager installing handlers for USR1/TERM on the main thread.

    With ``stop_file`` (default: ``$HVDKIT_STOP_FILE``) the file's appearance counts as
    SIGUSR1; it is looked for at most once a second.
    """

    def __init__(self, signals: tuple[signal.Signals, ...] = STOP_SIGNALS,
                 stop_file: str | None = None) -> None:
        self.signals = signals
        self.received: int | None = None
        self._previous: dict[int, Any] = {}
        self.stop_file = stop_file if stop_file is not None else os.environ.get(STOP_FILE_VAR) or None
        self._next_look = 0.0

    def _handler(self, signum: int, frame: FrameType | None) -> None:
        self.received = signum

    @property
    def requested(self) -> bool:
        """True once one of the signals arrived in this process (or the stop file appeared)."""
        if self.received is None and self.stop_file and time.monotonic() >= self._next_look:
            self._next_look = time.monotonic() + _STOP_FILE_POLL_S
            if os.path.exists(self.stop_file):
                self.received = signal.SIGUSR1
        return self.received is not None

    @property
    def should_requeue(self) -> bool:
        """USR1 means "time is almost up, come back later"; TERM means "stop"."""
        return self.received in REQUEUE_SIGNALS

    def __enter__(self) -> PreemptionGuard:
        for sig in self.signals:
            self._previous[sig] = signal.signal(sig, self._handler)
        early = [sig for sig in _pending if sig in self.signals]
        _pending.clear()
        if early:
            self.received = early[0]
        return self

    def __exit__(self, *exc: Any) -> None:
        for sig, previous in self._previous.items():
            signal.signal(sig, previous)
        self._previous.clear()


def requeue_slurm_job(environ: dict[str, str] | None = None) -> str:
    """Ask Slurm to requeue this job; returns a one-line outcome for the log.

    Uses ``SLURM_ARRAY_JOB_ID_SLURM_ARRAY_TASK_ID`` for array tasks. Never raises:
    a job that cannot be requeued still has its checkpoint.
    """
    env = dict(os.environ if environ is None else environ)
    job = env.get("SLURM_JOB_ID")
    if not job:
        return "not running under Slurm: not requeued"
    if env.get("SLURM_ARRAY_JOB_ID") and env.get("SLURM_ARRAY_TASK_ID"):
        job = f"{env['SLURM_ARRAY_JOB_ID']}_{env['SLURM_ARRAY_TASK_ID']}"
    try:
        proc = subprocess.run(
            ["scontrol", "requeue", job], capture_output=True, text=True, timeout=60, check=False
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"scontrol requeue {job} failed ({exc}); resubmit the job by hand"
    if proc.returncode != 0:
        detail = (proc.stderr or proc.stdout).strip().splitlines()
        return f"scontrol requeue {job} failed: {detail[0] if detail else proc.returncode}"
    diag(f"requeued Slurm job {job}")
    return f"requeued Slurm job {job}"
