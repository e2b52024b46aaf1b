"""Data for data-parallel training: a resumable per-rank shard sampler and HDF5 datasets.

The sampler works on *global* sample positions: each epoch is one seeded
permutation of the whole dataset, consumed in order, global batch after global
batch; rank ``r`` takes every ``size``-th sample of it, as
``DistributedSampler`` does. Resuming at "global sample k of epoch e" is then
exact for the same world size, and for another world size still visits every
remaining sample of the epoch exactly once.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import Dataset, Sampler

from .errors import ConfigError, HvdkitError, first_line

__all__ = ["ShardSampler", "H5Dataset", "check_h5_dataset", "make_synthetic_h5", "per_rank_batch_size"]


def per_rank_batch_size(
    global_batch: int, world_size: int, accumulation: int = 1, exact: bool = False
) -> int:
    """Micro-batch per rank for a requested global batch (per optimizer step).

    With ``exact`` the global batch must split evenly; otherwise it is rounded
    down and the caller should tell the user what the effective batch is.
    """
    parts = world_size * accumulation
    if global_batch % parts and exact:
        raise ConfigError(
            f"global batch {global_batch} does not divide over {world_size} ranks x "
            f"{accumulation} accumulation steps",
            f"use a multiple of {parts} (e.g. {max(parts, global_batch // parts * parts)}) "
            "or drop --exact-batch",
        )
    per_rank = global_batch // parts
    if per_rank < 1:
        raise ConfigError(
            f"global batch {global_batch} is smaller than {world_size} ranks x {accumulation} steps",
            f"use a global batch of at least {parts}",
        )
    return per_rank


class ShardSampler(Sampler[int]):
    """Indices for one rank: ``permutation(epoch)[start:][rank::size]``.

    By default the tail that does not divide by ``size`` is dropped, so every rank has as
    many samples; ``uneven=True`` keeps it (lower ranks get one sample more).
    """

    def __init__(
        self, num_samples: int, num_replicas: int, rank: int, seed: int = 0, shuffle: bool = True,
        uneven: bool = False,
    ) -> None:
        if not 0 <= rank < num_replicas:
            raise ValueError(f"rank {rank} not in [0, {num_replicas})")
        self.num_samples, self.num_replicas, self.rank = num_samples, num_replicas, rank
        self.seed, self.shuffle, self.uneven = seed, shuffle, uneven
        self.epoch, self.start = 0, 0

    def set_epoch(self, epoch: int, start: int = 0) -> None:
        """Select the epoch's permutation and skip the first ``start`` global samples."""
        self.epoch, self.start = epoch, start

    def _order(self) -> torch.Tensor:
        if not self.shuffle:
            return torch.arange(self.num_samples)
        gen = torch.Generator().manual_seed(self.seed + self.epoch)
        return torch.randperm(self.num_samples, generator=gen)

    def __iter__(self) -> Iterator[int]:
        order = self._order()[self.start :]
        usable = len(order) if self.uneven else len(order) // self.num_replicas * self.num_replicas
        return iter(order[:usable][self.rank :: self.num_replicas].tolist())

    def __len__(self) -> int:
        return self.shard_length(self.rank)

    def shard_length(self, rank: int) -> int:
        """How many samples ``rank`` gets (every rank can compute every rank's)."""
        left = self.num_samples - self.start
        if not self.uneven:
            return left // self.num_replicas
        return left // self.num_replicas + (1 if rank < left % self.num_replicas else 0)


class H5Dataset(Dataset):
    """``(x[i], y[i])`` from an HDF5 file, opened lazily in each worker process.

    The file handle is created on first access, i.e. after any ``fork`` of
    DataLoader workers (h5py handles must not cross a fork). Only the indices
    this rank's sampler asks for are ever read.
    """

    def __init__(self, path: str | os.PathLike[str], x_key: str = "x", y_key: str = "y",
                 model: str | None = None) -> None:
        self.path, self.x_key, self.y_key = str(path), x_key, y_key
        self._len = check_h5_dataset(self.path, model, x_key, y_key)
        self._file = None
        self._pid = None

    def _handle(self):  # noqa: ANN202 - h5py.File
        if self._file is None or self._pid != os.getpid():
            import h5py

            self._file, self._pid = h5py.File(self.path, "r"), os.getpid()
        return self._file

    def __len__(self) -> int:
        return self._len

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        f = self._handle()
        x = torch.from_numpy(np.asarray(f[self.x_key][index]))
        y = torch.as_tensor(np.asarray(f[self.y_key][index]), dtype=torch.long)
        return x, y

    def __getstate__(self) -> dict:
        state = self.__dict__.copy()
        state["_file"], state["_pid"] = None, None  # never pickle an open handle
        return state


