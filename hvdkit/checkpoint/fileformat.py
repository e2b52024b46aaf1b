"""One checkpoint file: a dict of named states in HDF5, sealed, written atomically, one
tensor at a time.

Layout (``h5dump -A ckpt-000000100.h5`` shows it)::

    /            attrs: format, format_version (5), step, world_size, backend, states (JSON:
                        key -> kind), metrics (JSON), hvdkit_version, torch_version, created,
                        checksum (see integrity.py)
    /<key>       one group per state: a module's or optimizer's ``state_dict`` in its
                 standard layout (the same whatever the sharding or world size), any
                 ``Stateful``'s, or a plain value (then a JSON attribute ``json:<key>``),
                 encoded by :mod:`hvdkit.h5tree` (tensors keep dtype and shape; each dataset
                 contiguous, with its CRC-32)
    /rng/<rank>  torch, numpy, python (and CUDA) generator states of every rank

Rank 0 writes, streamed: no process ever holds the file, nor the whole state, in memory
(:func:`write_checkpoint`); a restore reads one tensor at a time (:func:`open_checkpoint`).
Format 4 files (the same layout, a whole-file SHA-256 header), format 3 files (hvdkit 0.4,
built in memory, a ``hvdkit-checkpoint 2`` header) and format 2 files (hvdkit 0.2: groups
model, optimizer, scheduler, scaler, loop) read as they are.
"""

from __future__ import annotations

import errno
import json
import os
import re
import shutil
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from .. import __version__, fileio
from ..errors import CheckpointError, first_line
from ..faults import hold_point
from ..fileio import fsync_dir
from ..h5tree import (
    ChecksumMismatch,
    Deferred,
    Slot,
    SparseImage,
    Stored,
    crc32_of,
    layout_tree,
    materialize,
    read_tree,
    to_numpy,
    tree_leaves,
    write_tree,
)
from .integrity import (
    DataRangeError,
    HeaderError,
    RangeReader,
    content_checksum,
    open_ranges,
    seal_ranges,
    userblock_for,
    verify_sealed,
)

__all__ = ["Snapshot", "write_checkpoint", "drain", "read_checkpoint", "open_checkpoint", "OpenCheckpoint",
           "verify_checkpoint", "check_checkpoint", "checkpoint_name", "step_of", "FORMAT", "FORMAT_VERSION",
           "RESERVED", "DAMAGED_HINT", "open_checked", "open_metadata", "damaged_tensor", "human_size"]

FORMAT = "hvdkit-checkpoint"
FORMAT_VERSION = 5
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


def _fetched(leaf: Any) -> Any:
    """A leaf's value: a :class:`Deferred` is fetched (collective), a tensor or array is itself."""
    return leaf.fetch() if isinstance(leaf, Deferred) else leaf


def drain(snap: Snapshot) -> None:
    """What every rank but the writer runs for a :func:`write_checkpoint`: each deferred leaf
    fetched once, in the writer's order (they may be collectives), nothing written."""
    for leaf in tree_leaves(snap.states):
        if isinstance(leaf, Deferred):
            leaf.fetch()


# what a file holds beyond its tensors' bytes, for the free-space check before writing
_OVERHEAD_BYTES, _OVERHEAD_PER_LEAF = 64 << 10, 1024  # measured: 29 KiB for a 4-tensor model


