"""Hyperparameter sweeps without Ray: a grid or random space in YAML, run locally N at a time
or as a Slurm job array, results gathered into one table and plot.

Space file::

    metric: val_loss            # final_loss (training), or a held-out metric: val_loss, val_accuracy
                                # (needs val_fraction or val_data in fixed:); lower is better unless mode: max
    mode: min
    fixed: {model: mlp, epochs: 3, val_fraction: 0.1}
    grid:   {lr: [0.005, 0.02], momentum: [0.5, 0.9]}
    # or
    random: {trials: 8, seed: 0, params: {lr: {loguniform: [1.0e-3, 1.0e-1]}, optimizer: [sgd, adam]}}
    scheduler: asha             # optional: stop bad trials early (hvdkit.asha); none is the default
    eta: 3                      # keep the best 1/eta at each rung
    grace: 1                    # first rung, in epochs; rungs at grace * eta**k below fixed.epochs
    # scheduler: pbt            # Population Based Training, with --engine ray (hvdkit.rayrun.tune):
    # perturb: [lr]             # the keys it explores; it exploits every `grace` epochs
"""

from __future__ import annotations

import dataclasses
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

from .asha import AshaConfig, write_config
from .errors import ConfigError

__all__ = ["SweepSpec", "load_space", "expand_trials", "trial_args", "trial_command", "write_trials",
           "run_local", "collect_results", "results_table", "sweep_status", "budget_used"]


SCHEDULERS = ("none", "asha", "pbt")


@dataclass(frozen=True)
class SweepSpec:
    """A parsed space file."""

    metric: str = "final_loss"
    mode: str = "min"
    fixed: dict[str, Any] = field(default_factory=dict)
    grid: dict[str, list[Any]] = field(default_factory=dict)
    random: dict[str, Any] = field(default_factory=dict)
    scheduler: str = "none"  # or "asha": stop bad trials at rungs (hvdkit.asha); "pbt": Ray Tune's PBT
    eta: int = 3
    grace: int = 1
    perturb: list[str] = field(default_factory=lambda: ["lr"])  # pbt: the keys it explores

    def __post_init__(self) -> None:
        if self.mode not in ("min", "max"):
            raise ConfigError(f"mode {self.mode!r} is not min or max", "set mode: min or mode: max")
        if bool(self.grid) == bool(self.random):
            raise ConfigError("a sweep needs exactly one of 'grid' or 'random'", "see hvdkit sweep --help")
        for key, values in self.grid.items():
            if not isinstance(values, list) or not values:
                raise ConfigError(f"grid: {key} must be a non-empty list of values, got {values!r}",
                                  f"e.g. grid: {{{key}: [0.01, 0.1]}}")
        if self.scheduler not in SCHEDULERS:
            raise ConfigError(f"scheduler {self.scheduler!r} is not one of {', '.join(SCHEDULERS)}",
                              "use scheduler: asha, pbt (with --engine ray) or none")
        if not isinstance(self.perturb, list) or not self.perturb or \
                not all(isinstance(k, str) and re.fullmatch(r"[a-z_]+", k) for k in self.perturb):
            raise ConfigError(f"perturb: {self.perturb!r} is not a list of option names", "e.g. perturb: [lr]")
        if not re.fullmatch(r"final_loss|loss|val_\w+", self.metric):
            raise ConfigError(f"metric {self.metric!r} is not one training reports",
                              "use final_loss, or a validation metric such as val_loss or val_accuracy "
                              "(with --val-data or --val-fraction in fixed:)")
        if self.metric.startswith("val_") and not any(k in self.fixed for k in ("val_data", "val_fraction")) \
                and "dataset" not in self.fixed:
            raise ConfigError(f"metric {self.metric} needs validation data in every trial",
                              "add val_fraction: 0.1 or val_data: FILE to fixed:")
        if self.scheduler in ("asha", "pbt"):
            self.asha_config()  # validates eta, grace and the budget now, not in a trial

    @property
    def epochs(self) -> int:
        """A trial's epochs: ``fixed: {epochs: N}``, else ``hvdkit train``'s default."""
        from .config import TrainConfig

        return int(self.fixed.get("epochs", TrainConfig.epochs))

    def asha_config(self) -> AshaConfig:
        """Rungs and rule for this sweep; the budget is ``fixed: {epochs: N}``."""
        budget = self.fixed.get("epochs")
        if not isinstance(budget, int) or budget < 2:
            raise ConfigError(f"scheduler: {self.scheduler} needs the trial budget as fixed: {{epochs: N}} with N >= 2",
                              "add epochs to fixed:, e.g. fixed: {epochs: 9}")
        return AshaConfig(budget=budget, eta=self.eta, grace=self.grace, mode=self.mode, metric=self.metric)


