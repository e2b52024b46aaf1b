"""Hold points (hvdkit.faults): what the fault-injection tests rely on must itself be race-free."""

from __future__ import annotations

import os
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


@pytest.mark.parametrize("script, expected", [
    ("echo 'requeued? no: Invalid job id specified' >&2; exit 1", (False, "failed: requeued? no: Invalid job id")),
    ("echo requeue refused; exit 0", (True, "requeued Slurm job 7_3")),
    # the requeue TERMs the job's steps, scontrol among them, before it exits: Slurm's restart
    # count decides (this run started at 0)
    ('[ "$1" = show ] && echo "JobId=7 Restarts=1 JobState=PENDING" && exit 0; kill -TERM $$',
     (True, "requeued Slurm job 7_3")),
    ('[ "$1" = show ] && echo "JobId=7 Restarts=0 JobState=RUNNING" && exit 0; kill -TERM $$',
     (False, "failed: -15")),
])
def test_requeue_success_is_scontrols_exit_status_not_the_words_of_a_message(tmp_path, monkeypatch, script, expected):
    """What decides 'requeued' (exit 0 instead of 75) is scontrol's exit status; the outcome is
    only the log line (a message that happens to start with 'requeued' meant success before)."""
    from hvdkit.preemption import requeue_slurm_job

    fake = tmp_path / "scontrol"
    fake.write_text(f"#!/bin/sh\n{script}\n")
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}:{os.environ['PATH']}")
    done, outcome = requeue_slurm_job({"SLURM_JOB_ID": "9", "SLURM_ARRAY_JOB_ID": "7", "SLURM_ARRAY_TASK_ID": "3"})
    assert (done, expected[1] in outcome) == (expected[0], True), outcome
    assert requeue_slurm_job({}) == (False, "not running under Slurm: not requeued")