def write_checkpoint(path: str | os.PathLike[str], snap: Snapshot,
                     validate: Callable[[str, Any], None] | None = None) -> Path:
    """Write ``snap`` to ``path`` atomically and durably, one tensor at a time (format 5).

    ``snap.states`` may hold :class:`~hvdkit.h5tree.Deferred` leaves: each is fetched exactly
    once, in :func:`~hvdkit.h5tree.tree_leaves` order, whatever fails (every other rank runs
    :func:`drain` to match), and dropped once its bytes are in the file: memory is the largest
    tensor, not the model. ``validate(name, tensor)`` may raise to refuse a fetched tensor.

    How: HDF5 lays out every group, attribute and (allocated, contiguous) dataset first;
    the bytes then go to their offsets with plain ``pwrite``, so a full disk fails in a call
    hvdkit reports, never inside HDF5. Then each dataset's CRC, the content checksum, and
    the sealed header (SHA-256 of the file, read back in blocks). Raises
    :class:`CheckpointError` (disk full, permission, not a directory) with the previous file
    at ``path`` intact and no temporary file left behind.
    """
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    leaves = list(tree_leaves(snap.states))
    pending = iter(leaves)  # what is still to be fetched (the drain in finally takes the rest)
    size = _OVERHEAD_BYTES + sum(_nbytes(leaf) + _OVERHEAD_PER_LEAF for leaf in leaves)
    try:
        _check_keys(snap.states)
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            if shutil.disk_usage(path.parent).free < size + fileio.SPACE_MARGIN:
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            image, slots = _layout(snap, len(leaves))
            crcs = _fill(tmp, image, slots, pending, validate)
            del image
            _seal_file(tmp, slots, crcs)
            os.replace(tmp, path)
            fsync_dir(path.parent)
        except OSError as exc:
            raise _write_error(path, exc, size) from None
    finally:
        for leaf in pending:  # after a failure: the other ranks still fetch every leaf
            _fetched(leaf)
        try:
            tmp.unlink(missing_ok=True)
        except OSError:
            pass  # e.g. ENOTDIR: then no temporary file could exist either
    return path


def _nbytes(leaf: Any) -> int:
    """A leaf's bytes: a Deferred's or an array's ``nbytes``, a tensor's ``numel * element_size``."""
    return int(leaf.nbytes) if isinstance(leaf, (Deferred, np.ndarray)) else int(leaf.numel() * leaf.element_size())


def _layout(snap: Snapshot, leaves: int) -> tuple[SparseImage, list[Slot]]:
    """Every group, attribute and empty (allocated) dataset of the file, laid out by HDF5 in
    memory: only this metadata is written there, the datasets' bytes come later. The user
    block has room for the table of the ``leaves`` data ranges (integrity.py)."""
    import h5py
    import torch

    meta = {k: v for k, v in snap.meta.items() if k not in ("metrics", "states")}
    image = SparseImage()
    with h5py.File(image, "w", track_order=True, userblock_size=userblock_for(leaves)) as f:
        f.attrs.update({
            "format": FORMAT, "format_version": FORMAT_VERSION, "step": snap.step,
            "hvdkit_version": __version__, "torch_version": str(torch.__version__),
            "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            **{k: v for k, v in meta.items() if isinstance(v, (str, int, float))},
            "states": json.dumps(snap.meta.get("states") or {k: "value" for k in snap.states}),
            "metrics": json.dumps(snap.meta.get("metrics") or {}),
            "checksum": np.uint32(0),
        })
        slots = [slot for key, value in snap.states.items() for slot in layout_tree(f, key, value)]
        if snap.rng:  # the generators' states are small and every rank's: written whole, last
            write_tree(f, "rng", {str(i): r for i, r in enumerate(snap.rng)})
    return image, slots


