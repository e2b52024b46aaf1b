"""Data for data-parallel training: a resumable per-rank shard sampler, HDF5 datasets of any
sample shape and dtype, your own datasets, and a validation split that never moves.

The sampler works on *global* sample positions: each epoch is one seeded
permutation of the whole dataset, consumed in order, global batch after global
batch; rank ``r`` takes every ``size``-th sample of it, as
``DistributedSampler`` does. Resuming at "global sample k of epoch e" is then
exact for the same world size, and for another world size still visits every
remaining sample of the epoch exactly once.

Memory does not grow with the number of samples: the permutation is computed position by
position (:class:`Permutation`: ``torch.randperm``'s up to :data:`EXACT_LIMIT` samples, the
order every earlier run and checkpoint used; above it a seeded Feistel bijection, a few
bytes whatever the size), the sampler yields indices block by block, the validation split
is two index views (:func:`split_indices`), and ``--data`` may be many files read as one.
"""

from __future__ import annotations

import glob as globbing
import os
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset, Sampler

from .errors import ConfigError, HvdkitError, first_line

__all__ = ["ShardSampler", "H5Dataset", "check_h5_dataset", "make_synthetic_h5", "per_rank_batch_size",
           "split_indices", "SampleSeeded", "write_h5_dataset", "open_datasets", "all_labels", "unwrap_dataset",
           "Permutation", "EXACT_LIMIT", "data_files", "H5Writer"]

# Up to this many samples an epoch's order is torch.randperm's (what hvdkit 0.4's runs and
# checkpoints used, so they resume in the same order; 32 MiB at the limit); above it, a
# bijection computed index by index (memory independent of the number of samples).
EXACT_LIMIT = 1 << 22
BLOCK = 1 << 16  # indices computed at a time


def _mix(x: np.ndarray, key: int, bits: int) -> np.ndarray:
    """A keyed hash of ``bits``-bit values (splitmix64's finaliser), ``bits`` bits out."""
    with np.errstate(over="ignore"):
        z = (x.astype(np.uint64) + np.uint64(key)) * np.uint64(0x9E3779B97F4A7C15)
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        z ^= z >> np.uint64(31)
    return z & np.uint64((1 << bits) - 1)


