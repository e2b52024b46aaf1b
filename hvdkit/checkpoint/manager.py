"""Collective checkpoints of a states dict: rank 0 writes and reads, every rank takes part.

::

    ckpt = CheckpointManager("ckpt", backend, keep=3, keep_best="val_loss:min")
    states = {"model": model, "optimizer": optimizer, "sampler": sampler, "step": 0}
    restored = ckpt.restore(states)          # newest valid file, loaded in place on every rank
    ...
    ckpt.save(step, states, metrics={"val_loss": 0.41})

Each call ends in a broadcast of rank 0's outcome, which doubles as the barrier: no rank
runs ahead of a checkpoint being written, and if rank 0 fails every rank raises the same
:class:`CheckpointError` (no deadlock). A ``latest`` file names the newest checkpoint; the
oldest beyond ``keep`` are removed, except the best one when ``keep_best`` names a metric
(its record is the JSON file ``best``).
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .. import state as states_mod
from ..config import parse_keep_best
from ..errors import EXIT_NONFINITE, CheckpointError, ConfigError, first_line
from ..fileio import write_json_atomic, write_text_atomic
from ..log import diag, warn
from .fileformat import (
    OpenCheckpoint,
    Snapshot,
    checkpoint_name,
    damaged_tensor,
    drain,
    open_checkpoint,
    step_of,
    write_checkpoint,
)
from .rng import capture_rng, restore_rng

__all__ = ["CheckpointManager", "Restored", "parse_keep_best"]


class _NonFinite(Exception):
    """A module tensor about to be written holds NaN or inf (its name is the message)."""


def _finite_weights(kinds: dict[str, str], step: int) -> Any:
    """The writer's check of each tensor: a module's floating-point weights must be finite."""
    import torch

    def check(name: str, tensor: Any) -> None:
        key, _, rest = name.lstrip("/").partition("/")
        # a sum is finite only if every element is (NaN and inf carry through it), and it is
        # one pass with no boolean copy: 25x isfinite's speed; a sum that overflows is checked
        if kinds.get(key) == "module" and isinstance(tensor, torch.Tensor) and tensor.is_floating_point() \
                and not bool(torch.isfinite(tensor.sum())) and not bool(torch.isfinite(tensor).all()):
            raise _NonFinite(f"{key}: {rest.replace('%2F', '/').replace('%25', '%')}")

    return check


@dataclass
class Restored:
    """What :meth:`CheckpointManager.restore` loaded."""

    path: Path
    step: int
    world_size: int | None
    metrics: dict[str, float] = field(default_factory=dict)
    remainder: dict[str, Any] = field(default_factory=dict)  # saved states the dict did not name


class CheckpointManager:
    """Rank-0 HDF5 checkpoints of any states dict, in ``directory``; collective calls."""

    def __init__(self, directory: str | os.PathLike[str], backend: Any, keep: int = 3,
                 keep_best: str | None = None) -> None:
        if keep < 1:
            raise ConfigError("keep must be >= 1", "keep at least one checkpoint")
        self.directory, self.backend, self.keep = Path(directory), backend, keep
        self.best_metric = parse_keep_best(keep_best)

    # -- files (rank 0) -------------------------------------------------------------------
    def checkpoints(self) -> list[Path]:
        """Checkpoint files, newest step first."""
        if not self.directory.is_dir():
            return []
        found = [p for p in self.directory.iterdir() if step_of(p) is not None]
        return sorted(found, key=lambda p: step_of(p) or 0, reverse=True)

    def path_for(self, step: int) -> Path:
        return self.directory / checkpoint_name(step)

    def best(self) -> dict[str, Any] | None:
        """The record of the best checkpoint so far (``file``, ``step``, ``metric``, ``mode``, ``value``)."""
        try:
            record = json.loads((self.directory / "best").read_text())
        except (OSError, ValueError):
            return None
        return record if isinstance(record, dict) and "file" in record else None

    def _candidates(self) -> list[Path]:
        ordered = self.checkpoints()
        try:
            named = self.directory / (self.directory / "latest").read_text().strip()
        except (OSError, UnicodeDecodeError, ValueError):
            named = None  # no pointer, or a damaged one: newest step first is the fallback
        if named is not None and named in ordered:
            ordered.remove(named)
            ordered.insert(0, named)
        return ordered

    def _prune(self) -> None:
        best = self.best()
        keep_also = {best["file"]} if best else set()
        for old in self.checkpoints()[self.keep:]:
            if old.name not in keep_also:
                old.unlink(missing_ok=True)
        for stale in self.directory.glob(".ckpt-*.tmp*"):
            stale.unlink(missing_ok=True)

    def _record_best(self, path: Path, step: int, metrics: dict[str, float]) -> None:
        if self.best_metric is None:
            return
        metric, mode = self.best_metric
        value = metrics.get(metric)
        if not isinstance(value, (int, float)) or not math.isfinite(value):
            return
        best = self.best()
        if best is not None and best.get("metric") == metric and (self.directory / best["file"]).is_file():
            if (value >= best["value"]) if mode == "min" else (value <= best["value"]):
                return
        write_json_atomic(self.directory / "best", {"file": path.name, "step": step, "metric": metric,
                                                    "mode": mode, "value": value})

    def find_latest_valid(self) -> OpenCheckpoint | None:
        """Newest checkpoint that verifies, held open (its tensors unread; close it), warning
        about (and skipping) corrupt ones."""
        for path in self._candidates():
            try:
                return open_checkpoint(path, verify=True)
            except CheckpointError as exc:
                warn(f"skipping {path.name}: {exc.message}; trying the previous checkpoint")
        return None

    # -- collectives ----------------------------------------------------------------------
    def _agree(self, outcome: tuple[bool, Any] | None) -> Any:
        ok, value = self.backend.broadcast_object(outcome, 0)
        if not ok:  # value is (message, hint, exit code) from rank 0's exception
            err = CheckpointError(f"rank 0 could not handle the checkpoint: {value[0]}", value[1])
            err.echo = self.backend.is_master  # every rank raises it; one prints it
            err.exit_code = value[2]
            raise err
        return value

    @staticmethod
    def _failure(exc: Exception) -> tuple[bool, tuple[str, str, int]]:
        if isinstance(exc, CheckpointError):
            return False, (exc.message, exc.hint or "", exc.exit_code)
        return False, (f"{type(exc).__name__}: {first_line(exc)}",
                       "check the checkpoint directory (free space, permissions)", 1)

    def save(self, step: int, states: dict[str, Any], metrics: dict[str, float] | None = None,
             skip_nonfinite: bool = False) -> Path | None:
        """Collective: capture ``states`` and every rank's RNG; rank 0 writes ``ckpt-<step>.h5``.

        Module weights holding NaN/inf are never written: that raises :class:`CheckpointError`,
        or with ``skip_nonfinite`` logs one warning and returns ``None``. Either way the
        older checkpoints stay (nothing is pruned).
        """
        if self.best_metric is not None and metrics and self.best_metric[0] not in metrics:
            # a metric that is never produced would keep no best file, silently: said at the
            # first save that has metrics, on every rank (they pass the same), before anything
            err = ConfigError(f"keep_best {self.best_metric[0]!r} is not among the metrics saved with step {step}: "
                              f"{', '.join(sorted(metrics))}",
                              "name one of them (hvdkit.evaluate(..., prefix='val_') gives val_loss, val_accuracy)")
            err.echo = self.backend.is_master
            raise err
        rng = self.backend.gather_objects(capture_rng())
        captured = states_mod.capture(states, self.backend, lazy=True)  # sharded tensors: fetched as written
        kinds = states_mod.kinds(states)
        snap = Snapshot(states=captured, rng=rng, meta={
            "step": step, "world_size": self.backend.size, "backend": self.backend.name,
            "states": kinds, "metrics": dict(metrics or {})})
        outcome: tuple[bool, Any] | None = None
        if not self.backend.is_master:
            drain(snap)  # every sharded tensor's gather, in the writer's order
        else:
            try:
                path = write_checkpoint(self.path_for(step), snap, validate=_finite_weights(kinds, step))
                write_text_atomic(self.directory / "latest", path.name + "\n")
                self._record_best(path, step, dict(metrics or {}))
                self._prune()
                outcome = (True, str(path))
            except _NonFinite as bad:
                if not skip_nonfinite:
                    refusal = CheckpointError(
                        f"not saving step {step}: parameter {bad} holds NaN/inf; the previous checkpoints are kept",
                        "lower --lr or check the data; resume restarts from the last finite one")
                    refusal.exit_code = EXIT_NONFINITE  # diverged: the same run would again
                    outcome = self._failure(refusal)
                else:
                    warn(f"not saving step {step}: parameter {bad} holds NaN/inf; the previous checkpoints are kept")
                    outcome = (True, None)
            except Exception as exc:  # every failure must reach every rank
                outcome = self._failure(exc)
        written = self._agree(outcome)
        return Path(written) if written is not None else None

    def restore(self, states: dict[str, Any], path: str | os.PathLike[str] | None = None,
                strict: bool = True) -> Restored | None:
        """Collective: rank 0 reads the newest valid checkpoint (or ``path``); every rank loads it.

        Rank 0 loads the file into ``states``, then every rank takes rank 0's states
        (:func:`hvdkit.state.broadcast`); with no checkpoint, rank 0's *fresh* states are
        broadcast, so every rank starts from the same weights either way. Each rank's RNG is
        restored when the world size is the one saved. Returns ``None`` for a fresh start.

        The file is read once: its metadata is verified first, and each tensor as it is read
        (``open_checkpoint(as_read=True)``). A damaged tensor found while rank 0 loads it, or
        while a sharded strategy sends it on, makes every rank load the previous checkpoint
        instead; when there is none, the restore fails (the states already hold part of the
        damaged one, so a fresh start is no longer possible).
        """
        skipped: list[Path] = []
        opened: OpenCheckpoint | None = None
        try:
            while True:
                outcome: tuple[bool, Any] | None = None
                if self.backend.is_master:
                    try:
                        opened, outcome = self._load(states, path, strict, skipped)
                    except Exception as exc:
                        outcome = self._failure(exc)
                info = self._agree(outcome)
                states_mod.broadcast(states, self.backend, root=0)
                # tensors a sharded strategy read while it sent them on: checked now, agreed by
                # every rank (a failure raises on each; "previous": every rank loads again)
                late: tuple[bool, Any] | None = (True, None) if self.backend.is_master else None
                if opened is not None and opened.damaged:
                    late = self._damage(opened, path, skipped)
                    opened.close()
                    opened = None
                if self._agree(late) is None:
                    break
        finally:
            if opened is not None:
                opened.close()
        if info is None:
            return None
        if info["world_size"] == self.backend.size and len(info["rng"]) == self.backend.size:
            restore_rng(info["rng"][self.backend.rank])
        if self.backend.is_master:
            diag(f"resumed from {info['path']} (step {info['step']})")
        return Restored(path=Path(info["path"]), step=int(info["step"]), world_size=info["world_size"],
                        metrics=info["metrics"], remainder=info["remainder"])

    def _load(self, states: dict[str, Any], path: str | os.PathLike[str] | None, strict: bool,
              skipped: list[Path]) -> tuple[OpenCheckpoint | None, tuple[bool, Any]]:
        """Rank 0: load the newest checkpoint that verifies as it is read (or ``path``) into
        ``states``, skipping those in ``skipped``; (the file held open, the outcome to agree on)."""
        candidates = [Path(path)] if path is not None else [p for p in self._candidates() if p not in skipped]
        for candidate in candidates:
            try:
                opened = open_checkpoint(candidate, as_read=True)
            except CheckpointError as exc:
                if path is not None:
                    raise
                warn(f"skipping {candidate.name}: {exc.message}; trying the previous checkpoint")
                continue
            try:
                snap = opened.snapshot
                # tensors stay in the file: each is read when the strategy loads it, or
                # when the broadcast sends it on
                remainder = states_mod.apply(states, snap.states, self.backend, strict=strict)
            except BaseException:
                opened.close()
                raise
            if opened.damaged:
                failure = self._damage(opened, path, skipped)
                opened.close()
                if failure[0] is False:
                    return None, failure
                continue
            return opened, (True, {"path": str(opened.path), "step": snap.step, "rng": snap.rng,
                                   "world_size": snap.meta.get("world_size"), "metrics": snap.metrics,
                                   "remainder": remainder})
        if skipped:  # a damaged one was loaded in part: the states are no longer fresh
            return None, self._failure(CheckpointError(
                f"no checkpoint in {self.directory} verifies, and the states already hold part of "
                f"{skipped[-1].name}, whose tensors were damaged", "move the damaged checkpoints out of "
                f"{self.directory} to start fresh, or put back a copy of one"))
        return None, (True, None)

    def _damage(self, opened: OpenCheckpoint, path: str | os.PathLike[str] | None,
                skipped: list[Path]) -> tuple[bool, Any]:
        """Rank 0, a checkpoint whose tensors did not match their CRC as they were read: warn
        and add it to ``skipped`` (then ``(True, "previous")``), or the failure for ``path``."""
        error = damaged_tensor(opened.path, opened.damaged[0])
        if path is not None:
            return self._failure(error)
        warn(f"skipping {opened.path.name}: {error.message}; trying the previous checkpoint")
        skipped.append(opened.path)
        return True, "previous"
