"""Asynchronous successive halving (ASHA; Li et al., MLSys 2020) over a shared directory.

Trials of a sweep train independently (local processes or Slurm array tasks). At each
*rung*, epoch ``grace * eta**k`` below the budget, rank 0 of a trial records its epoch
loss in ``DIR/rungs/epoch-EEEE/trial-TTT.json`` and decides at once, from the values
recorded at that rung so far, whether the trial goes on (:func:`decide`, a pure function).
The decision, with every number it was made from, goes to
``DIR/decisions/trial-TTT-epoch-EEEE.json``; a requeued trial that reaches the same rung
again reuses it. Nothing waits for other trials: that is the "asynchronous" of ASHA.

The rule, exactly: with ``n`` values at the rung (this trial's included), the trial
continues if ``n < eta`` (too few to judge), or if its position in the ranking is below
``max(1, n // eta)``, i.e. it is in the top ``1/eta``. The ranking sorts by value, best
first (ascending for ``mode=min``); NaN is worst; equal values rank by trial id, lower
first, so a tie never depends on timing.

``eta`` defaults to 3: each rung keeps the best third, so a sweep of 9 trials already has
two rungs that prune (eta 4 prunes harder but needs 16+ trials before its second rung acts).
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from .errors import ConfigError
from .fileio import write_json_atomic

__all__ = ["AshaConfig", "Decision", "decide", "AshaTrial", "write_config", "read_config"]


@dataclass(frozen=True)
class AshaConfig:
    """Rungs at ``grace * eta**k`` epochs below ``budget`` (the trial's full epochs).

    ``metric``: what a rung compares, a key of the epoch record: ``final_loss`` (the epoch's
    training loss) or a held-out metric such as ``val_loss`` or ``val_accuracy`` (``mode: max``).
    """

    budget: int
    eta: int = 3
    grace: int = 1
    mode: str = "min"
    metric: str = "final_loss"

    def __post_init__(self) -> None:
        if self.eta < 2:
            raise ConfigError(f"asha eta must be >= 2, got {self.eta}", "use eta: 3 (keep the best third)")
        if not 1 <= self.grace < self.budget:
            raise ConfigError(f"asha grace {self.grace} must be >= 1 and below the budget of {self.budget} "
                              "epochs", "raise fixed: {epochs: N} or lower grace")
        if self.mode not in ("min", "max"):
            raise ConfigError(f"mode {self.mode!r} is not min or max", "set mode: min or max")

    def rungs(self) -> list[int]:
        """The epochs at which trials are judged: grace, grace*eta, ... below the budget."""
        out, epoch = [], self.grace
        while epoch < self.budget:
            out.append(epoch)
            epoch *= self.eta
        return out


@dataclass(frozen=True)
class Decision:
    """One trial at one rung: the verdict and everything it was computed from."""

    trial: int
    epoch: int
    value: float
    go_on: bool
    seen: dict[int, float]  # trial -> value at this rung, as visible when deciding
    keep: int               # how many of the ranking continue (0 when n < eta: all do)
    position: int           # this trial's 0-based place in the ranking
    rule: str


def _rank_key(mode: str):
    def key(item: tuple[int, float]) -> tuple[int, float, int]:
        trial, value = item
        if value is None or not math.isfinite(value):
            return (1, 0.0, trial)  # NaN/inf (or missing) rank last
        return (0, value if mode == "min" else -value, trial)
    return key


def decide(seen: dict[int, float], trial: int, epoch: int, eta: int, mode: str) -> Decision:
    """The ASHA verdict for ``trial`` given the values ``seen`` at this rung (pure)."""
    if trial not in seen:
        raise ValueError(f"trial {trial} has no value among {sorted(seen)}")
    ranking = [t for t, _ in sorted(seen.items(), key=_rank_key(mode))]
    position, n = ranking.index(trial), len(seen)
    if n < eta:
        return Decision(trial, epoch, seen[trial], True, dict(seen), 0, position,
                        f"{n} < eta={eta} values at this rung: continue")
    keep = max(1, n // eta)
    go_on = position < keep
    return Decision(trial, epoch, seen[trial], go_on, dict(seen), keep, position,
                    f"place {position + 1} of {n} ({mode}); the best {keep} = max(1, {n} // {eta}) continue")


def write_config(directory: Path, config: AshaConfig) -> None:
    """``DIR/asha.json``: what every trial of the sweep reads."""
    write_json_atomic(directory / "asha.json", asdict(config))


def read_config(directory: Path) -> AshaConfig:
    try:
        return AshaConfig(**json.loads((directory / "asha.json").read_text()))
    except (OSError, ValueError, TypeError) as exc:
        raise ConfigError(f"{directory}/asha.json is missing or invalid ({exc})",
                          "--asha-dir must be the directory of an 'hvdkit sweep --scheduler asha'") from None


class AshaTrial:
    """Rank 0's view of one trial: record a rung value, decide, keep the decision."""

    def __init__(self, directory: str | os.PathLike[str], trial: int) -> None:
        self.directory, self.trial = Path(directory), trial
        self.config = read_config(self.directory)
        self._rungs = set(self.config.rungs())

    def is_rung(self, epoch: int) -> bool:
        return epoch in self._rungs

    def _decision_path(self, epoch: int) -> Path:
        return self.directory / "decisions" / f"trial-{self.trial:03d}-epoch-{epoch:04d}.json"

    def report(self, epoch: int, value: float) -> dict[str, Any]:
        """Record ``value`` at rung ``epoch`` and return the decision (a recorded one if any)."""
        recorded = self._decision_path(epoch)
        if recorded.is_file():  # a requeued trial passing the rung again: same verdict
            return {**json.loads(recorded.read_text()), "reused": True, "metric": self.config.metric}
        rung = self.directory / "rungs" / f"epoch-{epoch:04d}"
        write_json_atomic(rung / f"trial-{self.trial:03d}.json", {"trial": self.trial, "value": value})
        seen = {}
        for path in rung.glob("trial-*.json"):
            try:
                item = json.loads(path.read_text())
                seen[int(item["trial"])] = float(item["value"])
            except (OSError, ValueError, KeyError):
                continue  # a file being replaced right now: it counts next time
        seen[self.trial] = value
        decision = asdict(decide(seen, self.trial, epoch, self.config.eta, self.config.mode))
        write_json_atomic(recorded, decision)
        return {**decision, "reused": False, "metric": self.config.metric}
