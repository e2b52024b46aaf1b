"""Rank-0 checkpoints in HDF5: written atomically, verified on load, resumed on every rank.

File layout (``h5dump -A ckpt-000000100.h5`` shows it)::

    /                attrs: format, format_version, epoch, global_step, samples_seen,
                            samples_in_epoch, world_size, backend, hvdkit_version,
                            torch_version, created, checksum (CRC-32 over every name, attribute
                            and byte of the file except itself)
    /model/<name>    one dataset per state_dict tensor (dtype, shape kept)
    /optimizer/...   state/<param index>/<key> datasets; param_groups as JSON attribute
    /scheduler, /scaler, /loop   JSON attributes or groups
    /rng/<rank>/...  torch, numpy, python (and CUDA) generator states of every rank

Writing: only rank 0 writes. The file is built in memory, then written with
plain ``write()`` to ``.<name>.tmp<pid>`` in the same directory, fsync, ``os.replace`` and fsync of the directory, so a crash at any
instant leaves either the old or the new file, never half of one. A ``latest``
file names the newest checkpoint; the oldest beyond ``keep`` are removed.
"""

from __future__ import annotations

import dataclasses
import errno
import hashlib
import io
import os
import random
import re
import shutil
import time
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:  # torch is imported where tensors are made: 'hvdkit ckpt show/verify' stay light
    import torch

from . import __version__
from .errors import CheckpointError, first_line
from .fileio import write_text_atomic
from .h5tree import ChecksumMismatch, crc32_of, read_tree, write_tree
from .log import diag, warn

__all__ = [
    "TrainingState",
    "Snapshot",
    "CheckpointManager",
    "write_checkpoint",
    "read_checkpoint",
    "verify_checkpoint",
    "summarize_checkpoint",
    "nonfinite_tensor",
    "capture_rng",
    "restore_rng",
]

FORMAT = "hvdkit-checkpoint"
FORMAT_VERSION = 2
# Version 2 files start with a 512-byte HDF5 user block (HDF5 and h5dump skip it)
# holding "hvdkit-checkpoint 2", the size and the SHA-256 of every byte after it.
# A reader checks that digest *before* HDF5 parses anything: HDF5 can crash the
# process on a damaged file (a segfault on 1 of a few hundred random byte flips).
_USERBLOCK = 512
_MAGIC = b"hvdkit-checkpoint 2\n"
_NAME = re.compile(r"^ckpt-(\d{9})\.h5$")
_SPACE_MARGIN = 64 << 10  # keep a little room: a disk filled to the byte hurts everyone


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
    import torch

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
    import torch

    torch.set_rng_state(state["torch"])
    kind, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((kind, np.asarray(keys, dtype=np.uint32), int(pos), int(has_gauss), float(cached)))
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(list(state["cuda"]))


def _attr_bytes(value: Any) -> bytes:
    """A stable byte form of one attribute value (arrays in full, never abbreviated)."""
    if isinstance(value, np.ndarray):
        return f"{value.dtype.str}{value.shape}".encode() + value.tobytes()
    return repr(value).encode()


def _content_checksum(f: Any) -> int:
    """CRC-32 over everything the file holds, except the root ``checksum`` attribute itself.

    Every group and dataset by name, every attribute (the root's too) by name and
    value, every dataset's dtype, shape and *actual* bytes (not the CRC recorded
    beside it). One flipped bit anywhere in the content changes it.
    """
    import h5py

    crc = 0

    def add(data: bytes) -> None:
        nonlocal crc
        crc = zlib.crc32(data, crc)

    def add_attrs(name: str, node: Any) -> None:
        for key in sorted(node.attrs):
            if not (name == "/" and key == "checksum"):
                add(f"A {name} {key} ".encode() + _attr_bytes(node.attrs[key]) + b"\n")

    add_attrs("/", f)
    nodes: list[tuple[str, Any]] = []
    f.visititems(lambda name, node: nodes.append((name, node)))
    for name, node in sorted(nodes, key=lambda item: item[0]):
        if isinstance(node, h5py.Dataset):
            add(f"D {name} {node.dtype.str} {node.shape}\n".encode())
            crc = crc32_of(np.asarray(node[()]), crc)
        else:
            add(f"G {name}\n".encode())
        add_attrs(name, node)
    return crc & 0xFFFFFFFF


