"""hvdkit's preemption contract for a whole Tune experiment (see hvdkit.rayrun.tune).

Its own module because it subclasses Ray's ``Callback``, so Ray is imported here at the top
(the one module of hvdkit that does: Tune pickles the callback with the experiment, so that
``Tuner.restore`` brings it back, which needs a class defined at module level). Only
:func:`hvdkit.rayrun.tune.run_tune` imports it, inside the function.
"""

from __future__ import annotations

import signal
import threading
import time
from pathlib import Path
from typing import Any

from ray.tune import Callback

from .layout import PREEMPT_FLAG, PREEMPT_GRACE_S, PREEMPTED_DIR

__all__ = ["TunePreemption"]


class TunePreemption(Callback):
    """A Tune callback that turns USR1 into hvdkit's preemption for the whole experiment.

    Tune catches USR1 itself and stops at once, killing the trials' ranks wherever they are.
    At the first step this callback takes the signal over: USR1 raises the flag file every
    trial polls, and only when every running trial's ranks have stopped (or after
    ``PREEMPT_GRACE_S``) is Tune's own handler called, which saves the experiment and ends it.
    """

    def __init__(self, out: Path) -> None:
        self.flag = out / PREEMPT_FLAG
        self.stopped = out / "trials" / PREEMPTED_DIR
        self.tune_handler: Any = None
        self.asked_at: float | None = None
        self.handed_over = False

    def __getstate__(self) -> dict[str, Any]:  # pickled with the experiment: paths only
        return {"flag": self.flag, "stopped": self.stopped}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["flag"].parent)  # type: ignore[misc]

    def on_step_begin(self, iteration: int, trials: list[Any], **info: Any) -> None:
        if self.tune_handler is None and threading.current_thread() is threading.main_thread():
            self.tune_handler = signal.getsignal(signal.SIGUSR1)
            signal.signal(signal.SIGUSR1, self._asked)
            if self.flag.exists():  # USR1 came while Tune was starting (run_tune's own handler)
                self._asked(signal.SIGUSR1, None)

    def _asked(self, signum: int, frame: Any) -> None:
        if self.asked_at is None:
            self.asked_at = time.monotonic()
            self.flag.touch()
            print(f"[hvdkit] tune: got SIGUSR1: every running trial checkpoints and stops (up to "
                  f"{PREEMPT_GRACE_S:.0f} s), then the experiment is saved", flush=True)

    def on_step_end(self, iteration: int, trials: list[Any], **info: Any) -> None:
        if self.asked_at is None or self.handed_over:
            return
        running = [t.trial_id for t in trials if t.status == "RUNNING"]
        if all((self.stopped / t).exists() for t in running) or time.monotonic() - self.asked_at > PREEMPT_GRACE_S:
            self.handed_over = True
            if callable(self.tune_handler):
                self.tune_handler(signal.SIGUSR1, None)  # Tune: save the experiment's state, stop
            else:
                raise KeyboardInterrupt  # Tune installed no handler: end fit() all the same
