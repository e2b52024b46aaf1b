"""One checkpoint file: a dict of named states in HDF5, sealed, written atomically.

Layout (``h5dump -A ckpt-000000100.h5`` shows it)::

    /            attrs: format, format_version (3), step, world_size, backend, states (JSON:
                        key -> kind), metrics (JSON), hvdkit_version, torch_version, created,
                        checksum (see integrity.py)
    /<key>       one group per state: a module's or optimizer's ``state_dict``, any
                 ``Stateful``'s, or a plain value (then a JSON attribute ``json:<key>``),
                 encoded by :mod:`hvdkit.h5tree` (tensors keep dtype and shape)
    /rng/<rank>  torch, numpy, python (and CUDA) generator states of every rank

Format version 2 files (hvdkit 0.2: groups model, optimizer, scheduler, scaler, loop) read
as states of those names. The whole file is built in memory and written with plain
``write()`` (:func:`hvdkit.fileio.write_bytes_atomic`): a full disk then fails in a call we
can report, not inside HDF5's metadata cache (which crashed the process at exit).
"""

from __future__ import annotations

import errno
import io
import json
import os
import re
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from .. import __version__
from ..errors import CheckpointError, first_line
from ..fileio import write_bytes_atomic
from ..h5tree import ChecksumMismatch, read_tree, write_tree
from .integrity import USERBLOCK, HeaderError, content_checksum, seal, unseal

__all__ = ["Snapshot", "write_checkpoint", "read_checkpoint", "verify_checkpoint", "checkpoint_name",
           "step_of", "FORMAT", "FORMAT_VERSION", "RESERVED", "DAMAGED_HINT", "open_checked", "human_size"]

FORMAT = "hvdkit-checkpoint"
FORMAT_VERSION = 3
RESERVED = ("rng",)  # group names that are not states
_NAME = re.compile(r"^ckpt-(\d{9})\.h5$")
DAMAGED_HINT = "delete it or let resume fall back to the previous checkpoint"


def checkpoint_name(step: int) -> str:
    """The file name of the checkpoint of ``step`` (the one place it is spelled)."""
    return f"ckpt-{step:09d}.h5"


def step_of(path: str | os.PathLike[str]) -> int | None:
    """The step a checkpoint file name holds, or ``None`` if it is not one."""
    m = _NAME.match(Path(path).name)
    return int(m.group(1)) if m else None


@dataclass
class Snapshot:
    """Everything one checkpoint file holds: named states, every rank's RNG, metadata."""

    states: dict[str, Any] = field(default_factory=dict)
    rng: list[dict[str, Any]] = field(default_factory=list)
    meta: dict[str, Any] = field(default_factory=dict)

    @property
    def step(self) -> int:
        return int(self.meta.get("step", 0))

    @property
    def metrics(self) -> dict[str, float]:
        return dict(self.meta.get("metrics") or {})

    def __getitem__(self, key: str) -> Any:
        return self.states[key]


def _check_keys(states: dict[str, Any]) -> None:
    for key in states:
        if not isinstance(key, str) or not key or "/" in key or key in RESERVED or key.startswith("json:"):
            raise CheckpointError(f"state name {key!r} cannot be stored",
                                  f"use a plain name without '/' (not {', '.join(RESERVED)})")


def _encode(snap: Snapshot) -> bytes:
    """The whole checkpoint file as bytes, built in memory and sealed."""
    import h5py
    import torch

    _check_keys(snap.states)
    meta = {k: v for k, v in snap.meta.items() if k not in ("metrics", "states")}
    buffer = io.BytesIO()
    with h5py.File(buffer, "w", track_order=True, userblock_size=USERBLOCK) as f:
        f.attrs.update({
            "format": FORMAT, "format_version": FORMAT_VERSION, "step": snap.step,
            "hvdkit_version": __version__, "torch_version": str(torch.__version__),
            "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            **{k: v for k, v in meta.items() if isinstance(v, (str, int, float))},
            "states": json.dumps(snap.meta.get("states") or {k: "value" for k in snap.states}),
            "metrics": json.dumps(snap.meta.get("metrics") or {}),
        })
        for key, value in snap.states.items():
            write_tree(f, key, value)
        if snap.rng:
            write_tree(f, "rng", {str(i): r for i, r in enumerate(snap.rng)})
        f.attrs["checksum"] = content_checksum(f)
    return seal(bytearray(buffer.getvalue()))