def _fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _encode(snap: Snapshot) -> bytes:
    """The whole checkpoint file as bytes, built in memory.

    HDF5 never touches the disk: a full disk then fails in a plain ``write()``
    we can report, instead of inside HDF5's metadata cache (which crashed the
    process at exit).
    """
    import h5py
    import torch

    buffer = io.BytesIO()
    with h5py.File(buffer, "w", track_order=True, userblock_size=_USERBLOCK) as f:
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
    data = bytearray(buffer.getvalue())
    body = memoryview(data)[_USERBLOCK:]
    header = _MAGIC + f"size {len(body)}\nsha256 {hashlib.sha256(body).hexdigest()}\n".encode()
    data[: len(header)] = header
    return bytes(data)


def _verified_bytes(path: Path) -> bytes:
    """The file's bytes after the user-block digest matched; never lets HDF5 see damage."""
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        raise CheckpointError(f"checkpoint {path} does not exist", "list checkpoints with 'ls DIR'") from None
    except OSError as exc:
        raise CheckpointError(f"cannot read checkpoint {path}: {exc.strerror}",
                              "check the file's permissions and the file system") from None
    if not data.startswith(_MAGIC):
        hint = "pass a file written by hvdkit"
        if data.startswith(b"\x89HDF"):
            raise CheckpointError(f"{path} is an HDF5 file but not an hvdkit checkpoint (v2)", hint)
        raise CheckpointError(f"checkpoint {path} has a damaged header or is not a checkpoint", _DAMAGED)
    try:
        lines = data[len(_MAGIC):_USERBLOCK].split(b"\n")
        size = int(lines[0].removeprefix(b"size "))
        digest = lines[1].removeprefix(b"sha256 ").decode("ascii")
        padding_clean = not any(b"\n".join(lines[2:]))
    except (IndexError, ValueError, UnicodeDecodeError):
        raise CheckpointError(f"checkpoint {path} has a damaged header", _DAMAGED) from None
    body = memoryview(data)[_USERBLOCK:]
    if len(body) != size:
        raise CheckpointError(f"checkpoint {path} is truncated or padded: {len(body)} of {size} bytes",
                              _DAMAGED)
    if not padding_clean or hashlib.sha256(body).hexdigest() != digest:
        raise CheckpointError(f"checkpoint {path} is corrupt: SHA-256 of its content does not match "
                              "the digest written with it", _DAMAGED)
    return data


def _human(size: float) -> str:
    """1536 -> '1.5 KiB'."""
    for unit in ("B", "KiB", "MiB"):
        if size < 1024:
            return f"{size:.0f} B" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return f"{size:.1f} GiB"


def _write_error(path: Path, exc: OSError, size: int) -> CheckpointError:
    """A one-line error whose hint matches the cause: space, permission, or other."""
    where = path.parent
    if exc.errno in (errno.ENOSPC, errno.EDQUOT):
        free = shutil.disk_usage(where).free if where.is_dir() else 0
        return CheckpointError(
            f"disk full: checkpoint {path.name} needs {_human(size)}, {_human(free)} free in {where}",
            "free space or point --checkpoint-dir elsewhere; the previous checkpoint is kept")
    if exc.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
        return CheckpointError(
            f"cannot write checkpoint into {where}: {exc.strerror}",
            "make the directory writable or point --checkpoint-dir elsewhere")
    if exc.errno in (errno.ENOTDIR, errno.EEXIST):
        return CheckpointError(
            f"checkpoint directory {where} is not a directory ({exc.strerror})",
            "pass a directory path to --checkpoint-dir")
    return CheckpointError(f"cannot write checkpoint {path}: {exc.strerror or exc}",
                           "check the checkpoint directory and the file system")


