"""Backend options that change the arithmetic: compression, Adasum, LR scaling and warm-up."""

from __future__ import annotations

import re

import pytest

from helpers import HVDKIT, launch_metrics
from hvdkit.loop import warmup_factor


def test_warmup_ramps_from_unscaled_to_scaled_lr():
    assert warmup_factor(0, 10, 4.0) == 0.25          # the single-worker LR at step 0
    assert warmup_factor(5, 10, 4.0) == pytest.approx(0.625)
    assert warmup_factor(10, 10, 4.0) == 1.0 and warmup_factor(3, 0, 4.0) == 1.0


@pytest.mark.mp
@pytest.mark.timeout(300)  # measured 9 s (2 cores, loaded)
@pytest.mark.parametrize("backend,kind", [("horovod", "hvd-gloo"), ("ddp", "mpirun")])
def test_fp16_compression_trains_and_stays_in_sync(tmp_path, backend, kind):
    args = [*HVDKIT, "train", "--backend", backend, "--model", "mlp", "--epochs", "2", "--num-samples", "512"]
    plain = launch_metrics(kind, 2, args, tmp_path / "plain.json")[0]["final_loss"]
    fp16, _ = launch_metrics(kind, 2, [*args, "--compression", "fp16"], tmp_path / "fp16.json")
    assert fp16["params_identical"] is True
    # fp16 gradients change the numbers a little, not the outcome
    assert fp16["final_loss"] != plain and abs(fp16["final_loss"] - plain) < 0.05 * plain


@pytest.mark.mp
@pytest.mark.timeout(200)  # measured 6 s (2 cores, loaded)
def test_adasum_and_warmup_under_mpi(tmp_path):
    metrics, out = launch_metrics("hvd-mpi", 2, [*HVDKIT, "train", "--backend", "horovod", "--hvd-op", "adasum",
                                                 "--model", "mlp", "--epochs", "2", "--num-samples", "512",
                                                 "--warmup-epochs", "1", "--log-every", "1"], tmp_path / "m.json")
    assert metrics["params_identical"] is True
    lrs = [float(x) for x in re.findall(r"step \d+ loss \S+ lr ([0-9.e+-]+)", out)]
    assert lrs[0] < lrs[7] == pytest.approx(0.02)       # ramped up to 0.01 x 2 ranks in one epoch
