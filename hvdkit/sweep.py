"""Hyperparameter sweeps without Ray: a grid or random space in YAML, run locally N at a time
or as a Slurm job array, results gathered into one table and plot.

Space file::

    metric: final_loss          # any key of the metrics JSON; lower is better unless mode: max
    mode: min
    fixed: {model: mlp, epochs: 3}
    grid:   {lr: [0.005, 0.02], momentum: [0.5, 0.9]}
    # or
    random: {trials: 8, seed: 0, params: {lr: {loguniform: [1.0e-3, 1.0e-1]}, optimizer: [sgd, adam]}}
"""

from __future__ import annotations

import itertools
import json
import math
import os
import random
import re
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .errors import ConfigError

__all__ = ["SweepSpec", "load_space", "expand_trials", "trial_args", "write_trials", "run_local",
           "collect_results", "results_table"]


@dataclass(frozen=True)
class SweepSpec:
    """A parsed space file."""

    metric: str = "final_loss"
    mode: str = "min"
    fixed: dict[str, Any] = field(default_factory=dict)
    grid: dict[str, list[Any]] = field(default_factory=dict)
    random: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.mode not in ("min", "max"):
            raise ConfigError(f"mode {self.mode!r} is not min or max", "set mode: min or mode: max")
        if bool(self.grid) == bool(self.random):
            raise ConfigError("a sweep needs exactly one of 'grid' or 'random'", "see hvdkit sweep --help")


def load_space(path: str | os.PathLike[str]) -> SweepSpec:
    """Parse and validate a YAML space file."""
    import yaml

    try:
        data = yaml.safe_load(Path(path).read_text()) or {}
    except (OSError, yaml.YAMLError) as exc:
        raise ConfigError(f"cannot read sweep space {path}: {str(exc).splitlines()[0]}",
                          "pass a YAML file with grid: or random:") from None
    unknown = set(data) - {"metric", "mode", "fixed", "grid", "random"}
    if unknown:
        raise ConfigError(f"unknown key(s) in {path}: {', '.join(sorted(unknown))}",
                          "use metric, mode, fixed, grid, random")
    return SweepSpec(**data)


def _sample(dist: Any, rng: random.Random) -> Any:
    if isinstance(dist, list):
        return rng.choice(dist)
    if isinstance(dist, dict) and len(dist) == 1:
        (kind, (lo, hi)), = dist.items()
        if kind == "uniform":
            return rng.uniform(lo, hi)
        if kind == "loguniform":
            return math.exp(rng.uniform(math.log(lo), math.log(hi)))
        if kind == "int":
            return rng.randint(lo, hi)
    raise ConfigError(f"cannot sample {dist!r}", "use a list, {uniform: [a, b]}, {loguniform: [a, b]} or {int: [a, b]}")


def expand_trials(spec: SweepSpec) -> list[dict[str, Any]]:
    """Every trial's hyperparameters (without the fixed ones), in a stable order."""
    if spec.grid:
        keys = list(spec.grid)
        return [dict(zip(keys, values)) for values in itertools.product(*(spec.grid[k] for k in keys))]
    rng = random.Random(spec.random.get("seed", 0))
    trials = int(spec.random.get("trials", 8))
    params = spec.random.get("params", {})
    if trials < 1 or not params:
        raise ConfigError("random sweeps need trials >= 1 and params", "add random: {trials: N, params: {...}}")
    return [{k: _sample(v, rng) for k, v in params.items()} for _ in range(trials)]


def trial_args(params: dict[str, Any]) -> list[str]:
    """``{'lr': 0.1, 'batch_size': 32}`` -> ``['--lr', '0.1', '--batch-size', '32']`` (bools as flags)."""
    out: list[str] = []
    for key, value in params.items():
        flag = "--" + key.replace("_", "-")
        if isinstance(value, bool):
            out.append(flag if value else "--no-" + key.replace("_", "-"))
        else:
            out += [flag, repr(value) if isinstance(value, float) else str(value)]
    return out