def write_checkpoint(path: str | os.PathLike[str], snap: Snapshot) -> Path:
    """Write ``snap`` to ``path`` atomically (temp file, fsync, rename). Single-process.

    Raises :class:`CheckpointError` (disk full, permission, not a directory) with
    the previous file at ``path`` and no temp file left behind.
    """
    path = Path(path)
    data = _encode(snap)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        if shutil.disk_usage(path.parent).free < len(data) + _SPACE_MARGIN:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
        _fsync_dir(path.parent)
    except OSError as exc:
        raise _write_error(path, exc, len(data)) from None
    finally:
        try:
            tmp.unlink(missing_ok=True)
        except OSError:
            pass  # e.g. ENOTDIR: then no temp file could exist either
    return path


_DAMAGED = "delete it or let resume fall back to the previous checkpoint"


def _open_checked(path: Path) -> Any:
    import h5py

    data = _verified_bytes(path)
    try:
        f = h5py.File(io.BytesIO(data), "r")
    except Exception as exc:  # noqa: BLE001 - a damaged superblock raises many types
        raise CheckpointError(
            f"checkpoint {path} is truncated or not an HDF5 file ({first_line(exc)})", _DAMAGED,
        ) from None
    try:
        is_ours = f.attrs.get("format") == FORMAT
    except Exception:  # noqa: BLE001
        is_ours = False
    if not is_ours:
        f.close()
        raise CheckpointError(f"{path} is not an hvdkit checkpoint (or its header is damaged)",
                              "pass a file written by hvdkit")
    return f


def read_checkpoint(path: str | os.PathLike[str], verify: bool = True, tensors: bool = True) -> Snapshot:
    """Read and (by default) verify a checkpoint; raises :class:`CheckpointError` if corrupt.

    ``tensors=False`` leaves tensors as the numpy arrays stored (no torch needed).

    Every read is inside the guard: a damaged file raises :class:`CheckpointError`
    and nothing else, whatever part of it the damage hit.
    """
    path = Path(path)
    f = _open_checked(path)
    try:
        with f:
            def tree(name: str) -> Any:
                return read_tree(f, name, verify, tensors) if _present(f, name) else None

            loop = read_tree(f, "loop", verify, tensors)  # dataset CRCs first: they name the damaged tensor
            snap = Snapshot(
                model=tree("model"), optimizer=tree("optimizer"), scheduler=tree("scheduler"),
                scaler=tree("scaler"),
                state=TrainingState(**loop),
                meta={k: _plain(v) for k, v in f.attrs.items() if k != "checksum"},
            )
            rng = tree("rng") or {}
            snap.rng = [rng[str(i)] for i in range(len(rng))]
            if verify and int(f.attrs["checksum"]) != _content_checksum(f):
                raise ChecksumMismatch("content checksum mismatch (an attribute, name or "
                                       "loop/optimizer value differs from what was written)")
            return snap
    except CheckpointError:
        raise
    except Exception as exc:  # noqa: BLE001 - any damage is "corrupt", never a traceback
        raise CheckpointError(f"checkpoint {path} is corrupt: {first_line(exc)}", _DAMAGED) from None


def _present(f: Any, name: str) -> bool:
    return name in f or ("json:" + name) in f.attrs


def _plain(value: Any) -> Any:
    return value.item() if isinstance(value, np.generic) else value


def verify_checkpoint(path: str | os.PathLike[str]) -> tuple[bool, str]:
    """(ok, message) without raising: used by ``hvdkit ckpt show`` and by resume."""
    try:
        read_checkpoint(path, verify=True, tensors=False)
    except CheckpointError as exc:
        return False, str(exc)
    return True, "checksum OK"


