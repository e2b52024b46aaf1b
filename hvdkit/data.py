"""Data for data-parallel training: a resumable per-rank shard sampler, HDF5 datasets of any
sample shape and dtype, your own datasets, and a validation split that never moves.

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
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset, Sampler

from .errors import ConfigError, HvdkitError, first_line
from .fileio import write_bytes_atomic

__all__ = ["ShardSampler", "H5Dataset", "check_h5_dataset", "make_synthetic_h5", "per_rank_batch_size",
           "split_indices", "SampleSeeded", "write_h5_dataset", "open_datasets", "all_labels", "unwrap_dataset"]


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
    """Samples from an HDF5 file: ``(x[i], y[i])``, or ``x[i]`` alone when there is no ``y``.

    ``x`` may hold samples of any shape and dtype (images, token windows, tabular rows);
    ``y`` one integer label per sample (classification). The file handle is created on
    first access, i.e. after any ``fork`` of DataLoader workers (h5py handles must not
    cross a fork). Only the indices this rank's sampler asks for are ever read.
    """

    def __init__(self, path: str | os.PathLike[str], x_key: str = "x", y_key: str = "y",
                 model: str | None = None) -> None:
        self.path, self.x_key, self.y_key = str(path), x_key, y_key
        self._len, self.has_labels = check_h5_dataset(self.path, model, x_key, y_key, want_labels=True)
        self._file = None
        self._pid: int | None = None

    def _handle(self):  # h5py.File
        if self._file is None or self._pid != os.getpid():
            import h5py

            self._file, self._pid = h5py.File(self.path, "r"), os.getpid()
        return self._file

    def __len__(self) -> int:
        return self._len

    def __getitem__(self, index: int) -> Any:
        f = self._handle()
        x = torch.from_numpy(np.asarray(f[self.x_key][index]))
        if not self.has_labels:
            return x
        return x, torch.as_tensor(np.asarray(f[self.y_key][index]), dtype=torch.long)

    def labels(self) -> np.ndarray | None:
        """Every label, read at once (the check of the label range before training)."""
        if not self.has_labels:
            return None
        return np.asarray(self._handle()[self.y_key][()])

    def __getstate__(self) -> dict:
        state = self.__dict__.copy()
        state["_file"], state["_pid"] = None, None  # never pickle an open handle
        return state


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


def write_h5_dataset(path: str | os.PathLike[str], x: np.ndarray, y: np.ndarray | None = None,
                     attrs: dict[str, Any] | None = None, chunk_samples: int = 1) -> Path:
    """Write ``x`` (and ``y``) as an hvdkit dataset, atomically (built in memory, then renamed)."""
    import io

    import h5py

    buffer = io.BytesIO()
    with h5py.File(buffer, "w") as f:
        f.create_dataset("x", data=x, chunks=(min(chunk_samples, len(x)), *x.shape[1:]))
        if y is not None:
            f.create_dataset("y", data=y)
        f.attrs.update(attrs or {})
    out = Path(path)
    try:
        return write_bytes_atomic(out, buffer.getvalue(), durable=True)
    except OSError as exc:
        reason = exc.strerror or (str(exc).splitlines() or ["I/O error"])[0]
        raise HvdkitError(f"cannot write dataset {out}: {reason}",
                          "pick a writable directory with enough free space") from None


def make_synthetic_h5(
    path: str | os.PathLike[str], model: str = "cnn", num_samples: int = 1024, seed: int = 1234
) -> Path:
    """Write the synthetic dataset of ``model`` to ``path`` (datasets ``x`` float32, ``y`` int64)."""
    from .models import synthetic_dataset

    ds = synthetic_dataset(model, num_samples, seed)
    x, y = ds.tensors  # type: ignore[attr-defined]
    return write_h5_dataset(path, x.numpy(), y.numpy(),
                            {"model": model, "seed": seed, "num_samples": num_samples})


def split_indices(num_samples: int, fraction: float, seed: int) -> tuple[list[int], list[int]]:
    """(train, validation) indices: a fixed ``fraction`` of the samples, drawn with ``seed``.

    Depends on nothing but its arguments, so the split is the same across resumes, world
    sizes and elastic resets. Both lists are sorted; the training sampler shuffles anyway.
    """
    if not 0.0 < fraction < 1.0:
        raise ConfigError(f"--val-fraction must be between 0 and 1, got {fraction}", "e.g. --val-fraction 0.1")
    n_val = max(1, round(num_samples * fraction))
    if n_val >= num_samples:
        raise ConfigError(f"--val-fraction {fraction} leaves no training sample of {num_samples}",
                          "use a smaller fraction or more data")
    gen = torch.Generator().manual_seed(0x5EED0000 + seed)  # not the training order's stream
    order = torch.randperm(num_samples, generator=gen).tolist()
    return sorted(order[n_val:]), sorted(order[:n_val])


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
    second tensor, a Subset of either), in the dataset's index order; else ``None``."""
    from torch.utils.data import Subset, TensorDataset

    inner = unwrap_dataset(dataset)
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
