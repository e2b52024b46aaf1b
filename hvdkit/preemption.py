"""Preemption: turn a signal into "finish this step, agree, checkpoint, requeue, exit".

Slurm sends the signal named by ``#SBATCH --signal=USR1@90`` to every task some seconds
before the time limit, and SIGTERM when a job is preempted or cancelled. :class:`Preemption`
is the whole protocol in one piece, for ``hvdkit train`` and for your own loop::

    preemption = Preemption(backend, checkpoint=ckpt, states=states)   # signals caught from here
    with preemption:
        for step in ...:
            ...                                   # forward, backward, optimizer.step()
            preemption.check(step)                # collective: every rank stops at the same step

When any rank got the signal, :meth:`Preemption.check` saves a checkpoint of ``states`` at
that step (collective), asks Slurm to requeue the job (USR1/USR2 under Slurm, rank 0), and
raises :class:`Preempted`, a ``SystemExit`` whose code is 0 when the job was requeued and
:data:`EXIT_PREEMPTED` (75) when not, so unfinished work never looks COMPLETED to Slurm.

USR1 and USR2 mean "time is almost up, come back later" (sites pick one; the sbatch scripts
forward both); TERM means "stop" (checkpoint, no requeue). The handlers only record the
signal; the agreement (one small allreduce per step, started before the forward pass by
``hvdkit train`` so that it overlaps compute) keeps the ranks in step.
"""

from __future__ import annotations

import os
import signal
import subprocess
import threading
from collections.abc import Callable
from types import FrameType
from typing import TYPE_CHECKING, Any

from .launch.vocabulary import STOP_FILE_VAR  # the sbatch header sets it (elastic jobs)
from .log import diag, result

if TYPE_CHECKING:
    import torch

    from .backends.base import Backend
    from .checkpoint import CheckpointManager

__all__ = ["Preemption", "Preempted", "PreemptionGuard", "catch_early", "pending_stop", "requeue_slurm_job",
           "EXIT_PREEMPTED", "STOP_FILE_VAR", "REQUEUE_SIGNALS", "STOP_SIGNALS"]

# Exit status of a run that stopped early on a signal (checkpoint saved) and was NOT
# requeued: non-zero, so Slurm does not report COMPLETED for unfinished work.
# 75 is EX_TEMPFAIL in sysexits.h: "try again later" (the checkpoint makes that cheap).
EXIT_PREEMPTED = 75

REQUEUE_SIGNALS = (signal.SIGUSR1, signal.SIGUSR2)
STOP_SIGNALS = (signal.SIGUSR1, signal.SIGUSR2, signal.SIGTERM)


# A file whose appearance means SIGUSR1, for ranks no signal can reach or should: an elastic
# job's workers are started by horovodrun over ssh, not by Slurm, so the batch shell traps the
# signal and creates this file instead (see slurm/_header.sbatch); hvdkit run and the Ray
# launcher use one so that a rank still starting up is never killed by a signal. It is looked
# for once per step (one stat, the allreduce of the flag costs far more), so every rank held
# at the same point sees it at the same step.


# Signals that arrived while no guard was active: during set-up, between an elastic reset and
# the loop's re-entry, or after the last step. Slurm sends USR1 at a fixed time before the
# limit whatever the run is doing, and its default action kills the process (exit 138, the
# job FAILED), so once training has started hvdkit never leaves it at the default.
_pending: list[int] = []


def _remember(signum: int, frame: FrameType | None) -> None:
    _pending.append(signum)


def catch_early() -> None:
    """From now on a USR1/USR2 outside a :class:`PreemptionGuard` is remembered, not fatal; the
    next guard acts on it at its first step. (Main thread only; elsewhere a no-op.)"""
    if threading.current_thread() is not threading.main_thread():
        return
    for sig in REQUEUE_SIGNALS:
        if signal.getsignal(sig) in (signal.SIG_DFL, None):
            signal.signal(sig, _remember)