def summarize_checkpoint(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Metadata, tensor list (name, dtype, shape, bytes) and checksum verdict of a checkpoint.

    Raises :class:`CheckpointError` (one line) if the file cannot be read at all.
    """
    f = _open_checked(Path(path))
    try:
        with f:
            meta = {k: _plain(v) for k, v in f.attrs.items()}
            tensors = []
            for name, ds in f["model"].items():
                dtype = str(ds.attrs.get("torch_dtype", ds.dtype))
                tensors.append((name.replace("%2F", "/"), dtype, tuple(ds.shape), int(ds.nbytes)))
    except Exception as exc:  # noqa: BLE001
        raise CheckpointError(f"checkpoint {path} is corrupt: {first_line(exc)}", _DAMAGED) from None
    ok, message = verify_checkpoint(path)
    return {"meta": meta, "tensors": tensors, "checksum_ok": ok, "checksum_message": message}


def nonfinite_tensor(tensors: dict[str, torch.Tensor]) -> str | None:
    """Name of the first floating-point tensor holding NaN or inf, or ``None``."""
    import torch

    for name, t in tensors.items():
        if isinstance(t, torch.Tensor) and t.is_floating_point() and not bool(torch.isfinite(t).all()):
            return name
    return None


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
        try:
            named = self.directory / (self.directory / "latest").read_text().strip()
        except (OSError, UnicodeDecodeError, ValueError):
            named = None  # no pointer, or a damaged one: newest step first is the fallback
        if named is not None:
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
                warn(f"skipping {path.name}: {exc.message}; trying the previous checkpoint")
        return None

    # -- collectives ------------------------------------------------------------
    def _agree(self, outcome: tuple[bool, Any] | None) -> Any:
        ok, value = self.backend.broadcast_object(outcome, 0)
        if not ok:  # value is (message, hint) from rank 0's exception
            err = CheckpointError(f"rank 0 could not handle the checkpoint: {value[0]}", value[1])
            err.echo = self.backend.is_master  # every rank raises it; one prints it
            raise err
        return value

    @staticmethod
    def _failure(exc: Exception) -> tuple[bool, tuple[str, str]]:
        if isinstance(exc, CheckpointError):
            return False, (exc.message, exc.hint or "")
        return False, (f"{type(exc).__name__}: {first_line(exc)}",
                       "check the checkpoint directory (free space, permissions)")

    def save(self, model: Any, optimizer: Any, scheduler: Any, state: TrainingState,
             scaler: Any = None, skip_nonfinite: bool = False) -> Path | None:
        """Collective: gather RNG states, rank 0 writes, everyone learns the outcome.

        Weights holding NaN/inf are never written: that raises :class:`CheckpointError`,
        or with ``skip_nonfinite`` logs one warning and returns ``None``. Either way
        the older checkpoints stay (nothing is pruned).
        """
        rng = self.backend.gather_objects(capture_rng())
        outcome: tuple[bool, Any] | None = None
        if self.backend.is_master:
            try:
                weights = self.backend.unwrap(model).state_dict()
                bad = nonfinite_tensor(weights)
                if bad is not None and skip_nonfinite:
                    warn(f"not saving step {state.global_step}: parameter {bad} holds "
                         "NaN/inf; the previous checkpoints are kept")
                    outcome = (True, None)
                elif bad is not None:
                    raise CheckpointError(
                        f"not saving step {state.global_step}: parameter {bad} holds NaN/inf; "
                        "the previous checkpoints are kept",
                        "lower --lr or check the data; resume restarts from the last finite one")
                else:
                    snap = Snapshot(
                        model=weights,
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
                outcome = self._failure(exc)
        written = self._agree(outcome)
        return Path(written) if written is not None else None

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
                outcome = self._failure(exc)
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
            diag(f"resumed from {info['path']} (step {info['state']['global_step']})")
        return TrainingState(**info["state"])