def _fill(tmp: Path, image: SparseImage, slots: list[Slot], pending: Iterator[Any],
          validate: Callable[[str, Any], None] | None) -> list[int]:
    """The laid-out metadata, then each leaf's bytes at its offset, fetched one at a time;
    returns their CRCs. A leaf that ``validate`` refuses stops the writing (the caller drains
    the rest). A second thread takes each leaf's CRC while this one writes it (both let go
    of the GIL): the CRC is then hidden behind the write, which the disk bounds."""
    import torch

    crcs = []
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        image.write_to(fd)
        with ThreadPoolExecutor(1, thread_name_prefix="hvdkit-crc") as pool:
            for k, slot in enumerate(slots):
                value = _fetched(next(pending))
                if validate is not None:
                    validate(slot.name, value)
                arr = to_numpy(value) if isinstance(value, torch.Tensor) else np.ascontiguousarray(value)
                if arr.dtype != slot.dtype or tuple(arr.shape) != slot.shape:
                    raise CheckpointError(f"{slot.name} is {arr.dtype} {tuple(arr.shape)} but was laid out as "
                                          f"{slot.dtype} {slot.shape}", "report this: the state changed while saving")
                arr = np.ascontiguousarray(arr)
                crc = pool.submit(crc32_of, arr)
                view = memoryview(arr).cast("B")  # type: ignore[arg-type]
                at = slot.offset or 0
                while view:
                    written = os.pwrite(fd, view, at)
                    view, at = view[written:], at + written
                crcs.append(crc.result())
                del arr, value, view
                if k == len(slots) // 2:
                    hold_point("checkpoint-write")  # a fault lands half-way (hvdkit.faults)
        if not slots:
            hold_point("checkpoint-write")
        os.fsync(fd)
    finally:
        os.close(fd)
    return crcs


def _seal_file(tmp: Path, slots: list[Slot], crcs: list[int]) -> None:
    """Each dataset's CRC and the content checksum (HDF5, in place), then the sealed header:
    the table of the datasets' byte ranges with their CRCs, and the SHA-256 of the rest."""
    import h5py

    with h5py.File(tmp, "r+") as f:
        for slot, crc in zip(slots, crcs):
            f[slot.name].attrs["crc32"] = np.uint32(crc)
        f.attrs["checksum"] = np.uint32(content_checksum(f, data_bytes=False))
    seal_ranges(tmp, [(slot.offset, int(np.prod(slot.shape, dtype=np.int64)) * slot.dtype.itemsize, crc)
                      for slot, crc in zip(slots, crcs) if slot.offset is not None])


def open_checked(path: Path) -> Any:
    """An open, read-only ``h5py.File`` of a checkpoint whose sealed header verified (the whole
    file checked in one pass first: HDF5 never sees damage)."""
    return _open_verified(path, as_read=False)[0]


def open_metadata(path: Path) -> Any:
    """:func:`open_checked` for what only reads names and attributes (``hvdkit ckpt show``'s
    listing): a format 5 file's metadata is verified (kilobytes), its tensors are not read.
    Older formats are verified whole."""
    f, reader, _ = _open_verified(path, as_read=True)
    if reader is not None:
        reader.close()  # nothing reads a tensor through it
    return f


def _open_verified(path: Path, as_read: bool) -> tuple[Any, RangeReader | None, dict[int, tuple[int, int]] | None]:
    """:func:`open_checked`, and a format 5 file's table of data ranges (``{offset: (length,
    crc)}``, else ``None``); with ``as_read``, a format 5 file's metadata alone is verified
    first, and its tensors are left to the :class:`RangeReader` returned, which checks each as
    it is read (older formats: the whole file first, and no reader)."""
    import h5py

    reader, table = None, None
    try:
        reader = open_ranges(path) if as_read else None
        if reader is None:
            table = verify_sealed(path)
        else:
            table = reader.ranges
    except DataRangeError as exc:  # the metadata verified: HDF5 may name the damaged tensor
        raise damaged_tensor(path, _dataset_at(path, exc.offset)) from None
    except FileNotFoundError:
        raise CheckpointError(f"checkpoint {path} does not exist", "list checkpoints with 'ls DIR'") from None
    except IsADirectoryError:
        raise CheckpointError(f"{path} is a directory", "pass a ckpt-*.h5 file") from None
    except HeaderError as exc:
        hint = "pass a file written by hvdkit" if "not an hvdkit" in str(exc) else DAMAGED_HINT
        raise CheckpointError(f"checkpoint {path} {exc}", hint) from None
    except OSError as exc:
        raise CheckpointError(f"cannot read checkpoint {path}: {exc.strerror}",
                              "check the file's permissions and the file system") from None
    try:
        f = h5py.File(path, "r")
    except Exception as exc:  # a damaged superblock raises many types
        if reader is not None:
            reader.close()
        raise CheckpointError(f"checkpoint {path} is truncated or not an HDF5 file ({first_line(exc)})",
                              DAMAGED_HINT) from None
    try:
        is_ours = f.attrs.get("format") == FORMAT
        if reader is not None:  # HDF5 opened the name again: the file verified, not one put there since
            st = os.fstat(f.id.get_vfd_handle())
            replaced = (st.st_dev, st.st_ino) != reader.identity()
        else:
            replaced = False
    except Exception:
        is_ours, replaced = False, False
    if replaced or not is_ours:
        f.close()
        if reader is not None:
            reader.close()
        if replaced:
            raise CheckpointError(f"checkpoint {path} was replaced while it was opened", "resume again")
        raise CheckpointError(f"{path} is not an hvdkit checkpoint (or its header is damaged)",
                              "pass a file written by hvdkit")
    return f, reader, table


