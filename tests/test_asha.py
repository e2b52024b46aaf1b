"""ASHA: the decision rule against hand-computed cases, requeue reuse, and real sweeps.

The Slurm test runs 9 two-rank DDP trials as a job array with at most 3 at once on the
local cluster; whatever order the trials reach a rung in, every recorded decision must be
what the rule gives on the numbers recorded with it, and a pruned trial must have stopped
at that rung.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import HVDKIT, base_env
from hvdkit.asha import AshaConfig, AshaTrial, decide, write_config
from hvdkit.errors import ConfigError


def test_rungs_are_grace_times_powers_of_eta_below_the_budget():
    assert AshaConfig(budget=9).rungs() == [1, 3]
    assert AshaConfig(budget=10).rungs() == [1, 3, 9]
    assert AshaConfig(budget=27, eta=3, grace=2).rungs() == [2, 6, 18]
    assert AshaConfig(budget=100, eta=4).rungs() == [1, 4, 16, 64]
    with pytest.raises(ConfigError, match="eta must be >= 2"):
        AshaConfig(budget=9, eta=1)
    with pytest.raises(ConfigError, match="below the budget"):
        AshaConfig(budget=3, grace=3)


@pytest.mark.parametrize("seen,trial,eta,mode,go_on,keep,position", [
    # fewer than eta values: everyone continues, whatever the value
    ({0: 5.0}, 0, 3, "min", True, 0, 0),
    ({0: 1.0, 1: 9.0}, 1, 3, "min", True, 0, 1),
    # n = 3, eta = 3: only the best 1 continues
    ({0: 1.0, 1: 2.0, 2: 0.5}, 2, 3, "min", True, 1, 0),
    ({0: 1.0, 1: 2.0, 2: 0.5}, 0, 3, "min", False, 1, 1),
    # n = 5: keep max(1, 5 // 3) = 1; n = 6: keep 2
    ({0: 3.0, 1: 2.0, 2: 1.0, 3: 4.0, 4: 1.5}, 4, 3, "min", False, 1, 1),
    ({0: 3.0, 1: 2.0, 2: 1.0, 3: 4.0, 4: 1.5, 5: 9.0}, 4, 3, "min", True, 2, 1),
    # maximize: the largest is best
    ({0: 0.7, 1: 0.9, 2: 0.8}, 1, 3, "max", True, 1, 0),
    ({0: 0.7, 1: 0.9, 2: 0.8}, 2, 3, "max", False, 1, 1),
    # ties rank by trial id, lower first: trial 1 beats trial 2 at an equal value
    ({2: 0.5, 1: 0.5, 0: 0.9}, 1, 3, "min", True, 1, 0),
    ({2: 0.5, 1: 0.5, 0: 0.9}, 2, 3, "min", False, 1, 1),
    # NaN ranks last in both modes
    ({0: math.nan, 1: 5.0, 2: 6.0}, 0, 3, "min", False, 1, 2),
    ({0: math.nan, 1: 5.0, 2: 6.0}, 0, 3, "max", False, 1, 2),
    # eta = 2: half continue
    ({0: 1.0, 1: 2.0, 2: 3.0, 3: 4.0}, 1, 2, "min", True, 2, 1),
    ({0: 1.0, 1: 2.0, 2: 3.0, 3: 4.0}, 2, 2, "min", False, 2, 2),
])
def test_decide_against_hand_computed_cases(seen, trial, eta, mode, go_on, keep, position):
    d = decide(seen, trial, epoch=1, eta=eta, mode=mode)
    assert (d.go_on, d.keep, d.position) == (go_on, keep, position), d.rule
    assert d.seen == seen and d.trial == trial


def test_a_requeued_trial_reuses_its_recorded_decision(tmp_path):
    write_config(tmp_path, AshaConfig(budget=9))
    for trial, value in ((0, 1.0), (1, 2.0)):
        AshaTrial(tmp_path, trial).report(1, value)
    first = AshaTrial(tmp_path, 2).report(1, 3.0)
    assert first["go_on"] is False and first["reused"] is False
    AshaTrial(tmp_path, 3).report(1, 0.1)            # a better trial arrives afterwards ...
    again = AshaTrial(tmp_path, 2).report(1, 0.01)   # ... and the requeued trial 2 comes back
    assert again["reused"] is True and again["go_on"] is False and again["value"] == 3.0


def _replay_and_check(out: Path, budget: int, mode: str = "min") -> dict:
    """Every decision equals the rule on its recorded numbers; pruned trials stopped there."""
    rows = {r["trial"]: r for r in json.loads((out / "results.json").read_text())}
    decisions = [json.loads(p.read_text()) for p in sorted((out / "asha" / "decisions").glob("*.json"))]
    assert decisions
    for d in decisions:
        seen = {int(k): float(v) for k, v in d["seen"].items()}
        again = decide(seen, d["trial"], d["epoch"], 3, mode)
        assert (again.go_on, again.keep, again.position) == (d["go_on"], d["keep"], d["position"]), d
        assert rows[d["trial"]]["curve"][d["epoch"] - 1] == d["value"]  # the value is that epoch's metric
    for trial, row in rows.items():
        mine = [d for d in decisions if d["trial"] == trial]
        if row["status"] == "pruned":
            assert not mine[-1]["go_on"] and row["epochs"] == mine[-1]["epoch"], (row, mine)
            assert all(d["go_on"] for d in mine[:-1])
        else:
            assert row["status"] == "completed" and row["epochs"] == budget and all(d["go_on"] for d in mine)
    return rows


SPACE = """metric: {metric}
mode: {mode}
fixed: {{model: tiny, epochs: {epochs}, num_samples: 640, batch_size: 16, val_fraction: 0.2}}
grid: {{lr: {lrs}}}
scheduler: asha
"""


def _space(tmp_path: Path, lrs: list[float], epochs: int, metric: str = "val_loss", mode: str = "min") -> Path:
    space = tmp_path / "space.yaml"
    space.write_text(SPACE.format(epochs=epochs, lrs=lrs, metric=metric, mode=mode))
    return space


@pytest.mark.mp
@pytest.mark.timeout(240)  # measured 10 s (2 cores, loaded)
def test_local_asha_sweep_prunes_by_the_rule(tmp_path):
    space, out = _space(tmp_path, [0.06, 0.001, 0.25, 0.004, 0.002, 0.03], 9), tmp_path / "out"
    proc = subprocess.run([*HVDKIT, "sweep", str(space), "--out", str(out), "--backend", "local",
                           "--parallel", "3"], env=base_env(), capture_output=True, text=True, timeout=220)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = _replay_and_check(out, 9)
    assert any(r["status"] == "pruned" for r in rows.values())
    assert "trial-epochs used:" in proc.stdout and (out / "results.png").read_bytes()[:4] == b"\x89PNG"
    status = subprocess.run([*HVDKIT, "sweep", "status", str(out)], env=base_env(), capture_output=True,
                            text=True, timeout=60)
    assert status.returncode == 0 and "sweep" in status.stdout and "pruned" in status.stdout


@pytest.mark.slurm
@pytest.mark.timeout(420)  # measured 33 s (2 cores, loaded)
def test_slurm_array_asha_sweep_of_nine_two_rank_trials(tmp_path):
    lrs = [0.06, 0.001, 0.25, 0.004, 0.002, 0.03, 0.008, 0.12, 0.016]
    space, out = _space(tmp_path, lrs, 9, "val_accuracy", "max"), tmp_path / "out"
    proc = subprocess.run([*HVDKIT, "sweep", str(space), "--out", str(out), "--slurm", "--venv", sys.prefix,
                           "--backend", "ddp", "--np", "2", "--max-parallel", "3", "--time", "5:00"],
                          env=base_env(), capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "(9 array tasks)" in proc.stdout and "--array=0-8%3" in (out / "sweep.sbatch").read_text()
    rows = _replay_and_check(out, 9, "max")
    pruned = [r for r in rows.values() if r["status"] == "pruned"]
    assert pruned, rows
    used = sum(r["epochs"] for r in rows.values())
    assert f"trial-epochs used: {used} of 81" in proc.stdout and used < 81
    # the best trial (highest held-out accuracy) is what the same trial reaches alone, without ASHA
    best = max((r for r in rows.values() if r["status"] == "completed"), key=lambda r: r["val_accuracy"])
    assert f"best: trial {best['trial']} val_accuracy=" in proc.stdout
    alone = tmp_path / "alone.json"
    subprocess.run([sys.executable, "-m", "hvdkit", "run", "-np", "2", "--backend", "ddp", "--", "--model",
                    "tiny", "--epochs", "9", "--num-samples", "640", "--batch-size", "16", "--val-fraction", "0.2",
                    "--lr", repr(best["params"]["lr"]), "--metrics-file", str(alone)],
                   env=base_env(), check=True, capture_output=True, timeout=200)
    assert json.loads(alone.read_text())["val_accuracy"] == best["val_accuracy"]
