"""What real training needs in the loop, on 2 real ranks: gradient clipping in the order each
backend needs, DataLoader workers with random augmentation resuming exactly, and a user's own
dataset, task and optimizer with a cosine schedule, checkpointed and resumed exactly."""

from __future__ import annotations

import math
import re
import subprocess

import pytest
import torch

from helpers import HVDKIT, ROOT, base_env, check, launch, launch_metrics, read_metrics
from hvdkit.checkpoint import read_checkpoint

USER = str(ROOT / "tests" / "userland" / "userland.py")
KINDS = {"horovod": "hvd-gloo", "ddp": "mpirun"}


def _last(directory) -> dict:
    return read_checkpoint(max(directory.glob("ckpt-*.h5")))


@pytest.fixture(scope="module")
def one_process_clipped(tmp_path_factory):
    """One process, batch 16 (= 2 ranks x 8), the same sample order, clipped and not."""
    tmp = tmp_path_factory.mktemp("clip1")
    out = {}
    for name, clip in (("clipped", ["--clip-grad-norm", "0.05"]), ("free", [])):
        proc = subprocess.run([*HVDKIT, "train", "--backend", "local", "--model", "tiny", "--epochs", "2",
                               "--num-samples", "256", "--batch-size", "16", "--lr", "0.1", "--no-scale-lr",
                               *clip, "--checkpoint-dir", str(tmp / name)], env=base_env(),
                              capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0, proc.stdout + proc.stderr
        out[name] = _last(tmp / name)["model"]
    return out


@pytest.mark.mp
@pytest.mark.timeout(300)  # measured 8 s (2 cores, loaded)
@pytest.mark.parametrize("backend", ["horovod", "ddp"])
def test_clipping_the_reduced_gradient_equals_one_process(tmp_path, backend, one_process_clipped):
    """Horovod reduces inside step(): clipping must wait for synchronize(), or each rank would
    clip its own local gradient by its own norm and the update would differ from one process."""
    check(launch(KINDS[backend], 2, [*HVDKIT, "train", "--backend", backend, "--model", "tiny", "--epochs", "2",
                                     "--num-samples", "256", "--batch-size", "8", "--lr", "0.1", "--no-scale-lr",
                                     "--clip-grad-norm", "0.05", "--checkpoint-dir", str(tmp_path / "ck")]))
    mine, ref, free = _last(tmp_path / "ck")["model"], one_process_clipped["clipped"], one_process_clipped["free"]
    for name in ref:
        torch.testing.assert_close(mine[name], ref[name], rtol=1e-5, atol=1e-6, msg=name)
    # the clip was active: without it the weights end elsewhere
    assert any(not torch.allclose(ref[k], free[k], rtol=1e-3) for k in ref)


@pytest.mark.mp
@pytest.mark.timeout(300)  # measured 23-51 s (2 cores, loaded; one DataLoader-worker hang seen, see docs)
def test_workers_with_random_augmentation_resume_exactly_and_do_not_depend_on_their_number(tmp_path):
    base = [*HVDKIT, "train", "--backend", "ddp", "--dataset", f"{USER}:noisy", "--model", "tiny",
            "--epochs", "2", "--batch-size", "16", "--lr", "0.05"]
    two, _ = launch_metrics("mpirun", 2, [*base, "--num-workers", "2", "--checkpoint-dir", str(tmp_path / "a")],
                            tmp_path / "a.json")
    three, _ = launch_metrics("mpirun", 2, [*base, "--num-workers", "3"], tmp_path / "c.json")
    check(launch("mpirun", 2, [*base, "--num-workers", "2", "--max-steps", "11", "--checkpoint-dir",
                               str(tmp_path / "b")]))
    resumed, _ = launch_metrics("mpirun", 2, [*base, "--num-workers", "2", "--checkpoint-dir", str(tmp_path / "b")],
                                tmp_path / "b.json")
    assert resumed["start_step"] == 11 and resumed["global_step"] == two["global_step"] == 32
    assert resumed["param_digest"] == two["param_digest"] == three["param_digest"]
    assert resumed["final_loss"] == two["final_loss"]
    # and the augmentation is really random: without workers (the main process's generators) it differs
    plain, _ = launch_metrics("mpirun", 2, base, tmp_path / "p.json")
    assert plain["param_digest"] != two["param_digest"]


@pytest.mark.mp
@pytest.mark.timeout(300)  # measured 13 s (2 cores, loaded)
def test_own_dataset_task_and_optimizer_with_a_cosine_schedule_resume_exactly(tmp_path):
    args = [*HVDKIT, "train", "--backend", "horovod", "--dataset", f"{USER}:regression",
            "--dataset-arg", "samples=768", "--model", f"{USER}:regressor", "--model-arg", "width=24",
            "--task", f"{USER}:mse", "--optimizer", "torch.optim:RMSprop", "--optimizer-arg", "alpha=0.9",
            "--weight-decay", "0.01", "--lr", "0.01", "--warmup-epochs", "0.5", "--lr-schedule", "cosine",
            "--min-lr-ratio", "0.1", "--lr-decay-steps", "54", "--epochs", "3", "--batch-size", "16",
            "--log-every", "1",
            "--keep-best", "val_mae"]
    straight, out = launch_metrics("hvd-gloo", 2, [*args, "--checkpoint-dir", str(tmp_path / "a")],
                                   tmp_path / "a.json")
    check(launch("hvd-gloo", 2, [*args, "--max-steps", "25", "--checkpoint-dir", str(tmp_path / "b")]))
    resumed, _ = launch_metrics("hvd-gloo", 2, [*args, "--checkpoint-dir", str(tmp_path / "b")],
                                tmp_path / "b.json")
    assert resumed["start_step"] == 25 and resumed["resumed_from"].endswith("ckpt-000000025.h5")
    assert resumed["param_digest"] == straight["param_digest"] and resumed["final_loss"] == straight["final_loss"]
    assert resumed["val_mae"] == straight["val_mae"] < 1.0 and resumed["val_count"] == 192
    # warm-up for half an epoch (9 steps of 18), then cosine from 0.02 (2 ranks) to a tenth of it
    lrs = {int(s): float(lr) for s, lr in re.findall(r"step (\d+) loss \S+ lr (\S+)", out)}
    total, warm = 54, 9
    for step in (warm + 1, 30, total):
        want = 0.02 * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * (step - warm) / (total - warm))))
        assert lrs[step] == pytest.approx(want, rel=1e-4), step
    assert lrs[1] < lrs[warm - 1] < lrs[warm] == pytest.approx(0.02)
    a, b = _last(tmp_path / "a"), _last(tmp_path / "b")
    assert a["scheduler"]["last_epoch"] == b["scheduler"]["last_epoch"] == 54
    assert set(a["optimizer"]["state"][0]) >= {"square_avg", "step"}  # RMSprop's own state
    groups = a["optimizer"]["param_groups"]
    assert [g["weight_decay"] for g in groups] == [0.01, 0.0] and groups[0]["alpha"] == 0.9
    assert a.metrics["val_mae"] == straight["val_mae"] and "val_loss" in a.metrics
    assert read_metrics(tmp_path / "a.json")["best"]["metric"] == "val_mae"