def _bad(path: str, what: str, hint: str = "regenerate it with 'hvdkit data make-synthetic'") -> HvdkitError:
    return HvdkitError(f"dataset {path}: {what}", hint)


def check_h5_dataset(path: str | os.PathLike[str], model: str | None = None, x_key: str = "x",
                     y_key: str = "y", scan_values: bool = False) -> int:
    """Check an HDF5 dataset before the first step; returns its number of samples.

    File type, keys, lengths, the sample shape and dtype ``model`` takes, integer
    labels within the model's classes; with ``scan_values`` also NaN/inf in ``x``.
    Every failure is one :class:`HvdkitError` naming file, key, expected and found.
    """
    import h5py

    path = str(path)
    if not Path(path).is_file():
        raise HvdkitError(f"dataset file {path} does not exist",
                          "create one with 'hvdkit data make-synthetic PATH'")
    if not h5py.is_hdf5(path):
        with open(path, "rb") as fh:
            head = fh.read(8)
        raise _bad(path, f"not an HDF5 file (starts with {head!r})",
                   "pass an HDF5 file with datasets x (samples) and y (labels)")
    spec = None
    if model is not None:
        from .models import MODELS

        spec = MODELS[model]
    try:
        with h5py.File(path, "r") as f:
            for key in (x_key, y_key):
                if key not in f or not isinstance(f[key], h5py.Dataset):
                    raise _bad(path, f"no dataset {key!r} (found {sorted(f)})",
                               "the file needs datasets 'x' (samples) and 'y' (labels)")
            x, y = f[x_key], f[y_key]
            if x.ndim < 1 or y.ndim != 1 or x.shape[0] != y.shape[0] or x.shape[0] == 0:
                raise _bad(path, f"'{x_key}' {x.shape} and '{y_key}' {y.shape} must be N samples and N "
                                 "labels (N > 0)")
            if spec is not None and tuple(x.shape[1:]) != spec.input_shape:
                raise _bad(path, f"'{x_key}' samples have shape {tuple(x.shape[1:])}, model {model} "
                                 f"expects {spec.input_shape}",
                           f"pass --model matching the data or regenerate it for {model}")
            if x.dtype != np.float32:
                raise _bad(path, f"'{x_key}' has dtype {x.dtype}, expected float32",
                           "convert it, e.g. f.create_dataset('x', data=x.astype('float32'))")
            if y.dtype.kind not in "iu":
                raise _bad(path, f"'{y_key}' has dtype {y.dtype}, expected integer class labels")
            labels = np.asarray(y[()])
            if spec is not None and labels.size and (labels.min() < 0 or labels.max() >= spec.classes):
                where = int(np.argmax((labels < 0) | (labels >= spec.classes)))
                raise _bad(path, f"'{y_key}'[{where}] = {labels[where]} is outside model {model}'s "
                                 f"{spec.classes} classes [0, {spec.classes - 1}]",
                           "fix the labels or pick the model with that many classes")
            if scan_values:
                for start in range(0, x.shape[0], 4096):
                    block = np.asarray(x[start:start + 4096])
                    bad = ~np.isfinite(block.reshape(len(block), -1)).all(axis=1)
                    if bad.any():
                        raise _bad(path, f"'{x_key}'[{start + int(np.argmax(bad))}] holds NaN/inf",
                                   "clean the data; training would stop at its step (--on-nonfinite)")
            return int(x.shape[0])
    except HvdkitError:
        raise
    except Exception as exc:  # noqa: BLE001 - a damaged file: one line, not h5py's traceback
        raise _bad(path, f"cannot be read ({first_line(exc, limit=None)})") from None


def make_synthetic_h5(
    path: str | os.PathLike[str], model: str = "cnn", num_samples: int = 1024, seed: int = 1234
) -> Path:
    """Write the synthetic dataset of ``model`` to ``path`` (datasets ``x`` float32, ``y`` int64)."""
    import h5py

    from .models import synthetic_dataset

    ds = synthetic_dataset(model, num_samples, seed)
    x, y = ds.tensors  # type: ignore[attr-defined]
    out = Path(path)
    tmp = out.with_name(out.name + f".tmp{os.getpid()}")
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        with h5py.File(tmp, "w") as f:
            f.create_dataset("x", data=x.numpy(), chunks=(1, *x.shape[1:]))
            f.create_dataset("y", data=y.numpy())
            f.attrs.update({"model": model, "seed": seed, "num_samples": num_samples})
        os.replace(tmp, out)
    except OSError as exc:
        reason = exc.strerror or (str(exc).splitlines() or ["I/O error"])[0]
        raise HvdkitError(f"cannot write dataset {out}: {reason}",
                          "pick a writable directory with enough free space") from None
    finally:
        try:
            tmp.unlink(missing_ok=True)
        except OSError:
            pass
    return out
