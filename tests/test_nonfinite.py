"""A NaN in the data: --on-nonfinite stop ends the run at once, names the step, keeps the last finite checkpoint."""

from __future__ import annotations

import subprocess

import h5py
import numpy as np
import pytest

from helpers import HVDKIT, base_env
from hvdkit.checkpoint import read_checkpoint
from hvdkit.data import ShardSampler, make_synthetic_h5

NP, BATCH, SAMPLES, POISON = 2, 8, 256, 107  # sample 107 lands in step 7


def _poisoned(tmp_path):
    path = make_synthetic_h5(tmp_path / "data.h5", "tiny", SAMPLES)
    with h5py.File(path, "r+") as f:
        f["x"][POISON] = np.full(8, np.nan, dtype=np.float32)
    return path


def _where_poison_lands(seed: int = 0) -> tuple[int, int]:
    """(step, rank) whose batch holds the poisoned sample in epoch 0, from the sampler itself."""
    for rank in range(NP):
        order = list(ShardSampler(SAMPLES, NP, rank, seed=seed))
        if POISON in order:
            return order.index(POISON) // BATCH + 1, rank
    raise AssertionError("poisoned sample not drawn")


def _hvdkit_run(backend: str, tmp_path, *train_args: str) -> subprocess.CompletedProcess:
    return subprocess.run([*HVDKIT, "run", "-np", str(NP), "--backend", backend, "--log-dir", str(tmp_path),
                           "--", *train_args], env=base_env(), capture_output=True, text=True, timeout=100)


@pytest.mark.mp
@pytest.mark.timeout(120)  # measured 6 s (2 cores, loaded)
@pytest.mark.parametrize("backend", ["horovod", "ddp"])
def test_nan_stops_at_the_step_and_keeps_the_last_finite_checkpoint(tmp_path, backend):
    data, ckpts = _poisoned(tmp_path), tmp_path / "ckpt"
    step, rank = _where_poison_lands()
    assert 4 < step < SAMPLES // (NP * BATCH), "the poison must land mid-epoch, after a few saves"
    proc = _hvdkit_run(backend, tmp_path, "--model", "tiny", "--data", str(data), "--batch-size", str(BATCH),
                       "--epochs", "2", "--checkpoint-dir", str(ckpts), "--checkpoint-every", "2",
                       "--keep-checkpoints", "2", "--lr", "0.05")
    assert proc.returncode == 65, proc.stdout[-3000:] + proc.stderr[-3000:]  # EXIT_NONFINITE: not retried by a sweep
    last_even = (step - 1) // 2 * 2
    stderr = proc.stderr.splitlines()
    # hvdkit run's one closing line, holding rank 0's (which goes to the log): nothing else
    assert len(stderr) == 1 and "Traceback" not in proc.stdout + proc.stderr, proc.stderr
    assert f"loss became NaN/inf at step {step} on rank {rank}; stopped at step {step + 1}" in stderr[0]
    assert f"the last checkpoint (ckpt-{last_even:09d}.h5) is from before it" in stderr[0]
    assert stderr[0].startswith("Error: job failed (exit 65): loss became NaN/inf") and "HINT:" in stderr[0]
    log = stderr[0].rsplit("[full output: ", 1)[1].rstrip("]")
    assert "loss became NaN/inf" in open(log).read()
    names = sorted(p.name for p in ckpts.glob("ckpt-*.h5"))
    assert names == [f"ckpt-{last_even - 2:09d}.h5", f"ckpt-{last_even:09d}.h5"]  # none rotated away
    assert (ckpts / "latest").read_text().strip() == names[-1]
    for name in names:
        snap = read_checkpoint(ckpts / name)
        assert all(bool(t.isfinite().all()) for t in snap["model"].values() if t.is_floating_point())


@pytest.mark.mp
@pytest.mark.timeout(120)  # measured 4 s (2 cores, loaded)
def test_warn_mode_goes_on_but_never_saves_nan_weights(tmp_path):
    data, ckpts = _poisoned(tmp_path), tmp_path / "ckpt"
    step, _ = _where_poison_lands()
    proc = _hvdkit_run("ddp", tmp_path, "--model", "tiny", "--data", str(data), "--batch-size", str(BATCH),
                       "--epochs", "1", "--checkpoint-dir", str(ckpts), "--checkpoint-every", "2",
                       "--keep-checkpoints", "2", "--on-nonfinite", "warn")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    both = proc.stdout + proc.stderr
    assert both.count("WARNING: loss became NaN/inf") == 1
    assert "WARNING: not saving step" in both and "final_loss=nan" in proc.stdout
    last_even = (step - 1) // 2 * 2
    names = sorted(p.name for p in ckpts.glob("ckpt-*.h5"))
    assert names[-1] == f"ckpt-{last_even:09d}.h5", names
