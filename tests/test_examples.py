"""The examples run unchanged on every backend and agree with each other."""

from __future__ import annotations

import re
import subprocess

import pytest

from helpers import PY, ROOT, base_env, check, launch


@pytest.mark.mp
@pytest.mark.timeout(300)  # measured 10 s (2 cores, loaded) for -np 2
@pytest.mark.parametrize("np, steps", [(2, 48), (3, 30)])
def test_custom_loop_same_losses_on_both_backends(np, steps):
    """-np 3: 21 micro-batches a rank per epoch with accumulation 2. The loop runs 10 whole
    steps and drops the 21st (Horovod's reducer asserted on it, DDP summed it into the next
    epoch's first step). Bits agree across backends at 2 ranks only: a sum of three gradients
    depends on the order, which Horovod's ring and Gloo's allreduce choose differently."""
    script = str(ROOT / "examples" / "custom_loop.py")
    hvd = check(launch("hvd-gloo", np, [PY, script, "--backend", "horovod"]))
    ddp = check(launch("mpirun", np, [PY, script, "--backend", "ddp"]))
    losses = [re.findall(rf"epoch \d val_loss (\S+) val_accuracy \S+ \({np} ranks", out) for out in (hvd, ddp)]
    assert len(losses[0]) == 3 and losses[0] == losses[1]
    digests = [re.search(rf"done: step {steps} digest (\w+)", out).group(1) for out in (hvd, ddp)]
    assert digests[0] == digests[1] or np > 2


@pytest.mark.parametrize("pattern, says", [
    ((False, False, True), "micro-batch 3 since the last optimizer step syncs"),   # one carried over
    ((True,), "micro-batch 1 since the last optimizer step syncs"),                # a step of one
    ((False, True, False, False, False), "micro-batch 3 since the last optimizer step does not sync"),
])
def test_accumulate_refuses_a_step_that_is_not_accumulation_steps_micro_batches(pattern, says):
    import torch

    import hvdkit
    from hvdkit.errors import HvdkitError

    backend = hvdkit.create_backend(hvdkit.BackendConfig(name="local", accumulation_steps=2))
    model = torch.nn.Linear(2, 1)
    with pytest.raises(HvdkitError, match=says):
        for sync in pattern:
            with backend.accumulate(model, sync=sync):
                model(torch.ones(1, 2)).sum().backward()
    for sync in (False, True, False, True):  # whole groups are fine, and the count starts afresh
        with backend.accumulate(model, sync=sync):
            pass


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
