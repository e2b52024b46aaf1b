"""hvdkit sweep: grid/random spaces, local and Slurm-array runs, one results table."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from helpers import HVDKIT, base_env
from hvdkit.config import TrainConfig
from hvdkit.errors import ConfigError
from hvdkit.sweep import SweepSpec, expand_trials, load_space, trial_args

SPACE = """metric: final_loss
mode: min
fixed: {model: mlp, epochs: 1, num_samples: 512}
grid: {lr: [0.005, 0.02, 0.05]}
"""


def test_grid_random_and_args(tmp_path):
    grid = SweepSpec(grid={"lr": [0.1, 0.2], "optimizer": ["sgd", "adam"]})
    assert expand_trials(grid) == [{"lr": 0.1, "optimizer": "sgd"}, {"lr": 0.1, "optimizer": "adam"},
                                   {"lr": 0.2, "optimizer": "sgd"}, {"lr": 0.2, "optimizer": "adam"}]
    rnd = SweepSpec(random={"trials": 5, "seed": 3, "params": {"lr": {"loguniform": [1e-3, 1e-1]},
                                                               "batch_size": {"int": [8, 64]}}})
    trials = expand_trials(rnd)
    assert len(trials) == 5 and trials == expand_trials(rnd)  # seeded: reproducible
    assert all(1e-3 <= t["lr"] <= 1e-1 and 8 <= t["batch_size"] <= 64 for t in trials)
    assert trial_args({"lr": 0.5, "batch_size": 8, "scale_lr": False}) == [
        "--lr", "0.5", "--batch-size", "8", "--no-scale-lr"]
    with pytest.raises(ConfigError, match="exactly one of 'grid' or 'random'"):
        SweepSpec()
    with pytest.raises(ConfigError, match="metric val_loss needs validation data in every trial"):
        SweepSpec(metric="val_loss", grid={"lr": [0.1]})
    with pytest.raises(ConfigError, match="metric 'accuracy' is not one training reports"):
        SweepSpec(metric="accuracy", grid={"lr": [0.1]})
    SweepSpec(metric="val_accuracy", mode="max", fixed={"val_fraction": 0.1}, grid={"lr": [0.1]})
    # a trial's epochs (where Ray Tune stops it): fixed, else hvdkit train's own default
    assert SweepSpec(fixed={"epochs": 5}, grid={"lr": [0.1]}).epochs == 5
    assert SweepSpec(grid={"lr": [0.1]}).epochs == TrainConfig.epochs == 2
    bad = tmp_path / "s.yaml"
    bad.write_text("grid: {lr: [1]}\nsearch: x\n")
    with pytest.raises(ConfigError, match="unknown key"):
        load_space(bad)


def _check_results(out, n):
    rows = json.loads((out / "results.json").read_text())
    assert [r["trial"] for r in rows] == list(range(n))
    assert [r["params"]["lr"] for r in rows] == [0.005, 0.02, 0.05]   # rows match the trials
    losses = [r["final_loss"] for r in rows]
    assert all(isinstance(x, float) for x in losses) and len(set(losses)) == n
    assert (out / "results.png").read_bytes()[:4] == b"\x89PNG"
    return rows


def _sweep(tmp_path, *options, timeout=220):
    space = tmp_path / "space.yaml"
    space.write_text(SPACE)
    out = tmp_path / "out"
    proc = subprocess.run([*HVDKIT, "sweep", str(space), "--out-dir", str(out), "--backend", "ddp", "--np", "2",
                           *options],
                          env=base_env(), capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return out, proc.stdout


@pytest.mark.mp
@pytest.mark.timeout(240)  # measured 45 s (2 cores, loaded)
def test_local_sweep_of_three_trials(tmp_path):
    out, stdout = _sweep(tmp_path, "--parallel", "1")
    rows = _check_results(out, 3)
    best = min(rows, key=lambda r: r["final_loss"])
    assert f"best: trial {best['trial']}" in stdout and "| trial | lr | epochs | final_loss | status |" in stdout


@pytest.mark.slurm
@pytest.mark.timeout(300)  # measured 30 s (2 cores, loaded)
def test_slurm_array_sweep_of_three_trials(tmp_path):
    out, stdout = _sweep(tmp_path, "--slurm", "--venv", sys.prefix, "--time", "5:00", timeout=280)
    assert "Submitted batch job" in stdout and "(3 array tasks)" in stdout
    assert len(list((out / "results").glob("hvdkit-sweep-*-*.json"))) == 3
    _check_results(out, 3)
