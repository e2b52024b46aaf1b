"""Rank-0 checkpoints in HDF5: written atomically, verified on load, resumed on every rank.

File layout (``h5dump -A ckpt-000000100.h5`` shows it)::

    /                attrs: format, format_version, epoch, global_step, samples_seen,
                            samples_in_epoch, world_size, backend, hvdkit_version,
                            torch_version, created, checksum (CRC-32 over all dataset CRCs)
    /model/<name>    one dataset per state_dict tensor (dtype, shape kept)
    /optimizer/...   state/<param index>/<key> datasets; param_groups as JSON attribute
    /scheduler, /scaler, /loop   JSON attributes or groups
    /rng/<rank>/...  torch, numpy, python (and CUDA) generator states of every rank

Writing: only rank 0 writes, to ``.<name>.tmp<pid>`` in the same directory,
then flush, fsync, ``os.replace`` and fsync of the directory, so a crash at any
instant leaves either the old or the new file, never half of one. A ``latest``
file names the newest checkpoint; the oldest beyond ``keep`` are removed.
"""

from __future__ import annotations

import dataclasses
import os
import random
import re
import sys
import time
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from . import __version__
from .errors import CheckpointError
from .fileio import write_text_atomic
from .h5tree import ChecksumMismatch, read_tree, write_tree

__all__ = [
    "TrainingState",
    "Snapshot",
    "CheckpointManager",
    "write_checkpoint",
    "read_checkpoint",
    "verify_checkpoint",
    "summarize_checkpoint",
    "capture_rng",
    "restore_rng",
]

FORMAT = "hvdkit-checkpoint"
FORMAT_VERSION = 1
_NAME = re.compile(r"^ckpt-(\d{9})\.h5$")


@dataclass
class TrainingState:
    """Where the training loop is: enough to continue at the exact next step."""

    epoch: int = 0
    global_step: int = 0
    samples_seen: int = 0
    samples_in_epoch: int = 0
    extra: dict[str, Any] = field(default_factory=dict)


@dataclass
class Snapshot:
    """Everything one checkpoint file holds."""

    model: dict[str, torch.Tensor]
    optimizer: dict[str, Any] | None = None
    scheduler: dict[str, Any] | None = None
    scaler: dict[str, Any] | None = None
    state: TrainingState = field(default_factory=TrainingState)
    rng: list[dict[str, Any]] = field(default_factory=list)
    meta: dict[str, Any] = field(default_factory=dict)