def write_trials(out: Path, spec: SweepSpec) -> list[dict[str, Any]]:
    """Write ``trials/trial-NNN.json`` and ``params.txt`` (one line of options per trial)."""
    import shlex

    trials = expand_trials(spec)
    (out / "trials").mkdir(parents=True, exist_ok=True)
    lines = []
    for i, params in enumerate(trials):
        (out / "trials" / f"trial-{i:03d}.json").write_text(json.dumps({"trial": i, "params": params}) + "\n")
        lines.append(" ".join(shlex.quote(a) for a in trial_args({**spec.fixed, **params})))
    (out / "params.txt").write_text("\n".join(lines) + "\n")
    return trials


def run_local(out: Path, spec: SweepSpec, trials: list[dict[str, Any]], backend: str, np: int,
              parallel: int, timeout_s: float = 3600) -> list[int]:
    """Run the trials here, ``parallel`` at a time, each on ``np`` ranks; returns exit codes."""
    results = out / "results"
    results.mkdir(parents=True, exist_ok=True)
    pending = list(enumerate(trials))
    running: list[tuple[int, subprocess.Popen[bytes], float]] = []
    codes = [0] * len(trials)
    while pending or running:
        while pending and len(running) < parallel:
            i, params = pending.pop(0)
            argv = [sys.executable, "-m", "hvdkit"]
            train = [*trial_args({**spec.fixed, **params}), "--metrics-file", str(results / f"local-{i}.json")]
            argv += (["run", "-np", str(np), "--backend", backend, *train] if np > 1
                     else ["train", "--backend", "local", *train])
            log = open(out / "trials" / f"trial-{i:03d}.log", "wb")  # noqa: SIM115 - closed below
            running.append((i, subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT), time.time()))
            log.close()
        time.sleep(0.2)
        for item in list(running):
            i, proc, started = item
            if proc.poll() is None and time.time() - started > timeout_s:
                proc.kill()
            if proc.poll() is not None:
                codes[i] = proc.returncode
                running.remove(item)
    return codes


_TASK = re.compile(r"-(\d+)\.json$")


def collect_results(out: Path, spec: SweepSpec) -> list[dict[str, Any]]:
    """One row per trial: its params, the metric (None if it failed) and the source file."""
    trials = [json.loads(p.read_text()) for p in sorted((out / "trials").glob("trial-*.json"))]
    found: dict[int, Path] = {}
    for path in (out / "results").glob("*.json"):
        m = _TASK.search(path.name)
        if m:
            found[int(m.group(1))] = path
    rows = []
    for t in sorted(trials, key=lambda t: t["trial"]):
        path = found.get(t["trial"])
        value = json.loads(path.read_text()).get(spec.metric) if path else None
        rows.append({"trial": t["trial"], "params": t["params"], spec.metric: value,
                     "file": str(path) if path else None})
    return rows


def best_trial(rows: list[dict[str, Any]], spec: SweepSpec) -> dict[str, Any] | None:
    ok = [r for r in rows if isinstance(r[spec.metric], (int, float)) and math.isfinite(r[spec.metric])]
    if not ok:
        return None
    return (min if spec.mode == "min" else max)(ok, key=lambda r: r[spec.metric])


def results_table(rows: list[dict[str, Any]], spec: SweepSpec) -> str:
    """Markdown table, best trial marked."""
    keys = sorted({k for r in rows for k in r["params"]})
    best = best_trial(rows, spec)
    lines = ["| trial | " + " | ".join(keys) + f" | {spec.metric} |", "|---" * (len(keys) + 2) + "|"]
    for r in rows:
        value = r[spec.metric]
        shown = "failed" if value is None else f"{value:.6g}"
        mark = " (best)" if best is r else ""
        lines.append(f"| {r['trial']}{mark} | " + " | ".join(str(r["params"].get(k, "")) for k in keys)
                     + f" | {shown} |")
    return "\n".join(lines) + "\n"


def plot_results(rows: list[dict[str, Any]], spec: SweepSpec, path: Path) -> Path:
    """Bar chart of the metric per trial."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(max(4, len(rows) * 0.6), 3.5))
    values = [r[spec.metric] if r[spec.metric] is not None else 0 for r in rows]
    ax.bar([str(r["trial"]) for r in rows], values)
    ax.set_xlabel("trial")
    ax.set_ylabel(spec.metric)
    ax.set_title(f"sweep: {spec.metric} per trial ({spec.mode} is best)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