def load_space(path: str | os.PathLike[str]) -> SweepSpec:
    """Parse and validate a YAML space file."""
    import yaml

    try:
        data = yaml.safe_load(Path(path).read_text()) or {}
    except (OSError, yaml.YAMLError) as exc:
        raise ConfigError(f"cannot read sweep space {path}: {str(exc).splitlines()[0]}",
                          "pass a YAML file with grid: or random:") from None
    if not isinstance(data, dict):
        raise ConfigError(f"sweep space {path} must be a mapping of metric, grid/random, fixed, ...",
                          "see hvdkit sweep --help")
    keys = {"metric", "mode", "fixed", "grid", "random", "scheduler", "eta", "grace", "perturb"}
    unknown = set(data) - keys
    if unknown:
        raise ConfigError(f"unknown key(s) in {path}: {', '.join(sorted(unknown))}",
                          f"use {', '.join(sorted(keys))}")
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


def trial_command(out: Path, spec: SweepSpec, trial: int, params: dict[str, Any]) -> list[str]:
    """The ``hvdkit train`` options of one trial (with its ASHA directory and number)."""
    args = trial_args({**spec.fixed, **params})
    if spec.scheduler == "asha":
        args += ["--asha-dir", str(out / "asha"), "--asha-trial", str(trial)]
    return args


def write_trials(out: Path, spec: SweepSpec) -> list[dict[str, Any]]:
    """Write ``trials/trial-NNN.json``, ``params.txt`` (one line of options per trial), ``asha/``."""
    import shlex

    trials = expand_trials(spec)
    (out / "trials").mkdir(parents=True, exist_ok=True)
    if spec.scheduler == "asha":
        write_config(out / "asha", spec.asha_config())
    lines = []
    for i, params in enumerate(trials):
        (out / "trials" / f"trial-{i:03d}.json").write_text(json.dumps({"trial": i, "params": params}) + "\n")
        lines.append(" ".join(shlex.quote(a) for a in trial_command(out, spec, i, params)))
    (out / "params.txt").write_text("\n".join(lines) + "\n")
    (out / "spec.json").write_text(json.dumps(dataclasses.asdict(spec), indent=2) + "\n")
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
            train = [*trial_command(out, spec, i, params), "--metrics-file", str(results / f"local-{i}.json")]
            argv += (["run", "-np", str(np), "--backend", backend, *train] if np > 1
                     else ["train", "--backend", backend, *train])  # one rank: no launcher needed
            log = open(out / "trials" / f"trial-{i:03d}.log", "wb")  # closed below
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
    """One row per trial: params, status, epochs trained, the metric, the loss curve, the file."""
    trials = [json.loads(p.read_text()) for p in sorted((out / "trials").glob("trial-*.json"))]
    found: dict[int, Path] = {}
    for path in (out / "results").glob("*.json"):
        m = _TASK.search(path.name)
        if m:
            found[int(m.group(1))] = path
    rows = []
    for t in sorted(trials, key=lambda t: t["trial"]):
        path: Path | None = found.get(t["trial"])  # type: ignore[no-redef]
        data = json.loads(path.read_text()) if path else {}
        curve = metric_curve(data, spec.metric)
        status = data.get("status", "completed") if path else "failed"
        rows.append({"trial": t["trial"], "params": t["params"], "status": status, "epochs": len(curve),
                     spec.metric: data.get(spec.metric) if path else None, "curve": curve,
                     "file": str(path) if path else None})
    return rows


def metric_curve(metrics: dict[str, Any], metric: str) -> list[float]:
    """The metric per epoch from a trial's metrics file (``final_loss``: the epoch loss)."""
    key = "loss" if metric in ("final_loss", "loss") else metric
    history = metrics.get("history") or [{"loss": v} for v in metrics.get("epoch_losses", [])]
    return [float(r[key]) for r in history if isinstance(r.get(key), (int, float))]


