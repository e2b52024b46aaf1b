"""The examples run unchanged on every backend and agree with each other."""

from __future__ import annotations

import re

import pytest

from helpers import PY, ROOT, check, launch


@pytest.mark.mp
@pytest.mark.timeout(200)
def test_custom_loop_same_losses_on_both_backends():
    script = str(ROOT / "examples" / "custom_loop.py")
    hvd = check(launch("hvd-gloo", 2, [PY, script, "--backend", "horovod"]))
    ddp = check(launch("mpirun", 2, [PY, script, "--backend", "ddp"]))
    losses = [re.findall(r"epoch \d loss (\S+) \(2 ranks", out) for out in (hvd, ddp)]
    assert len(losses[0]) == 2 and losses[0] == losses[1]


@pytest.mark.mp
@pytest.mark.timeout(120)
def test_train_example_single_process_and_mpirun():
    script = str(ROOT / "examples" / "train.py")
    out = check(launch("mpirun", 2, [PY, script, "--backend", "ddp", "--model", "cnn", "--epochs", "1",
                                     "--num-samples", "256"]))
    assert "done: backend=ddp world=2" in out