def pending_stop() -> int | None:
    """The first USR1/USR2 :func:`catch_early` remembered in this process (not consumed), if any:
    a launcher asked to stop before it started its ranks starts none."""
    return next((sig for sig in _pending if sig in REQUEUE_SIGNALS), None)


class PreemptionGuard:
    """Context manager installing handlers for USR1/USR2/TERM on the main thread.

    With ``stop_file`` (default: ``$HVDKIT_STOP_FILE``) the file's appearance counts as
    SIGUSR1; it is looked for each time :attr:`requested` is asked (once per step).
    """

    def __init__(self, signals: tuple[signal.Signals, ...] = STOP_SIGNALS,
                 stop_file: str | None = None) -> None:
        self.signals = signals
        self.received: int | None = None
        self._previous: dict[int, Any] = {}
        self.stop_file = stop_file if stop_file is not None else os.environ.get(STOP_FILE_VAR) or None

    def _handler(self, signum: int, frame: FrameType | None) -> None:
        self.received = signum

    @property
    def requested(self) -> bool:
        """True once one of the signals arrived in this process (or the stop file appeared)."""
        if self.received is None and self.stop_file and os.path.exists(self.stop_file):
            self.received = signal.SIGUSR1
        return self.received is not None

    @property
    def should_requeue(self) -> bool:
        """USR1/USR2 mean "time is almost up, come back later"; TERM means "stop"."""
        return self.received in REQUEUE_SIGNALS

    def __enter__(self) -> PreemptionGuard:
        if threading.current_thread() is not threading.main_thread():
            return self  # signal handlers can only be installed on the main thread
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


class Preempted(SystemExit):
    """Raised by :meth:`Preemption.check` after the checkpoint: exit code 0 when Slurm
    requeued the job, :data:`EXIT_PREEMPTED` otherwise. Catch it to clean up, or let it end
    the process with the right status."""

    def __init__(self, step: int, signal_name: str, requeued: bool, outcome: str, saved: bool) -> None:
        super().__init__(0 if requeued else EXIT_PREEMPTED)
        self.step, self.signal_name, self.requeued = step, signal_name, requeued
        self.outcome, self.saved = outcome, saved


class Preemption:
    """Signals -> one agreed stop step -> checkpoint -> Slurm requeue -> :class:`Preempted`.

    ``checkpoint`` and ``states``: what to save when stopping (no checkpoint without them);
    or ``on_stop(step)``, a collective function of yours that saves. ``requeue``: ask Slurm
    to requeue on USR1/USR2 (``--no-requeue``: exit 75 instead). ``log``: where rank 0 says
    what happened (hvdkit's result stream by default).
    """

    def __init__(self, backend: Backend, checkpoint: CheckpointManager | None = None,
                 states: dict[str, Any] | None = None, requeue: bool = True,
                 log: Callable[[str], None] = result,
                 on_stop: Callable[[int], Any] | None = None) -> None:
        if (checkpoint is None) != (states is None):
            raise ValueError("pass checkpoint and states together (or neither)")
        catch_early()  # a signal from now on is never fatal, even before the loop
        self.backend, self.requeue, self.log = backend, requeue, log
        if on_stop is None and checkpoint is not None and states is not None:
            on_stop = lambda step: checkpoint.save(step, states)  # noqa: E731
        self.on_stop = on_stop
        self.guard = PreemptionGuard()

    def __enter__(self) -> Preemption:
        self.guard.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.guard.__exit__(*exc)

    @property
    def requested(self) -> bool:
        """This rank got a signal (not yet agreed with the others)."""
        return self.guard.requested

    def begin(self, *flags: bool | torch.Tensor) -> Callable[[], list[bool]]:
        """Start the agreement now (asynchronously), with ``flags`` of your own riding along;
        the returned function waits for it: ``[stop, *flags]``, each true if true on any rank."""
        return self.backend.start_any_flags([self.guard.requested, *flags])

    def check(self, step: int, agreed: bool | None = None) -> None:
        """Collective, once per step on every rank: stop here if any rank got a signal.

        ``agreed``: the answer of :meth:`begin` when you started the agreement yourself
        (otherwise it is made now, blocking). Returns when nobody got one; otherwise saves,
        requeues and raises :class:`Preempted`.
        """
        stop = self.backend.any_true(self.guard.requested) if agreed is None else agreed
        if stop:
            self.stop(step)

    def stop(self, step: int) -> None:
        """Collective: checkpoint at ``step``, requeue under Slurm, raise :class:`Preempted`."""
        backend = self.backend
        saved = self.on_stop is not None
        if self.on_stop is not None:
            self.on_stop(step)
        requeue = backend.any_true(self.guard.should_requeue) and self.requeue
        received = int(backend.allreduce_metric(self.guard.received or 0, op="max"))
        done, outcome = requeue_slurm_job() if requeue and backend.is_master else \
            (False, "requeue asked by rank 0" if requeue else "not requeued")
        requeued = bool(backend.broadcast_object(done if backend.is_master else None, 0))
        name = signal.Signals(received).name if received else "signal"
        if backend.is_master:
            self.log(f"preempted at step {step} by {name}; "
                     f"{'checkpoint saved' if saved else 'no checkpoint dir'}; {outcome}")
        raise Preempted(step, name, requeued, outcome, saved)