def best_trial(rows: list[dict[str, Any]], spec: SweepSpec) -> dict[str, Any] | None:
    """The best *completed* trial (a pruned trial's early value is not comparable)."""
    ok = [r for r in rows if r["status"] == "completed" and isinstance(r[spec.metric], (int, float))
          and math.isfinite(r[spec.metric])]
    if not ok:
        return None
    return (min if spec.mode == "min" else max)(ok, key=lambda r: r[spec.metric])


def budget_used(rows: list[dict[str, Any]], spec: SweepSpec) -> tuple[int, int]:
    """(trial-epochs trained, trial-epochs a full grid would train)."""
    return sum(r["epochs"] for r in rows), spec.epochs * len(rows)


def results_table(rows: list[dict[str, Any]], spec: SweepSpec) -> str:
    """Markdown table (trial, params, epochs reached, metric, status), best trial marked."""
    keys = sorted({k for r in rows for k in r["params"]})
    best = best_trial(rows, spec)
    lines = ["| trial | " + " | ".join(keys) + f" | epochs | {spec.metric} | status |",
             "|---" * (len(keys) + 4) + "|"]
    for r in rows:
        value = r[spec.metric]
        shown = "-" if value is None else f"{value:.6g}"
        mark = " (best)" if best is r else ""
        lines.append(f"| {r['trial']}{mark} | " + " | ".join(str(r["params"].get(k, "")) for k in keys)
                     + f" | {r['epochs']} | {shown} | {r['status']} |")
    used, full = budget_used(rows, spec)
    lines.append(f"\ntrial-epochs used: {used} of {full} for a full grid ({used / max(full, 1):.0%})")
    return "\n".join(lines) + "\n"


def sweep_status(out: Path) -> str:
    """Progress of a (possibly running) sweep: one line per trial from what is on disk."""
    spec = SweepSpec(**json.loads((out / "spec.json").read_text()))
    rows = collect_results(out, spec)
    decided: dict[int, list[dict[str, Any]]] = {}
    for path in sorted((out / "asha" / "decisions").glob("trial-*.json")):
        d = json.loads(path.read_text())
        decided.setdefault(int(d["trial"]), []).append(d)
    lines = [f"sweep {out} ({spec.scheduler}, {len(rows)} trials)"]
    for r in rows:
        status = r["status"]
        rungs = decided.get(r["trial"], [])
        if status == "failed":  # no result yet: running, waiting, or dead
            status = "running" if (out / "trials" / f"trial-{r['trial']:03d}.log").exists() or rungs \
                else "waiting"
        last = f", last rung epoch {rungs[-1]['epoch']} {'continue' if rungs[-1]['go_on'] else 'pruned'}" \
            if rungs else ""
        value = f" {spec.metric} {r[spec.metric]:.6g}" if isinstance(r[spec.metric], float) else ""
        lines.append(f"trial {r['trial']:>3} {status:<9} epochs {r['epochs']}{value}{last}  {r['params']}")
    used, full = budget_used(rows, spec)
    lines.append(f"trial-epochs so far: {used} of {full}")
    return "\n".join(lines) + "\n"


def plot_results(rows: list[dict[str, Any]], spec: SweepSpec, path: Path) -> Path:
    """Loss per epoch of every trial; pruned trials dashed and ended with an x, the best bold."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    best = best_trial(rows, spec)
    fig, ax = plt.subplots(figsize=(6.5, 4))
    for r in rows:
        if not r["curve"]:
            continue
        epochs = list(range(1, len(r["curve"]) + 1))
        pruned = r["status"] == "pruned"
        line, = ax.plot(epochs, r["curve"], "--" if pruned else "-", lw=2.5 if r is best else 1,
                        label=f"trial {r['trial']}" + (" (best)" if r is best else ""))
        if pruned:
            ax.plot(epochs[-1], r["curve"][-1], "x", color=line.get_color(), ms=8)
    ax.set_xlabel("epoch")
    ax.set_ylabel("epoch loss" if spec.metric == "final_loss" else spec.metric)
    used, full = budget_used(rows, spec)
    ax.set_title(f"sweep ({spec.scheduler}): x = pruned; {used}/{full} trial-epochs")
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
