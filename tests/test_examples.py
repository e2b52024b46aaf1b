"""The examples run unchanged on every backend and agree with each other."""

from __future__ import annotations

import re
import subprocess

import pytest

from helpers import PY, ROOT, base_env, check, launch


@pytest.mark.mp
@pytest.mark.timeout(200)  # measured 10 s (2 cores, loaded)
def test_custom_loop_same_losses_on_both_backends():
    script = str(ROOT / "examples" / "custom_loop.py")
    hvd = check(launch("hvd-gloo", 2, [PY, script, "--backend", "horovod"]))
    ddp = check(launch("mpirun", 2, [PY, script, "--backend", "ddp"]))
    losses = [re.findall(r"epoch \d val_loss (\S+) val_accuracy \S+ \(2 ranks", out) for out in (hvd, ddp)]
    assert len(losses[0]) == 3 and losses[0] == losses[1]
    digests = [re.search(r"done: step 48 digest (\w+)", out).group(1) for out in (hvd, ddp)]
    assert digests[0] == digests[1]


@pytest.mark.mp
@pytest.mark.timeout(120)  # measured 7 s (2 cores, loaded)
def test_train_example_single_process_and_mpirun():
    script = str(ROOT / "examples" / "train.py")
    out = check(launch("mpirun", 2, [PY, script, "--backend", "ddp", "--model", "cnn", "--epochs", "1",
                                     "--num-samples", "256"]))
    assert "done: backend=ddp world=2" in out
    # no flags, no launcher: the default backend (Horovod, as in every command) with one rank
    alone = subprocess.run([PY, script, "--model", "tiny", "--epochs", "1", "--num-samples", "64"],
                           env=base_env(), capture_output=True, text=True, timeout=100)
    assert alone.returncode == 0, alone.stdout + alone.stderr
    assert "done: backend=horovod world=1" in alone.stdout