def human_size(size: float) -> str:
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
            f"disk full: checkpoint {path.name} needs {human_size(size)}, {human_size(free)} free in {where}",
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
    """Write ``snap`` to ``path`` atomically and durably. Single-process.

    Raises :class:`CheckpointError` (disk full, permission, not a directory) with the
    previous file at ``path`` intact and no temporary file left behind.
    """
    path = Path(path)
    data = _encode(snap)
    try:
        return write_bytes_atomic(path, data, durable=True, check_space=True, hold="checkpoint-write")
    except OSError as exc:
        raise _write_error(path, exc, len(data)) from None


def _read_bytes(path: Path) -> bytes:
    """The file's bytes after the sealed header matched; HDF5 never sees damage."""
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        raise CheckpointError(f"checkpoint {path} does not exist", "list checkpoints with 'ls DIR'") from None
    except IsADirectoryError:
        raise CheckpointError(f"{path} is a directory", "pass a ckpt-*.h5 file") from None
    except OSError as exc:
        raise CheckpointError(f"cannot read checkpoint {path}: {exc.strerror}",
                              "check the file's permissions and the file system") from None
    try:
        unseal(data)
    except HeaderError as exc:
        hint = "pass a file written by hvdkit" if "not an hvdkit" in str(exc) else DAMAGED_HINT
        raise CheckpointError(f"checkpoint {path} {exc}", hint) from None
    return data


def open_checked(path: Path) -> Any:
    """An open, read-only ``h5py.File`` of a checkpoint whose header verified."""
    import h5py

    data = _read_bytes(path)
    try:
        f = h5py.File(io.BytesIO(data), "r")
    except Exception as exc:  # a damaged superblock raises many types
        raise CheckpointError(f"checkpoint {path} is truncated or not an HDF5 file ({first_line(exc)})",
                              DAMAGED_HINT) from None
    try:
        is_ours = f.attrs.get("format") == FORMAT
    except Exception:
        is_ours = False
    if not is_ours:
        f.close()
        raise CheckpointError(f"{path} is not an hvdkit checkpoint (or its header is damaged)",
                              "pass a file written by hvdkit")
    return f


def _plain(value: Any) -> Any:
    return value.item() if isinstance(value, np.generic) else value


def _read_meta(f: Any) -> dict[str, Any]:
    meta = {k: _plain(v) for k, v in f.attrs.items() if k != "checksum"}
    for key in ("states", "metrics"):
        meta[key] = json.loads(meta[key]) if isinstance(meta.get(key), str) else {}
    if int(meta.get("format_version", 0)) < 3:  # v2: the step lived in the loop state
        meta["step"] = int(meta.get("global_step", 0))
        meta["states"] = {k: "value" for k in ("model", "optimizer", "scheduler", "scaler", "loop")
                          if k in f or ("json:" + k) in f.attrs}
    return meta


def read_checkpoint(path: str | os.PathLike[str], verify: bool = True, tensors: bool = True) -> Snapshot:
    """Read and (by default) verify a checkpoint; raises :class:`CheckpointError` if corrupt.

    ``tensors=False`` leaves tensors as the numpy arrays stored (no torch needed). Every read
    is inside the guard: a damaged file raises :class:`CheckpointError` and nothing else,
    whatever part of it the damage hit.
    """
    path = Path(path)
    f = open_checked(path)
    try:
        with f:
            meta = _read_meta(f)
            # dataset CRCs first (read_tree checks them): they name the damaged tensor
            states = {key: read_tree(f, key, verify, tensors) for key in meta["states"]}
            rng = read_tree(f, "rng", verify, tensors) if "rng" in f else {}
            if verify and int(f.attrs["checksum"]) != content_checksum(f):
                raise ChecksumMismatch("content checksum mismatch (an attribute, name or "
                                       "state value differs from what was written)")
            return Snapshot(states=states, rng=[rng[str(i)] for i in range(len(rng))], meta=meta)
    except CheckpointError:
        raise
    except Exception as exc:  # any damage is "corrupt", never a traceback
        raise CheckpointError(f"checkpoint {path} is corrupt: {first_line(exc)}", DAMAGED_HINT) from None


def verify_checkpoint(path: str | os.PathLike[str]) -> tuple[bool, str]:
    """(ok, message) without raising: used by ``hvdkit ckpt verify`` and by resume."""
    try:
        read_checkpoint(path, verify=True, tensors=False)
    except CheckpointError as exc:
        return False, str(exc)
    return True, "checksum OK"