def capture_rng() -> dict[str, Any]:
    """RNG states of torch, numpy, python (and CUDA when present) in this process."""
    state: dict[str, Any] = {
        "torch": torch.get_rng_state(),
        "numpy": np.random.get_state(),
        "python": random.getstate(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng(state: dict[str, Any]) -> None:
    """Inverse of :func:`capture_rng`."""
    torch.set_rng_state(state["torch"])
    kind, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((kind, np.asarray(keys, dtype=np.uint32), int(pos), int(has_gauss), float(cached)))
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(list(state["cuda"]))


def _content_checksum(f: Any) -> int:
    """CRC-32 over every dataset's name and recorded CRC, plus the JSON attributes."""
    import h5py

    parts: list[str] = []

    def visit(name: str, node: Any) -> None:
        if isinstance(node, h5py.Dataset):
            parts.append(f"D {name} {node.dtype} {node.shape} {int(node.attrs.get('crc32', 0))}")
        for key in sorted(node.attrs):
            if key.startswith("json:") or key in ("kind", "order", "key_types", "torch_dtype"):
                parts.append(f"A {name} {key} {node.attrs[key]}")

    f.visititems(visit)
    return zlib.crc32("\n".join(sorted(parts)).encode()) & 0xFFFFFFFF


def _fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_checkpoint(path: str | os.PathLike[str], snap: Snapshot) -> Path:
    """Write ``snap`` to ``path`` atomically (temp file, fsync, rename). Single-process."""
    import h5py

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    try:
        with h5py.File(tmp, "w", track_order=True) as f:
            state = dataclasses.asdict(snap.state)
            f.attrs.update({
                "format": FORMAT, "format_version": FORMAT_VERSION,
                "epoch": snap.state.epoch, "global_step": snap.state.global_step,
                "samples_seen": snap.state.samples_seen,
                "samples_in_epoch": snap.state.samples_in_epoch,
                "hvdkit_version": __version__, "torch_version": str(torch.__version__),
                "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                **{k: v for k, v in snap.meta.items() if isinstance(v, (str, int, float))},
            })
            write_tree(f, "model", dict(snap.model))
            for name, obj in (("optimizer", snap.optimizer), ("scheduler", snap.scheduler),
                              ("scaler", snap.scaler), ("loop", state),
                              ("rng", {str(i): r for i, r in enumerate(snap.rng)})):
                if obj is not None:
                    write_tree(f, name, obj)
            f.attrs["checksum"] = _content_checksum(f)
            f.flush()
        fd = os.open(tmp, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
        _fsync_dir(path.parent)
    finally:
        if tmp.exists():
            tmp.unlink()
    return path


def _open_checked(path: Path) -> Any:
    import h5py

    if not path.is_file():
        raise CheckpointError(f"checkpoint {path} does not exist", "list checkpoints with 'ls DIR'")
    try:
        f = h5py.File(path, "r")
    except OSError as exc:
        raise CheckpointError(
            f"checkpoint {path} is truncated or not an HDF5 file ({str(exc).splitlines()[0]})",
            "delete it; resume falls back to the previous checkpoint",
        ) from None
    if f.attrs.get("format") != FORMAT:
        f.close()
        raise CheckpointError(f"{path} is not an hvdkit checkpoint", "pass a file written by hvdkit")
    return f


def read_checkpoint(path: str | os.PathLike[str], verify: bool = True) -> Snapshot:
    """Read and (by default) verify a checkpoint; raises :class:`CheckpointError` if corrupt."""
    path = Path(path)
    f = _open_checked(path)
    try:
        with f:
            if verify and int(f.attrs["checksum"]) != _content_checksum(f):
                raise ChecksumMismatch("content checksum mismatch")
            loop = read_tree(f, "loop", verify)
            snap = Snapshot(
                model=read_tree(f, "model", verify),
                optimizer=read_tree(f, "optimizer", verify) if _present(f, "optimizer") else None,
                scheduler=read_tree(f, "scheduler", verify) if _present(f, "scheduler") else None,
                scaler=read_tree(f, "scaler", verify) if _present(f, "scaler") else None,
                state=TrainingState(**loop),
                meta={k: _plain(v) for k, v in f.attrs.items() if k != "checksum"},
            )
            rng = read_tree(f, "rng", verify) if _present(f, "rng") else {}
            snap.rng = [rng[str(i)] for i in range(len(rng))]
            return snap
    except CheckpointError:
        raise
    except (ChecksumMismatch, KeyError, OSError, ValueError, TypeError) as exc:
        raise CheckpointError(
            f"checkpoint {path} is corrupt: {exc}",
            "delete it; resume falls back to the previous checkpoint",
        ) from None


def _present(f: Any, name: str) -> bool:
    return name in f or ("json:" + name) in f.attrs


def _plain(value: Any) -> Any:
    return value.item() if isinstance(value, np.generic) else value


def verify_checkpoint(path: str | os.PathLike[str]) -> tuple[bool, str]:
    """(ok, message) without raising: used by ``hvdkit ckpt show`` and by resume."""
    try:
        read_checkpoint(path, verify=True)
    except CheckpointError as exc:
        return False, str(exc)
    return True, "checksum OK"


def summarize_checkpoint(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Metadata, tensor list (name, dtype, shape, bytes) and checksum verdict of a checkpoint."""
    f = _open_checked(Path(path))
    with f:
        meta = {k: _plain(v) for k, v in f.attrs.items()}
        tensors = []
        for name, ds in f["model"].items():
            dtype = str(ds.attrs.get("torch_dtype", ds.dtype))
            tensors.append((name.replace("%2F", "/"), dtype, tuple(ds.shape), int(ds.nbytes)))
    ok, message = verify_checkpoint(path)
    return {"meta": meta, "tensors": tensors, "checksum_ok": ok, "checksum_message": message}


def _log(msg: str) -> None:
    print(f"[hvdkit] {msg}", file=sys.stderr, flush=True)


class CheckpointManager:
    """Collective save/restore: rank 0 does the file I/O, every rank takes part.

    Each call ends in a broadcast of rank 0's outcome, which doubles as the
    barrier: no rank runs ahead of a checkpoint being written, and if rank 0
    fails, every rank raises the same :class:`CheckpointError` (no deadlock).
    """

    def __init__(self, directory: str | os.PathLike[str], backend: Any, keep: int = 3) -> None:
        self.directory, self.backend, self.keep = Path(directory), backend, keep

    # -- file housekeeping (rank 0 only) ------------------------------------------
    def checkpoints(self) -> list[Path]:
        """Checkpoint files, newest step first."""
        if not self.directory.is_dir():
            return []
        found = [p for p in self.directory.iterdir() if _NAME.match(p.name)]
        return sorted(found, key=lambda p: int(_NAME.match(p.name).group(1)), reverse=True)

    def _candidates(self) -> list[Path]:
        ordered = self.checkpoints()
        pointer = self.directory / "latest"
        if pointer.is_file():
            named = self.directory / pointer.read_text().strip()
            if named in ordered:
                ordered.remove(named)
                ordered.insert(0, named)
        return ordered

    def _prune(self) -> None:
        for old in self.checkpoints()[self.keep :]:
            old.unlink(missing_ok=True)
        for stale in self.directory.glob(".ckpt-*.tmp*"):
            stale.unlink(missing_ok=True)

    def _write_pointer(self, target: Path) -> None:
        write_text_atomic(self.directory / "latest", target.name + "\n")

    def find_latest_valid(self) -> tuple[Path, Snapshot] | None:
        """Newest checkpoint that verifies, warning about (and skipping) corrupt ones."""
        for path in self._candidates():
            try:
                return path, read_checkpoint(path, verify=True)
            except CheckpointError as exc:
                _log(f"WARNING: skipping {exc}")
        return None

    # -- collectives ------------------------------------------------------------
    def _agree(self, outcome: tuple[bool, Any] | None) -> Any:
        ok, value = self.backend.broadcast_object(outcome, 0)
        if not ok:
            raise CheckpointError(
                f"rank 0 failed to handle the checkpoint in {self.directory}: {value}",
                "check free space and permissions of the checkpoint directory",
            )
        return value

    def save(self, model: Any, optimizer: Any, scheduler: Any, state: TrainingState,
             scaler: Any = None) -> Path:
        """Collective: gather RNG states, rank 0 writes, everyone learns the outcome."""
        rng = self.backend.gather_objects(capture_rng())
        outcome: tuple[bool, Any] | None = None
        if self.backend.is_master:
            try:
                snap = Snapshot(
                    model=self.backend.unwrap(model).state_dict(),
                    optimizer=optimizer.state_dict() if optimizer is not None else None,
                    scheduler=scheduler.state_dict() if scheduler is not None else None,
                    scaler=scaler.state_dict() if scaler is not None else None,
                    state=state, rng=rng,
                    meta={"world_size": self.backend.size, "backend": self.backend.name},
                )
                path = self.directory / f"ckpt-{state.global_step:09d}.h5"
                write_checkpoint(path, snap)
                self._write_pointer(path)
                self._prune()
                outcome = (True, str(path))
            except Exception as exc:  # noqa: BLE001 - every failure must reach every rank
                outcome = (False, f"{type(exc).__name__}: {exc}")
        return Path(self._agree(outcome))

    def restore(self, model: Any, optimizer: Any, scheduler: Any = None,
                scaler: Any = None) -> TrainingState | None:
        """Collective: rank 0 loads the newest valid checkpoint, then broadcasts it.

        Returns the loop state to continue from, or ``None`` for a fresh start
        (in which case rank 0's initial weights are broadcast instead).
        """
        outcome: tuple[bool, Any] | None = None
        if self.backend.is_master:
            try:
                found = self.find_latest_valid()
                if found is None:
                    outcome = (True, None)
                else:
                    path, snap = found
                    self.backend.unwrap(model).load_state_dict(snap.model)
                    if optimizer is not None and snap.optimizer is not None:
                        optimizer.load_state_dict(snap.optimizer)
                    outcome = (True, {
                        "path": str(path), "state": dataclasses.asdict(snap.state),
                        "scheduler": snap.scheduler, "scaler": snap.scaler, "rng": snap.rng,
                        "world_size": snap.meta.get("world_size"),
                    })
            except Exception as exc:  # noqa: BLE001
                outcome = (False, f"{type(exc).__name__}: {exc}")
        info = self._agree(outcome)
        self.backend.broadcast_state(model, optimizer)
        if info is None:
            return None
        if scheduler is not None and info["scheduler"] is not None:
            scheduler.load_state_dict(info["scheduler"])
        if scaler is not None and info["scaler"] is not None:
            scaler.load_state_dict(info["scaler"])
        if info["world_size"] == self.backend.size and len(info["rng"]) == self.backend.size:
            restore_rng(info["rng"][self.backend.rank])
        if self.backend.is_master:
            _log(f"resumed from {info['path']} (step {info['state']['global_step']})")
        return TrainingState(**info["state"])
