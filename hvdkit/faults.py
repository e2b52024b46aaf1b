"""Hold points: named places where a run can be made to wait, so that a fault (a signal, a
SIGKILL, a lost node) lands exactly there instead of wherever a timer happens to fire.

``HVDKIT_HOLD=NAME`` or ``NAME:N`` makes the process wait the N-th time (1-based; every time
without ``:N``) it reaches the point called NAME, after printing one line
``[hvdkit] holding at NAME N (pid P)`` to stderr. It waits until the file named by
``HVDKIT_HOLD_RELEASE`` exists, or with ``HVDKIT_HOLD_RELEASE=signal`` until a signal handler
has run in this process or its stop file appeared (a preemption has certainly arrived), with
``HVDKIT_HOLD_RELEASE=stop-file`` until ``$HVDKIT_STOP_FILE`` exists (the launcher has asked
the ranks to stop), or forever without one
(to be killed there). Signals are still handled while it waits. Unset, a hold point costs one dictionary lookup.

Points: ``setup`` (the start of ``hvdkit train``, before the ranks meet), ``launch`` (``hvdkit
run``, its signal handlers in place, before it starts the ranks), ``step`` (before each
optimizer step of ``hvdkit train``; N is the global step number, counted from 1, so a resumed
run does not hold again) and ``checkpoint-write`` (half-way through writing a checkpoint's
temporary file).
"""

from __future__ import annotations

import os
import sys
import time
from collections import Counter
from collections.abc import Callable

__all__ = ["HOLD_VAR", "RELEASE_VAR", "hold_point"]

HOLD_VAR = "HVDKIT_HOLD"
RELEASE_VAR = "HVDKIT_HOLD_RELEASE"
_reached: Counter[str] = Counter()


def hold_point(name: str, at: int | None = None) -> None:
    """Wait here if ``HVDKIT_HOLD`` names this point and this is its N-th time (or, given
    ``at``, the point's own number is N: a step number, the same after a resume)."""
    spec = os.environ.get(HOLD_VAR)
    if not spec:
        return
    want, _, nth = spec.partition(":")
    if want != name:
        return
    _reached[name] += 1
    number = _reached[name] if at is None else at
    if nth and number != int(nth):
        return
    release = os.environ.get(RELEASE_VAR)
    if release == "stop-file":  # until the launcher asks the ranks to stop (a preemption in start-up)
        from .launch.vocabulary import STOP_FILE_VAR

        release = os.environ.get(STOP_FILE_VAR)
    if release == "signal":
        _hold_until_a_handler_ran(f"[hvdkit] holding at {name} {number} (pid {os.getpid()})\n")
        return
    sys.stderr.write(f"[hvdkit] holding at {name} {number} (pid {os.getpid()})\n")
    sys.stderr.flush()
    while not (release and os.path.exists(release)):
        time.sleep(0.02)


def _hold_until_a_handler_ran(line: str) -> None:
    """Print ``line``, then wait until one of this process's signal handlers has run.

    The handlers are wrapped *before* the line is printed (a test sends its signal once it sees
    the line), so a signal that lands before the wait begins is not lost: ``signal.pause()``
    alone would then wait forever. The wrappers are removed again afterwards."""
    import signal

    ran: list[int] = []
    wrapped = {}
    for sig in (signal.SIGUSR1, signal.SIGUSR2, signal.SIGTERM, signal.SIGINT):
        original = signal.getsignal(sig)
        if not callable(original):
            continue  # no Python handler: that signal's default action applies, as before

        def wrapper(signum: int, frame: object, original: Callable[..., object] = original) -> None:
            ran.append(signum)
            original(signum, frame)

        wrapped[sig] = original
        signal.signal(sig, wrapper)
    from .launch.vocabulary import STOP_FILE_VAR

    # a preemption reaches hvdkit train's ranks as their stop file too (hvdkit run, Ray): it
    # counts as the signal having arrived
    stop = os.environ.get(STOP_FILE_VAR)
    try:
        sys.stderr.write(line)
        sys.stderr.flush()
        while not ran and not (stop and os.path.exists(stop)):
            time.sleep(0.02)
    finally:
        for sig, original in wrapped.items():
            signal.signal(sig, original)