def damaged_tensor(path: str | os.PathLike[str], dataset: str) -> CheckpointError:
    """The one error for a tensor whose bytes do not match their CRC-32, naming it."""
    return CheckpointError(f"checkpoint {path} is corrupt: checksum mismatch in dataset {dataset}", DAMAGED_HINT)


def _dataset_at(path: Path, offset: int) -> str:
    """The name of the dataset whose bytes start at ``offset`` (a verified file's metadata)."""
    import h5py

    found: list[str] = []
    with h5py.File(path, "r") as f:
        f.visititems(lambda name, node: found.append("/" + name) if isinstance(node, h5py.Dataset)
                     and node.id.get_offset() == offset else None)
    return found[0] if found else f"(at byte {offset})"


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


def _content_ok(f: Any) -> bool:
    """The content checksum (formats 4 and 5: names, attributes and each dataset's CRC; older: every byte)."""
    data_bytes = int(f.attrs.get("format_version", 0)) < 4
    return int(f.attrs["checksum"]) == content_checksum(f, data_bytes=data_bytes)


class OpenCheckpoint:
    """A verified checkpoint held open, its tensors read when asked (:class:`~hvdkit.h5tree.Stored`
    leaves in ``snapshot.states``): what a restore loads from, one tensor at a time. Close it
    (or use it as a context manager) when every tensor has been read.

    Opened ``as_read``, its tensors are checked as they are read, and :attr:`damaged` names
    those whose bytes did not match: check it once every tensor has been read."""

    def __init__(self, path: Path, f: Any, snapshot: Snapshot, reader: RangeReader | None = None) -> None:
        self.path, self.file, self.snapshot, self.reader = path, f, snapshot, reader

    @property
    def damaged(self) -> list[str]:
        """Datasets read so far whose bytes did not match their CRC-32 (``as_read`` only)."""
        return list(self.reader.damaged) if self.reader is not None else []

    def close(self) -> None:
        self.file.close()
        if self.reader is not None:
            self.reader.close()

    def __enter__(self) -> OpenCheckpoint:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def open_checkpoint(path: str | os.PathLike[str], verify: bool = True, as_read: bool = False) -> OpenCheckpoint:
    """Verify a checkpoint (sealed header, content checksum) and hold it open, its tensors
    unread; raises :class:`CheckpointError` if it is corrupt.

    ``as_read`` (format 5 files, with ``verify``): only the metadata is verified now (the
    SHA-256 of every byte outside the tensors), and each tensor is checked as it is read,
    straight from the verified file: one pass over the file instead of two. A damaged tensor
    is then recorded in :attr:`OpenCheckpoint.damaged`, not raised, so that a read inside a
    collective goes on; the caller must check it once the tensors are read (what
    :meth:`~hvdkit.checkpoint.CheckpointManager.restore` does)."""
    path = Path(path)
    f, reader, _ = _open_verified(path, as_read and verify)
    try:
        meta = _read_meta(f)
        states = {key: read_tree(f, key, verify, True, lazy=True, source=reader) for key in meta["states"]}
        rng = materialize(read_tree(f, "rng", verify, True, lazy=True, source=reader)) if "rng" in f else {}
        # with a reader, the SHA-256 just checked covers every name and attribute (the content
        # checksum's whole input): it is checked again by `hvdkit ckpt verify`, not here
        if verify and reader is None and not _content_ok(f):
            raise ChecksumMismatch("content checksum mismatch (an attribute, name or "
                                   "state value differs from what was written)")
        return OpenCheckpoint(path, f, Snapshot(states=states, rng=[rng[str(i)] for i in range(len(rng))],
                                                meta=meta), reader)
    except Exception as exc:  # any damage is "corrupt", never a traceback
        f.close()
        if reader is not None:
            reader.close()
        if isinstance(exc, CheckpointError):
            raise
        raise CheckpointError(f"checkpoint {path} is corrupt: {first_line(exc)}", DAMAGED_HINT) from None


