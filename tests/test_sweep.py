"""hvdkit sweep: grid/random spaces, local and Slurm-array runs, one results table."""

from __future__ import annotations

import dataclasses
import json
import re
import subprocess
import sys

import pytest

from helpers import HVDKIT, ROOT, base_env
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


# Class 1 of #44: a sweep space is checked whole before any trial runs. Each entry: the space,
# and what the one error line must say. Walked on every engine (the Ray engine refuses before
# Ray starts, a Slurm array before anything is submitted).
DIGITS = "model: examples/models.py:digits_cnn, data: {d}/train.h5, val_data: {d}/val.h5"
BAD_SPACES = [
    ("fixed: {model: mlp}\ngrid: {momentum: [abc, 0.9]}",
     "trial 0 {'momentum': 'abc'}: Invalid value for '--momentum'"),
    ("fixed: {model: mlp}\ngrid: {lr: [0.01, .nan]}", "trial 1 {'lr': nan}: Invalid value for '--lr'"),
    ("fixed: {model: mlp, bogus: 1}\ngrid: {lr: [0.1]}", "no such option --bogus"),
    ("fixed: {DIGITS}\ngrid: {lr: [0.1], model: [examples/nope.py:f]}", "file examples/nope.py does not exist"),
    # a choice the seed did not draw is refused too
    ("fixed: {DIGITS}\nrandom: {trials: 1, seed: 1, params: {model: [examples/models.py:digits_cnn, nope.py:f]}}",
     "random: params: model: 'nope.py:f'"),
    ("fixed: {model: mlp}\nrandom: {trials: 1, seed: 0, params: {num_workers: {int: [0, 65]}}}",
     "random: params: num_workers: 65: --num-workers 65 is more than 64"),
    ("fixed: {model: mlp, checkpoint_dir: ck}\ngrid: {keep_best: [val_f1]}", "--keep-best val_f1 needs validation"),
    ("fixed: {model: mlp, '': 3}\ngrid: {lr: [0.1]}", "fixed: '' is not an option name"),
    ("metric: val_Accuracy\nfixed: {DIGITS}\ngrid: {lr: [0.1]}", "metric val_Accuracy is never reported"),
    ("metric: val_loss\nfixed: {model: mlp, val_fraction: 0.0}\ngrid: {lr: [0.1]}",
     "metric val_loss needs validation data, which trial 0"),
    ("random: {trials: 2, params: {lr: {loguniform: [0, 1]}}}", "loguniform [0, 1] is not a range above 0"),
    ("random: {trials: 2, params: {lr: {uniform: [0, 1, 2]}}}", "uniform takes two numbers [low, high]"),
    ("random: {trials: 2, params: {batch_size: {int: [8, 6.5]}}}", "int takes two whole numbers"),
    ("random: {trials: 2, params: {lr: {normal: [0, 1]}}}", "cannot sample {'normal': [0, 1]}"),
    ("random: {trials: many, params: {lr: [0.1]}}", "random: trials: 'many' is not a whole number >= 1"),
    ("random: {trials: 2, sead: 1, params: {lr: [0.1]}}", "random: has unknown key(s) sead"),
    ("eta: '3'\ngrid: {lr: [0.1]}", "eta: '3' is not a whole number >= 2"),
    ("eta: 2.5\ngrid: {lr: [0.1]}", "eta: 2.5 is not a whole number"),
    ("eta: .inf\ngrid: {lr: [0.1]}", "eta: inf is not a whole number"),
    ("grace: 0\ngrid: {lr: [0.1]}", "grace: 0 is not a whole number >= 1"),
    ("fixed: [model, mlp]\ngrid: {lr: [0.1]}", "fixed: must be a mapping"),
]


def _main(argv: list[str], capsys) -> tuple[int, list[str]]:
    """hvdkit's console entry point in this process: (exit code, the lines it printed)."""
    from hvdkit.cli import main

    with pytest.raises(SystemExit) as exit_:
        main(argv)
    captured = capsys.readouterr()
    return int(exit_.value.code), (captured.out + captured.err).strip().splitlines()


