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
from .errors import ConfigError, first_line

__all__ = ["SweepSpec", "load_space", "expand_trials", "probe_trials", "trial_args", "trial_command", "write_trials",
           "run_local", "collect_results", "results_table", "sweep_status", "budget_used"]


SCHEDULERS = ("none", "asha", "pbt")
SPEC_FILE = "spec.json"  # in a sweep's --out: the space it was started with


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
        _check_fields(self)
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


_OPTION_NAME = re.compile(r"[a-z][a-z0-9_]*")
DISTRIBUTIONS = ("uniform", "loguniform", "int")


def _whole(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check_fields(spec: SweepSpec) -> None:
    """The space file's own fields have the types and ranges they need: every mistake in them is
    one ConfigError now, never a traceback in a trial or in Ray."""
    for name in ("metric", "mode", "scheduler"):
        if not isinstance(getattr(spec, name), str):
            raise ConfigError(f"{name}: {getattr(spec, name)!r} is not a string", "see hvdkit sweep --help")
    for name, low in (("eta", 2), ("grace", 1)):
        value = getattr(spec, name)
        if not _whole(value) or value < low:
            raise ConfigError(f"{name}: {value!r} is not a whole number >= {low}", f"e.g. {name}: {max(low, 3)}"
                              if name == "eta" else f"e.g. {name}: 1")
    for section in ("fixed", "grid", "random"):
        if not isinstance(getattr(spec, section), dict):
            raise ConfigError(f"{section}: must be a mapping, got {getattr(spec, section)!r}",
                              f"e.g. {section}: {{lr: ...}}" if section != "random"
                              else "e.g. random: {trials: 8, seed: 0, params: {lr: {loguniform: [1.0e-4, 0.1]}}}")
    if spec.random:
        extra = set(spec.random) - {"trials", "seed", "params"}
        if extra:
            raise ConfigError(f"random: has unknown key(s) {', '.join(sorted(map(str, extra)))}",
                              "random: takes trials, seed and params")
        for name, low in (("trials", 1), ("seed", 0)):
            value = spec.random.get(name, 0 if name == "seed" else 8)
            if not _whole(value) or value < low:
                raise ConfigError(f"random: {name}: {value!r} is not a whole number >= {low}",
                                  f"e.g. random: {{{name}: {8 if name == 'trials' else 0}}}")
        params = spec.random.get("params")
        if not isinstance(params, dict) or not params:
            raise ConfigError("random: needs params, a mapping of option to distribution",
                              "e.g. params: {lr: {loguniform: [1.0e-4, 0.1]}, optimizer: [sgd, adam]}")
        for key, dist in params.items():
            check_distribution(key, dist)
    for where, names in (("fixed", spec.fixed), ("grid", spec.grid), ("random: params", spec.random.get("params", {}))):
        for key in names:
            if not isinstance(key, str) or not _OPTION_NAME.fullmatch(key):
                raise ConfigError(f"{where}: {key!r} is not an option name",
                                  "use hvdkit train's option names with _ for -, e.g. batch_size")


def check_distribution(key: str, dist: Any) -> None:
    """A random space's entry: a non-empty list of choices, or one of ``{uniform|loguniform: [lo, hi]}``
    (numbers, lo < hi, loguniform above 0) or ``{int: [lo, hi]}`` (whole numbers, lo <= hi)."""
    hint = "use a list of choices, {uniform: [a, b]}, {loguniform: [a, b]} (a > 0) or {int: [a, b]}"
    if isinstance(dist, list):
        if not dist:
            raise ConfigError(f"random: params: {key} is an empty list of choices", hint)
        return
    if not (isinstance(dist, dict) and len(dist) == 1 and next(iter(dist)) in DISTRIBUTIONS):
        raise ConfigError(f"random: params: {key}: cannot sample {dist!r}", hint)
    (kind, bounds), = dist.items()
    number = _whole if kind == "int" else (lambda v: isinstance(v, (int, float)) and not isinstance(v, bool)
                                           and math.isfinite(v))
    if not (isinstance(bounds, list) and len(bounds) == 2 and all(number(b) for b in bounds)):
        raise ConfigError(f"random: params: {key}: {kind} takes two {'whole ' if kind == 'int' else ''}numbers "
                          f"[low, high], got {bounds!r}", hint)
    lo, hi = bounds
    if (lo > hi if kind == "int" else lo >= hi) or (kind == "loguniform" and lo <= 0):
        raise ConfigError(f"random: params: {key}: {kind} [{lo}, {hi}] is not a range"
                          + (" above 0" if kind == "loguniform" else ""), hint)


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
    if not all(isinstance(k, str) for k in data):
        raise ConfigError(f"sweep space {path} has a key that is not a name: "
                          f"{next(k for k in data if not isinstance(k, str))!r}", "see hvdkit sweep --help")
    keys = {"metric", "mode", "fixed", "grid", "random", "scheduler", "eta", "grace", "perturb"}
    unknown = set(data) - keys
    if unknown:
        raise ConfigError(f"unknown key(s) in {path}: {', '.join(sorted(unknown))}",
                          f"use {', '.join(sorted(keys))}")
    return SweepSpec(**data)


def _sample(dist: Any, rng: random.Random) -> Any:
    """One draw from an entry :func:`check_distribution` accepted."""
    if isinstance(dist, list):
        return rng.choice(dist)
    (kind, (lo, hi)), = dist.items()
    if kind == "uniform":
        return rng.uniform(lo, hi)
    if kind == "loguniform":
        return math.exp(rng.uniform(math.log(lo), math.log(hi)))
    return rng.randint(lo, hi)


def expand_trials(spec: SweepSpec) -> list[dict[str, Any]]:
    """Every trial's hyperparameters (without the fixed ones), in a stable order."""
    if spec.grid:
        keys = list(spec.grid)
        return [dict(zip(keys, values)) for values in itertools.product(*(spec.grid[k] for k in keys))]
    rng = random.Random(spec.random.get("seed", 0))
    trials = spec.random.get("trials", 8)
    params = spec.random["params"]  # both checked by SweepSpec
    return [{k: _sample(v, rng) for k, v in params.items()} for _ in range(trials)]


# lr set only in fixed: the range PBT explores it over (log scale), as Tune's PBT examples do
PBT_LR_RANGE = (1e-5, 1.0)


def perturb_ranges(spec: SweepSpec) -> dict[str, list[Any] | tuple[str, float, float]]:
    """Where PBT may move each ``perturb:`` key, within its type: a grid key or a random choice
    stays among the listed values (a list); a ``{uniform|loguniform|int: [lo, hi]}`` key stays in
    its range, an int whole (``(kind, lo, hi)``); ``lr`` set only in ``fixed:`` moves over
    :data:`PBT_LR_RANGE`. A key the space gives one value and no range is a ConfigError."""
    params = spec.random.get("params", {})
    out: dict[str, list[Any] | tuple[str, float, float]] = {}
    for key in spec.perturb:
        where = spec.grid.get(key, params.get(key))
        if isinstance(where, list):
            out[key] = list(where)
        elif isinstance(where, dict):
            (kind, (lo, hi)), = where.items()
            out[key] = (kind, lo, hi)
        elif key == "lr" and key in spec.fixed:
            out[key] = ("loguniform", *PBT_LR_RANGE)
        else:
            said = "gives it one value (fixed:) and no range" if key in spec.fixed else "does not set it"
            raise ConfigError(f"scheduler: pbt cannot perturb {key}: the space {said}",
                              f"list its values in grid: or give it a range in random: params: "
                              f"(e.g. {key}: {{uniform: [a, b]}}), or drop it from perturb:")
        if isinstance(out[key], list) and len(out[key]) < 2:
            raise ConfigError(f"scheduler: pbt cannot perturb {key}: the space lists one value for it",
                              f"list two or more, or drop {key} from perturb:")
    return out


def probe_trials(spec: SweepSpec, trials: list[dict[str, Any]]) -> list[tuple[str, dict[str, Any]]]:
    """What to check before any trial runs, each with a label naming it: every trial, and for a
    random space every value a draw could give a key (each choice, both bounds) with trial 0's
    other values: a bad choice or bound is found even when this seed did not draw it."""
    out = [(f"trial {i} {params}", params) for i, params in enumerate(trials)]
    for key, dist in spec.random.get("params", {}).items():
        values = dist if isinstance(dist, list) else next(iter(dist.values()))
        out += [(f"random: params: {key}: {value!r}", {**trials[0], key: value}) for value in values]
    return out


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
    (out / SPEC_FILE).write_text(json.dumps(dataclasses.asdict(spec), indent=2) + "\n")
    return trials


def read_spec(out: Path) -> SweepSpec:
    """The space a sweep in ``out`` (its --out) was started with; a ConfigError when ``out``
    holds none or its file is damaged."""
    path = out / SPEC_FILE
    try:
        saved = json.loads(path.read_text())
        return SweepSpec(**saved)
    except FileNotFoundError:
        raise ConfigError(f"{out} holds no sweep (no {SPEC_FILE})", "pass the --out of 'hvdkit sweep'") from None
    except (OSError, ValueError, TypeError) as exc:
        raise ConfigError(f"{path} is damaged ({first_line(exc)})",
                          "the sweep's own record cannot be read; start the sweep again in a new --out") from None


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
        # a PBT trial's results name what it trained with at the end (another trial's
        # perturbed values after an exploit), not what the space started it with
        rows.append({"trial": t["trial"], "params": data.get("params", t["params"]), "status": status,
                     "epochs": len(curve),
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
    spec = read_spec(out)
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
