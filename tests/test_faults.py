"""Hold points (hvdkit.faults): what the fault-injection tests rely on must itself be race-free."""

from __future__ import annotations

import subprocess
import sys

import pytest

from helpers import base_env

# The signal lands exactly between the "holding" line and the wait: the line's write sends it.
# With signal.pause() after the line, the handler had already run and the process waited forever.
RACE = """
import os, signal, sys
from hvdkit.faults import hold_point
got = []
signal.signal(signal.SIGUSR1, lambda s, f: got.append(s))
class Stderr:
    def write(self, text):
        sys.__stderr__.write(text)
        if "holding at" in text:
            os.kill(os.getpid(), signal.SIGUSR1)
    def flush(self):
        sys.__stderr__.flush()
sys.stderr = Stderr()
hold_point("step", at=3)
hold_point("step", at=4)  # not held: the hold names step 3 only
print("released", got, signal.getsignal(signal.SIGUSR1).__name__)
"""


@pytest.mark.timeout(120)  # measured 1 s
def test_a_signal_that_arrives_with_the_holding_line_releases_the_hold():
    env = base_env(HVDKIT_HOLD="step:3", HVDKIT_HOLD_RELEASE="signal")
    proc = subprocess.run([sys.executable, "-c", RACE], env=env, capture_output=True, text=True, timeout=30)
    assert proc.returncode == 0, proc.stderr
    assert "[hvdkit] holding at step 3" in proc.stderr
    # the handler ran once, and it is the program's own again afterwards (the wrapper is gone)
    assert proc.stdout.strip() == "released [10] <lambda>", proc.stdout