class Permutation:
    """A seeded permutation of ``range(n)`` that gives any position's value without building
    the whole: ``torch.randperm(n)`` with the generator seeded ``seed`` when ``n <=``
    :data:`EXACT_LIMIT`, else a 4-round Feistel network over the next power of 4 with cycle
    walking (every value once; position -> value in a few arithmetic operations)."""

    ROUNDS = 4

    def __init__(self, n: int, seed: int) -> None:
        self.n, self.seed = n, seed
        self._exact = None
        if n <= EXACT_LIMIT:
            gen = torch.Generator().manual_seed(seed)
            self._exact = torch.randperm(n, generator=gen).numpy()
        half = max(1, (max(n - 1, 1).bit_length() + 1) // 2)
        self._half = half
        self._keys = [int(k) for k in np.random.default_rng([seed & 0xFFFFFFFF, seed >> 32, 0x5EED])
                      .integers(0, 2**63 - 1, self.ROUNDS)]

    def __len__(self) -> int:
        return self.n

    def _feistel(self, x: np.ndarray) -> np.ndarray:
        bits, mask = self._half, np.uint64((1 << self._half) - 1)
        left, right = x >> np.uint64(bits), x & mask
        for key in self._keys:
            left, right = right, left ^ _mix(right, key, bits)
        return (left << np.uint64(bits)) | right

    def take(self, positions: np.ndarray) -> np.ndarray:
        """The values at ``positions`` (int64)."""
        if self._exact is not None:
            return self._exact[positions]
        out = self._feistel(positions.astype(np.uint64))
        while True:  # cycle walking: a value outside range(n) goes around again
            outside = out >= np.uint64(self.n)
            if not outside.any():
                return out.astype(np.int64)
            out[outside] = self._feistel(out[outside])

    def __getitem__(self, position: int) -> int:
        return int(self.take(np.asarray([position]))[0])


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

    def advance(self, samples: int) -> None:
        """Record that ``samples`` more global samples of this epoch were consumed (for a resume)."""
        self.start += samples

    def state_dict(self) -> dict[str, int]:
        """Where the sampler is: epoch and global samples consumed (save it with a checkpoint)."""
        return {"epoch": self.epoch, "start": self.start, "seed": self.seed}

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Continue where ``state`` was; valid at any world size (positions are global)."""
        self.epoch, self.start = int(state["epoch"]), int(state["start"])
        self.seed = int(state.get("seed", self.seed))

    def __iter__(self) -> Iterator[int]:
        """This rank's indices, computed a block at a time (never a list of all of them)."""
        order = Permutation(self.num_samples, self.seed + self.epoch) if self.shuffle else None
        left = self.num_samples - self.start
        usable = left if self.uneven else left // self.num_replicas * self.num_replicas
        end = self.start + usable
        step = self.num_replicas * BLOCK
        for first in range(self.start + self.rank, end, step):
            positions = np.arange(first, min(first + step, end), self.num_replicas, dtype=np.int64)
            yield from (order.take(positions) if order is not None else positions).tolist()

    def __len__(self) -> int:
        return self.shard_length(self.rank)

    def shard_length(self, rank: int) -> int:
        """How many samples ``rank`` gets (every rank can compute every rank's)."""
        left = self.num_samples - self.start
        if not self.uneven:
            return left // self.num_replicas
        return left // self.num_replicas + (1 if rank < left % self.num_replicas else 0)


def data_files(spec: str | os.PathLike[str] | Sequence[str]) -> list[str]:
    """The HDF5 files ``--data`` names: one file, a comma-separated list, a glob (``shard-*.h5``)
    or a directory (its ``*.h5``, sorted), read in that order as one dataset; a name that
    matches nothing is one line."""
    parts = [str(p) for p in spec] if isinstance(spec, (list, tuple)) else \
        [p.strip() for p in str(spec).split(",") if p.strip()]
    files: list[str] = []
    for part in parts:
        if Path(part).is_dir():
            found = sorted(str(p) for p in Path(part).glob("*.h5"))
            if not found:
                raise HvdkitError(f"dataset directory {part} holds no *.h5 file", "pass a directory of HDF5 shards")
            files += found
        elif any(c in part for c in "*?["):
            found = sorted(globbing.glob(part))
            if not found:
                raise HvdkitError(f"no dataset file matches {part}", "check the pattern (quote it from the shell)")
            files += found
        else:
            files.append(part)
    if not files:
        raise HvdkitError(f"no dataset file in {spec!r}", "pass a file, a list a.h5,b.h5, a glob or a directory")
    return files


class H5Dataset(Dataset):
    """Samples from one HDF5 file or several read as one: ``(x[i], y[i])``, or ``x[i]`` alone
    when there is no ``y``.

    ``x`` may hold samples of any shape and dtype (images, token windows, tabular rows);
    ``y`` one integer label per sample (classification). ``path`` is what :func:`data_files`
    takes (a file, a list, a glob, a directory); every file must hold samples of one shape and
    dtype, and labels in all or none. File handles are created on first access, i.e. after
    any ``fork`` of DataLoader workers (h5py handles must not cross a fork). Only the indices
    this rank's sampler asks for are ever read; memory does not grow with the samples.
    """

    def __init__(self, path: str | os.PathLike[str] | Sequence[str], x_key: str = "x", y_key: str = "y",
                 model: str | None = None) -> None:
        self.files = data_files(path)
        self.path, self.x_key, self.y_key = ",".join(self.files), x_key, y_key
        lengths, kinds = [], set()
        for file in self.files:
            n, has_labels = check_h5_dataset(file, model, x_key, y_key, want_labels=True)
            lengths.append(n)
            kinds.add((has_labels, *_sample_kind(file, x_key)))
        if len(kinds) > 1:
            raise HvdkitError(f"the dataset's files disagree on sample shape, dtype or labels: "
                              f"{sorted(map(str, kinds))}", "read files of one kind as one dataset")
        self.has_labels = next(iter(kinds))[0]
        self._ends = np.cumsum(lengths)
        self._len = int(self._ends[-1])
        self._handles: dict[int, Any] = {}
        self._pid: int | None = None

    def _locate(self, index: int) -> tuple[Any, int]:
        """The open file holding sample ``index``, and its position there."""
        if self._pid != os.getpid():
            self._handles, self._pid = {}, os.getpid()
        k = int(np.searchsorted(self._ends, index, side="right"))
        if k not in self._handles:
            import h5py

            self._handles[k] = h5py.File(self.files[k], "r")
        return self._handles[k], index - (int(self._ends[k - 1]) if k else 0)

    def __len__(self) -> int:
        return self._len

    def __getitem__(self, index: int) -> Any:
        if not -self._len <= index < self._len:
            raise IndexError(index)
        f, i = self._locate(index % self._len)
        x = torch.from_numpy(np.asarray(f[self.x_key][i]))
        if not self.has_labels:
            return x
        return x, torch.as_tensor(np.asarray(f[self.y_key][i]), dtype=torch.long)

    def labels(self) -> np.ndarray | None:
        """Every label, read at once (the check of the label range before training)."""
        if not self.has_labels:
            return None
        return np.concatenate([np.asarray(self._locate(int(end) - 1)[0][self.y_key][()]) for end in self._ends])

    def __getstate__(self) -> dict:
        state = self.__dict__.copy()
        state["_handles"], state["_pid"] = {}, None  # never pickle an open handle
        return state


def _sample_kind(path: str, x_key: str) -> tuple[str, str]:
    """A file's sample shape and dtype, as text (files read as one dataset must agree)."""
    import h5py

    with h5py.File(path, "r") as f:
        return str(tuple(f[x_key].shape[1:])), str(f[x_key].dtype)


def _bad(path: str, what: str, hint: str = "regenerate it with 'hvdkit data make-synthetic'") -> HvdkitError:
    return HvdkitError(f"dataset {path}: {what}", hint)


def check_h5_dataset(path: str | os.PathLike[str], model: str | None = None, x_key: str = "x",
                     y_key: str = "y", scan_values: bool = False, want_labels: bool = False) -> Any:
    """Check an HDF5 dataset before the first step; returns its number of samples.

    File type, keys, lengths, integer labels when ``y`` exists; for a built-in ``model``
    also the sample shape, dtype and label range it takes (other models are checked by a
    real forward pass of one batch, :func:`hvdkit.train`); with ``scan_values`` NaN/inf in
    floating-point ``x``. Every failure is one :class:`HvdkitError` naming file, key,
    expected and found. ``want_labels`` returns ``(samples, has_labels)``.
    """
    import h5py

    path = str(path)
    if not Path(path).is_file():
        raise HvdkitError(f"dataset file {path} does not exist",
                          "create one with 'hvdkit data make-synthetic PATH' or 'hvdkit data import-digits DIR'")
    if not h5py.is_hdf5(path):
        with open(path, "rb") as fh:
            head = fh.read(8)
        raise _bad(path, f"not an HDF5 file (starts with {head!r})",
                   "pass an HDF5 file with a dataset x (samples) and optionally y (labels)")
    spec = None
    if model is not None:
        from .models import MODELS

        spec = MODELS.get(model)
    try:
        with h5py.File(path, "r") as f:
            if x_key not in f or not isinstance(f[x_key], h5py.Dataset):
                raise _bad(path, f"no dataset {x_key!r} (found {sorted(f)})",
                           "the file needs a dataset 'x' (samples) and, for classification, 'y' (labels)")
            x = f[x_key]
            has_labels = y_key in f and isinstance(f[y_key], h5py.Dataset)
            if spec is not None and not has_labels:
                raise _bad(path, f"no dataset {y_key!r} of labels (found {sorted(f)})",
                           f"model {model} is a classifier: add 'y'")
            if x.ndim < 1 or x.shape[0] == 0:
                raise _bad(path, f"'{x_key}' {x.shape} must hold N > 0 samples along its first axis")
            if has_labels:
                y = f[y_key]
                if y.ndim != 1 or y.shape[0] != x.shape[0]:
                    raise _bad(path, f"'{x_key}' {x.shape} and '{y_key}' {y.shape} must be N samples and N "
                                     "labels")
                if y.dtype.kind not in "iu":
                    raise _bad(path, f"'{y_key}' has dtype {y.dtype}, expected integer class labels")
            if spec is not None:
                if tuple(x.shape[1:]) != spec.input_shape:
                    raise _bad(path, f"'{x_key}' samples have shape {tuple(x.shape[1:])}, model {model} "
                                     f"expects {spec.input_shape}",
                               f"pass --model matching the data or regenerate it for {model}")
                if x.dtype != np.float32:
                    raise _bad(path, f"'{x_key}' has dtype {x.dtype}, expected float32",
                               "convert it, e.g. f.create_dataset('x', data=x.astype('float32'))")
                labels = np.asarray(f[y_key][()])
                if labels.size and (labels.min() < 0 or labels.max() >= spec.classes):
                    where = int(np.argmax((labels < 0) | (labels >= spec.classes)))
                    raise _bad(path, f"'{y_key}'[{where}] = {labels[where]} is outside model {model}'s "
                                     f"{spec.classes} classes [0, {spec.classes - 1}]",
                               "fix the labels or pick the model with that many classes")
            if scan_values and x.dtype.kind == "f":
                for start in range(0, x.shape[0], 4096):
                    block = np.asarray(x[start:start + 4096])
                    bad = ~np.isfinite(block.reshape(len(block), -1)).all(axis=1)
                    if bad.any():
                        raise _bad(path, f"'{x_key}'[{start + int(np.argmax(bad))}] holds NaN/inf",
                                   "clean the data; training would stop at its step (--on-nonfinite)")
            n = int(x.shape[0])
            return (n, has_labels) if want_labels else n
    except HvdkitError:
        raise
    except Exception as exc:  # a damaged file: one line, not h5py's traceback
        raise _bad(path, f"cannot be read ({first_line(exc, limit=None)})") from None


class H5Writer:
    """An hvdkit dataset (``x`` of ``samples`` x ``sample_shape``, and ``y`` with ``labels``)
    written block by block, atomically: HDF5 lays out two contiguous datasets (one sample is
    then one contiguous read: random access needs no chunk index), the blocks go to their
    place with ``pwrite`` as they come, and :meth:`close` renames the finished file into
    place. Memory is one block; a full disk is one line, with nothing left behind."""

    def __init__(self, path: str | os.PathLike[str], samples: int, sample_shape: tuple[int, ...], x_dtype: Any,
                 labels: Any = None, attrs: dict[str, Any] | None = None) -> None:
        import shutil

        import h5py

        from .fileio import SPACE_MARGIN
        from .h5tree import SparseImage, contiguous_dataset

        self.path = Path(path)
        self.tmp = self.path.with_name(f".{self.path.name}.tmp{os.getpid()}")
        self.x_dtype, self.y_dtype = np.dtype(x_dtype), (np.dtype(labels) if labels is not None else None)
        self.sample_bytes = int(np.prod(sample_shape, dtype=np.int64)) * self.x_dtype.itemsize
        self.samples, self.sample_shape = samples, tuple(sample_shape)
        image = SparseImage()
        with h5py.File(image, "w") as f:
            x = contiguous_dataset(f, "x", self.x_dtype, (samples, *sample_shape))
            self.x_at = x.id.get_offset()
            self.y_at = None
            if self.y_dtype is not None:
                self.y_at = contiguous_dataset(f, "y", self.y_dtype, (samples,)).id.get_offset()
            f.attrs.update(attrs or {})
        size = image.size
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            if shutil.disk_usage(self.path.parent).free < size + SPACE_MARGIN:
                raise OSError(28, os.strerror(28))
            self.fd = os.open(self.tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            image.write_to(self.fd)
        except OSError as exc:
            self._fail(exc)

    def _fail(self, exc: OSError) -> None:
        if hasattr(self, "fd"):
            os.close(self.fd)
            del self.fd
        try:
            self.tmp.unlink(missing_ok=True)
        except OSError:
            pass
        reason = exc.strerror or (str(exc).splitlines() or ["I/O error"])[0]
        raise HvdkitError(f"cannot write dataset {self.path}: {reason}",
                          "pick a writable directory with enough free space") from None

    def _put(self, data: np.ndarray, at: int) -> None:
        view = memoryview(np.ascontiguousarray(data)).cast("B")  # type: ignore[arg-type]
        while view:
            written = os.pwrite(self.fd, view, at)
            view, at = view[written:], at + written

    def write(self, start: int, x: np.ndarray, y: np.ndarray | None = None) -> None:
        """Samples ``start .. start + len(x)``."""
        x = np.asarray(x, dtype=self.x_dtype)
        if tuple(x.shape[1:]) != self.sample_shape or start < 0 or start + len(x) > self.samples:
            raise ValueError(f"block of {x.shape} at {start} does not fit {self.samples} x {self.sample_shape}")
        try:
            if len(x):
                self._put(x, self.x_at + start * self.sample_bytes)
            if self.y_dtype is not None and y is not None and len(y):
                self._put(np.asarray(y, dtype=self.y_dtype), self.y_at + start * self.y_dtype.itemsize)
        except OSError as exc:
            self._fail(exc)

    def close(self) -> Path:
        """fsync and rename into place."""
        from .fileio import fsync_dir

        try:
            os.fsync(self.fd)
            os.close(self.fd)
            del self.fd
            os.replace(self.tmp, self.path)
            fsync_dir(self.path.parent)
        except OSError as exc:
            self._fail(exc)
        return self.path

    def __enter__(self) -> H5Writer:
        return self

    def __exit__(self, exc_type: Any, *exc: Any) -> None:
        if exc_type is None:
            self.close()
        elif hasattr(self, "fd"):
            os.close(self.fd)
            del self.fd
            self.tmp.unlink(missing_ok=True)


def write_h5_dataset(path: str | os.PathLike[str], x: np.ndarray, y: np.ndarray | None = None,
                     attrs: dict[str, Any] | None = None, block: int = 4096) -> Path:
    """Write ``x`` (and ``y``) as an hvdkit dataset, atomically, ``block`` samples at a time
    (:class:`H5Writer`; ``x`` and ``y`` may be memory maps or any array-like that slices)."""
    with H5Writer(path, len(x), tuple(x.shape[1:]), x.dtype, y.dtype if y is not None else None, attrs) as out:
        for start in range(0, len(x), block):
            out.write(start, x[start:start + block], y[start:start + block] if y is not None else None)
    return Path(path)


def make_synthetic_h5(
    path: str | os.PathLike[str], model: str = "cnn", num_samples: int = 1024, seed: int = 1234
) -> Path:
    """Write the synthetic dataset of ``model`` to ``path`` (datasets ``x`` float32, ``y`` int64)."""
    from .models import synthetic_dataset

    ds = synthetic_dataset(model, num_samples, seed)
    x, y = ds.tensors  # type: ignore[attr-defined]
    return write_h5_dataset(path, x.numpy(), y.numpy(),
                            {"model": model, "seed": seed, "num_samples": num_samples})


class _Drawn(Sequence[int]):
    """Positions ``[start, stop)`` of a :class:`Permutation`, as a read-only sequence."""

    def __init__(self, order: Permutation, start: int, stop: int) -> None:
        self.order, self.start, self.stop = order, start, stop

    def __len__(self) -> int:
        return self.stop - self.start

    def __getitem__(self, i: Any) -> Any:
        if isinstance(i, slice):
            return [self[k] for k in range(*i.indices(len(self)))]
        if not -len(self) <= i < len(self):
            raise IndexError(i)
        return self.order[self.start + (i % len(self))]

    def __eq__(self, other: object) -> bool:
        return list(self) == list(other) if isinstance(other, Sequence) else NotImplemented

    def __hash__(self) -> int:
        return hash((self.order.n, self.order.seed, self.start, self.stop))


def split_indices(num_samples: int, fraction: float, seed: int) -> tuple[Sequence[int], Sequence[int]]:
    """(train, validation) indices: a fixed ``fraction`` of the samples, drawn with ``seed``.

    Depends on nothing but its arguments, so the split is the same across resumes, world
    sizes and elastic resets. Up to :data:`EXACT_LIMIT` samples both are sorted lists (what
    earlier versions gave); above it, two views of one seeded permutation that compute each
    index when asked (constant memory: the split of 200M samples is a few bytes).
    """
    if not 0.0 < fraction < 1.0:
        raise ConfigError(f"--val-fraction must be between 0 and 1, got {fraction}", "e.g. --val-fraction 0.1")
    n_val = max(1, round(num_samples * fraction))
    if n_val >= num_samples:
        raise ConfigError(f"--val-fraction {fraction} leaves no training sample of {num_samples}",
                          "use a smaller fraction or more data")
    order = Permutation(num_samples, 0x5EED0000 + seed)  # not the training order's stream
    if num_samples > EXACT_LIMIT:
        return _Drawn(order, n_val, num_samples), _Drawn(order, 0, n_val)
    drawn = order.take(np.arange(num_samples)).tolist()
    return sorted(drawn[n_val:]), sorted(drawn[:n_val])


class SampleSeeded(Dataset):
    """Seeds torch, numpy and random before each sample *in a DataLoader worker* from
    ``(seed, epoch, index)`` alone.

    Random augmentation then depends on which sample is read in which epoch, not on which
    worker read it or how far that worker's generator had advanced: the same with 2 workers
    or 8, and exact after a resume mid-epoch. In the main process (``--num-workers 0``) the
    global generators are left alone: they are checkpointed with every rank's RNG.
    """

    def __init__(self, inner: Dataset, seed: int) -> None:
        self.inner, self.seed, self.epoch = inner, seed, 0

    def __len__(self) -> int:
        return len(self.inner)  # type: ignore[arg-type]

    def __getitem__(self, index: int) -> Any:
        if torch.utils.data.get_worker_info() is not None:
            import random

            value = (self.seed * 1_000_003 + self.epoch) * 10_000_019 + int(index)
            torch.manual_seed(value)
            random.seed(value)
            np.random.seed(value % 2**32)
        return self.inner[index]


def _user_datasets(cfg: Any) -> tuple[Dataset, Dataset | None]:
    """``--dataset pkg.module:fn``: a Dataset, a ``(train, val)`` pair, or ``{"train", "val"}``."""
    from .factories import call, resolve

    made = call(resolve(cfg.dataset, cfg.dataset_args, what="--dataset"), cfg.dataset,
                cfg.dataset_args, "--dataset")
    if isinstance(made, dict) and "train" in made:
        train, val = made["train"], made.get("val")
    elif isinstance(made, (tuple, list)) and len(made) == 2:
        train, val = made
    else:
        train, val = made, None
    if train is None:
        raise ConfigError(f"--dataset {cfg.dataset} returned None as the training data",
                          "return a map-style Dataset, or (train, val)")
    for name, ds in (("training", train), ("validation", val)):
        if ds is None:
            continue
        if not (hasattr(ds, "__getitem__") and hasattr(ds, "__len__")):
            raise ConfigError(f"--dataset {cfg.dataset} gave a {type(ds).__name__} as {name} data, not a "
                              "map-style Dataset", "return an object with __len__ and __getitem__ "
                              "(torch.utils.data.Dataset)")
        if len(ds) == 0:
            raise ConfigError(f"--dataset {cfg.dataset}: the {name} data is empty", "return some samples")
    return train, val


def open_datasets(cfg: Any) -> tuple[Dataset, Dataset | None]:
    """The training and validation sets a :class:`~hvdkit.config.TrainConfig` names.

    Training: ``--data`` (HDF5), ``--dataset`` (yours), or the built-in model's synthetic
    set. Validation: ``--val-data`` (HDF5), the dataset factory's own, or ``--val-fraction``
    of the training set (a fixed, seeded split: :func:`split_indices`).
    """
    from torch.utils.data import Subset

    val: Dataset | None = None
    if cfg.dataset:
        train, val = _user_datasets(cfg)
    elif cfg.data:
        from .models import MODELS

        train = H5Dataset(cfg.data, model=cfg.model if cfg.model in MODELS else None)
    else:
        from .models import MODELS, synthetic_dataset

        if cfg.model not in MODELS:
            raise ConfigError(f"--model {cfg.model} needs data: synthetic data exists only for the built-in "
                              f"models ({', '.join(MODELS)})", "pass --data FILE.h5 or --dataset pkg.module:fn")
        train = synthetic_dataset(cfg.model, cfg.num_samples)
    if cfg.val_data:
        val = H5Dataset(cfg.val_data)
    elif cfg.val_fraction:
        if val is not None:
            raise ConfigError(f"--val-fraction with --dataset {cfg.dataset}, which has validation data of its own",
                              "drop --val-fraction")
        keep, held_out = split_indices(len(train), cfg.val_fraction, cfg.seed)  # type: ignore[arg-type]
        train, val = Subset(train, keep), Subset(train, held_out)
    return train, val


def all_labels(dataset: Any) -> Any:
    """Every label of a dataset that can list them cheaply (HDF5 ``y``, a TensorDataset's
    second tensor, a Subset of either), in the dataset's index order; else ``None``, also for
    a dataset of more than :data:`EXACT_LIMIT` samples (the first batch's labels are checked
    instead: reading every label would cost memory that grows with the data)."""
    from torch.utils.data import Subset, TensorDataset

    inner = unwrap_dataset(dataset)
    if len(inner) > EXACT_LIMIT:
        return None
    if isinstance(inner, Subset):
        labels = all_labels(inner.dataset)
        return None if labels is None else labels[np.asarray(inner.indices)]
    if isinstance(inner, H5Dataset):
        return inner.labels()
    if isinstance(inner, TensorDataset) and len(inner.tensors) == 2:
        return inner.tensors[1].numpy()
    return None


def unwrap_dataset(dataset: Any) -> Any:
    """The dataset inside hvdkit's wrappers (the sample log's, per-sample seeds)."""
    while hasattr(dataset, "inner"):
        dataset = dataset.inner
    return dataset