def read_checkpoint(path: str | os.PathLike[str], verify: bool = True, tensors: bool = True) -> Snapshot:
    """Read and (by default) verify a whole checkpoint into memory; raises
    :class:`CheckpointError` if corrupt (for a small one, or a test: a restore uses
    :func:`open_checkpoint`, which reads one tensor at a time).

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
            if verify and not _content_ok(f):
                raise ChecksumMismatch("content checksum mismatch (an attribute, name or "
                                       "state value differs from what was written)")
            return Snapshot(states=states, rng=[rng[str(i)] for i in range(len(rng))], meta=meta)
    except CheckpointError:
        raise
    except Exception as exc:  # any damage is "corrupt", never a traceback
        raise CheckpointError(f"checkpoint {path} is corrupt: {first_line(exc)}", DAMAGED_HINT) from None


def verify_checkpoint(path: str | os.PathLike[str]) -> tuple[bool, str]:
    """(ok, message) without raising, in bounded memory: the sealed header (the file hashed in
    blocks), the content checksum, and every dataset's CRC, one dataset at a time. Used by
    ``hvdkit ckpt verify`` and ``show``."""
    try:
        check_checkpoint(path)
    except CheckpointError as exc:
        return False, str(exc)
    return True, "checksum OK"


def check_checkpoint(path: str | os.PathLike[str]) -> None:
    """:func:`verify_checkpoint`, raising :class:`CheckpointError`. A format 5 file is read
    once: the pass over the whole file checks each tensor's range against the sealed table,
    and each dataset's own CRC attribute is then compared with its range's (the two layers
    must agree, so a header rewritten to match still names the tensor) without reading the
    tensor again. Older formats read each dataset a second time for its CRC."""
    import h5py

    path = Path(path)
    f, _, table = _open_verified(path, as_read=False)
    try:
        with f:
            datasets: list[Any] = []
            f.visititems(lambda _name, node: datasets.append(node) if isinstance(node, h5py.Dataset) else None)
            for ds in datasets:
                offset, crc = ds.id.get_offset(), ds.attrs.get("crc32")
                length, sealed = (table or {}).get(offset, (None, None))  # offset None: not in it
                if crc is not None and length == ds.nbytes and length:
                    if int(crc) != sealed:  # the bytes matched the table: the attribute differs
                        raise ChecksumMismatch(f"checksum mismatch in dataset {ds.name}")
                else:
                    Stored(ds, True, False).read()  # raises ChecksumMismatch naming the dataset
            if not _content_ok(f):
                raise ChecksumMismatch("content checksum mismatch (an attribute, name or "
                                       "state value differs from what was written)")
    except CheckpointError:
        raise
    except Exception as exc:
        raise CheckpointError(f"checkpoint {path} is corrupt: {first_line(exc)}", DAMAGED_HINT) from None
