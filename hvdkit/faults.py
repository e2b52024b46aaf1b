"""Hold points: named places where a run can be made to wait, so that a fault (a signal, a
SIGKILL, a lost node) lands exactly there instead of wherever a timer happens to fire.

``HVDKIT_HOLD=NAME`` or ``NAME:N`` makes the process wait the N-th time (1-based; every time
without ``:N``) it reaches the point called NAME, after printing one line
``[hvdkit] holding at NAME N (pid P)`` to stderr. It waits until the file named by
``HVDKIT_HOLD_RELEASE`` exists, or with ``HVDKIT_HOLD_RELEASE=signal`` until a signal handler
has run in this process (a preemption signal has certainly arrived), or forever without one
(to be killed there). Signals are still handled while it waits. Unset, a hold point costs one dictionary lookup.

Points: ``step`` (before each optimizer step of ``hvdkit train``; N is the global step number,
counted from 1, so a resumed run does not hold again) and ``checkpoint-write`` (half-way
through writing a checkpoint's temporary file).
"""

from __future__ import annotations

import os
import sys
import time
from collections import Counter

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
    sys.stderr.write(f"[hvdkit] holding at {name} {number} (pid {os.getpid()})\n")
    sys.stderr.flush()
    release = os.environ.get(RELEASE_VAR)
    if release == "signal":
        import signal

        signal.pause()  # returns once a handler ran
        return
    while not (release and os.path.exists(release)):
        time.sleep(0.02)