def requeue_slurm_job(environ: dict[str, str] | None = None) -> tuple[bool, str]:
    """Ask Slurm to requeue this job; returns whether it was requeued, and one line for the log.

    Uses ``SLURM_ARRAY_JOB_ID_SLURM_ARRAY_TASK_ID`` for array tasks. Never raises:
    a job that cannot be requeued still has its checkpoint.
    """
    env = dict(os.environ if environ is None else environ)
    job = env.get("SLURM_JOB_ID")
    if not job:
        return False, "not running under Slurm: not requeued"
    if env.get("SLURM_ARRAY_JOB_ID") and env.get("SLURM_ARRAY_TASK_ID"):
        job = f"{env['SLURM_ARRAY_JOB_ID']}_{env['SLURM_ARRAY_TASK_ID']}"
    try:
        proc = subprocess.run(
            ["scontrol", "requeue", job], capture_output=True, text=True, timeout=60, check=False
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        return False, f"scontrol requeue {job} failed ({exc}); resubmit the job by hand"
    if proc.returncode == -signal.SIGTERM and _restarted(job, env):
        # the requeue it asked for TERMs the job's steps, scontrol among them, sometimes before
        # scontrol has exited 0 (seen on a loaded machine): Slurm's restart count says it took
        diag(f"requeued Slurm job {job} (scontrol was stopped by the requeue itself)")
        return True, f"requeued Slurm job {job}"
    if proc.returncode != 0:
        detail = (proc.stderr or proc.stdout).strip().splitlines()
        return False, f"scontrol requeue {job} failed: {detail[0] if detail else proc.returncode}"
    diag(f"requeued Slurm job {job}")
    return True, f"requeued Slurm job {job}"


def _restarted(job: str, env: dict[str, str]) -> bool:
    """Whether Slurm counts more restarts of ``job`` than this run started with
    (``SLURM_RESTART_COUNT``): its requeue has taken effect. False when that cannot be read."""
    try:
        proc = subprocess.run(["scontrol", "show", "job", "-o", job], capture_output=True, text=True, timeout=30,
                              check=False)
        counts = [int(f.split("=", 1)[1]) for f in proc.stdout.split() if f.startswith("Restarts=")]
        return bool(counts) and counts[0] > int(env.get("SLURM_RESTART_COUNT") or 0)
    except (OSError, ValueError, subprocess.TimeoutExpired):
        return False