@pytest.mark.parametrize("engine", [[], ["--engine", "ray"], ["--slurm"]], ids=["local", "ray", "slurm"])
def test_a_bad_sweep_space_is_one_line_before_any_trial(tmp_path, monkeypatch, capsys, engine):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "examples").mkdir()
    (tmp_path / "examples" / "models.py").write_text((ROOT / "examples" / "models.py").read_text())
    for h5 in ("train.h5", "val.h5"):
        (tmp_path / h5).write_bytes(b"")  # --data/--val-data only have to exist for the checks
    for text, expected in BAD_SPACES:
        (tmp_path / "space.yaml").write_text(text.replace("{DIGITS}", "{" + DIGITS.format(d=".") + "}"))
        code, lines = _main(["sweep", "space.yaml", "--out", "out", *engine], capsys)
        assert code == 2 and len(lines) == 1 and expected in lines[0], (text, engine, lines)
        assert not (tmp_path / "out").exists(), text  # nothing written to --out


def test_sweep_status_and_collect_of_no_sweep_are_one_line(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "space.yaml").write_text(SPACE)
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "spec.json").write_text('{"metric": ')
    for argv, code, expected in [(["sweep", "status", "bad"], 1, "bad/spec.json is damaged"),
                                 (["sweep", "status", "."], 1, "holds no sweep (no spec.json)"),
                                 (["sweep", "space.yaml", "--collect", "--out", "none"], 2, "--collect: "),
                                 (["sweep", "space.yaml", "--collect", "--out", "bad"], 2, "is damaged")]:
        got, lines = _main(argv, capsys)
        assert got == code and len(lines) == 1 and expected in lines[0], (argv, lines)
    assert not (tmp_path / "none").exists()


def test_pbt_perturbs_each_key_within_its_type_and_range(tmp_path):
    """Class 3 of #44: an int stays a whole number in its range, a choice stays a listed value,
    a float stays in its range; a key the space gives no range is refused before Ray starts; and
    the results table names what a trial trained with at the end (after an exploit)."""
    import random

    pytest.importorskip("ray")
    from ray.tune.schedulers.pbt import _explore  # what Tune's PBT calls at each exploit

    from hvdkit.rayrun.tune import _scheduler, check_ray_sweep
    from hvdkit.sweep import collect_results

    spec = SweepSpec(fixed={"epochs": 4, "lr": 0.01}, scheduler="pbt", perturb=["batch_size", "momentum", "optimizer",
                                                                                 "lr"],
                     random={"trials": 2, "params": {"batch_size": {"int": [8, 64]},
                                                     "momentum": {"uniform": [0.5, 0.99]},
                                                     "optimizer": ["sgd", "adamw"]}})
    check_ray_sweep(spec)
    pbt = _scheduler(spec)
    random.seed(0)
    config = {"trial": 0, "batch_size": 64, "momentum": 0.99, "optimizer": "sgd", "lr": 0.9}
    for _ in range(300):
        config, _ops = _explore(config, pbt._hyperparam_mutations, pbt._resample_probability,
                                pbt._perturbation_factors, pbt._custom_explore_fn)
        assert type(config["batch_size"]) is int and 8 <= config["batch_size"] <= 64, config
        assert 0.5 <= config["momentum"] <= 0.99 and config["optimizer"] in ("sgd", "adamw"), config
        assert 1e-5 <= config["lr"] <= 1.0, config
    for perturb, expected in [(["weight_decay"], "the space does not set it"),
                              (["epochs"], "the space gives it one value (fixed:) and no range")]:
        with pytest.raises(ConfigError, match=re.escape(f"cannot perturb {perturb[0]}: {expected}")):
            check_ray_sweep(dataclasses.replace(spec, perturb=perturb))
    with pytest.raises(ConfigError, match="lists one value"):
        check_ray_sweep(SweepSpec(fixed={"epochs": 4}, scheduler="pbt", perturb=["lr"], grid={"lr": [0.1]}))
    # the table: a trial's results file names what it trained with last, not what it started with
    (tmp_path / "trials").mkdir()
    (tmp_path / "results").mkdir()
    (tmp_path / "trials" / "trial-000.json").write_text(json.dumps({"trial": 0, "params": {"batch_size": 16}}))
    (tmp_path / "results" / "ray-0.json").write_text(json.dumps({"status": "completed", "final_loss": 0.5,
                                                                "params": {"batch_size": 6}, "epoch_losses": [0.5]}))
    assert collect_results(tmp_path, spec)[0]["params"] == {"batch_size": 6}
