"""Nested Python/torch state <-> HDF5 groups that plain ``h5py``/``h5dump`` can read.

Encoding (one rule per kind, recorded in the ``kind`` attribute):

* tensor   -> dataset (numpy dtype; bf16/fp8 stored as same-width unsigned ints)
              with attrs ``kind=tensor``, ``torch_dtype``, ``crc32`` of the raw bytes
* ndarray  -> dataset with ``kind=ndarray`` and ``crc32``
* dict     -> group ``kind=dict``; non-string keys listed in attr ``key_types``
* list/tuple containing tensors -> group ``kind=list|tuple`` with members "0", "1", ...
* anything else JSON can hold -> attribute ``json:<name>`` on the parent group
  (tuples tagged as ``{"__tuple__": [...]}`` so they come back as tuples)

Names are escaped (``%`` -> ``%25``, ``/`` -> ``%2F``) because HDF5 uses ``/``.

Large trees are written in two passes so that no process holds them whole: :func:`layout_tree`
creates every group, attribute and (empty, allocated) dataset, with each tensor leaf's file
offset; the bytes then go there one leaf at a time (a :class:`Deferred` leaf is fetched only
then). Reading can be lazy the same way: :func:`read_tree` with ``lazy=True`` gives
:class:`Stored` leaves, read (and their CRC checked) when asked.
"""

from __future__ import annotations

import functools
import io
import json
import os
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    import torch

__all__ = ["write_tree", "read_tree", "crc32", "crc32_of", "ChecksumMismatch", "Deferred", "Stored", "Slot",
           "layout_tree", "tree_leaves", "materialize", "resolve", "to_numpy", "SparseImage",
           "contiguous_dataset"]


@functools.cache
def _dtype_tables() -> tuple[set[Any], dict[int, Any]]:
    """Torch dtypes numpy holds as they are, and the same-width integers for the others.

    torch is imported here, not at the top: reading a file as arrays (``hvdkit ckpt
    show``/``verify``) must not pay its seconds of import time.
    """
    import torch

    native = {torch.float64, torch.float32, torch.float16, torch.int64, torch.int32, torch.int16,
              torch.int8, torch.uint8, torch.bool, torch.complex64, torch.complex128}
    return native, {1: torch.uint8, 2: torch.uint16, 4: torch.uint32, 8: torch.uint64}


class ChecksumMismatch(ValueError):
    """A dataset's bytes do not match the CRC recorded when it was written."""


def _crc32() -> Any:
    """zlib's CRC-32, from ISA-L where it is installed (a dependency): the same value at about
    16 GB/s against zlib's 2.4 GB/s on this machine, and the GIL let go. A checkpoint's every
    byte passes through it when it is written and when it is read."""
    try:
        from isal.isal_zlib import crc32
    except ImportError:  # a platform without its wheel: the same values, slower
        from zlib import crc32
    return crc32


crc32 = _crc32()


def crc32_of(array: np.ndarray, value: int = 0) -> int:
    """CRC-32 of an array's raw bytes (C order)."""
    # the array's own bytes, not a copy of them (tobytes() would hold a second tensor)
    return crc32(np.ascontiguousarray(array).reshape(-1).view(np.uint8).data, value) & 0xFFFFFFFF


def _escape(name: str) -> str:
    return name.replace("%", "%25").replace("/", "%2F") or "%00"


def _unescape(name: str) -> str:
    return "" if name == "%00" else name.replace("%2F", "/").replace("%25", "%")


def to_numpy(t: torch.Tensor) -> np.ndarray:
    """A tensor's bytes as the numpy array a file stores (bf16 and friends as same-width ints)."""
    return _tensor_to_numpy(t)


def _tensor_to_numpy(t: torch.Tensor) -> np.ndarray:
    native, by_width = _dtype_tables()
    t = t.detach().cpu().contiguous()
    if t.dtype not in native:
        t = t.view(by_width[t.element_size()])
    return t.numpy()


def _json_default(obj: Any) -> Any:
    if isinstance(obj, (np.integer, np.floating)):
        return obj.item()
    raise TypeError(f"cannot store value of type {type(obj).__name__} in a checkpoint")


def _tag(obj: Any) -> Any:
    if isinstance(obj, tuple):
        return {"__tuple__": [_tag(v) for v in obj]}
    if isinstance(obj, list):
        return [_tag(v) for v in obj]
    if isinstance(obj, dict):
        return {"__dict__": [[_tag(k), _tag(v)] for k, v in obj.items()]}
    return obj


def _untag(obj: Any) -> Any:
    if isinstance(obj, list):
        return [_untag(v) for v in obj]
    if isinstance(obj, dict):
        if "__tuple__" in obj:
            return tuple(_untag(v) for v in obj["__tuple__"])
        if "__dict__" in obj:
            return {_untag(k): _untag(v) for k, v in obj["__dict__"]}
    return obj


class Deferred:
    """A tensor leaf that is fetched only when the writer reaches it: ``fetch()`` is called once,
    in :func:`tree_leaves` order, on every rank (it may be a collective: a gather from the
    ranks that hold parts of it), and returns the tensor where it is written (rank 0) and
    anything elsewhere. ``shape`` and ``dtype`` are known before, so the file can be laid out."""

    __slots__ = ("fetch", "shape", "dtype")

    def __init__(self, fetch: Any, shape: tuple[int, ...], dtype: Any) -> None:
        self.fetch, self.shape, self.dtype = fetch, tuple(shape), dtype

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64)) * self.dtype.itemsize


class Stored:
    """A tensor leaf of an open file, read (and its CRC checked) by :meth:`read`, or straight
    into a tensor of its shape and dtype by :meth:`read_into`.

    ``source`` (a :class:`~hvdkit.checkpoint.integrity.RangeReader`, or ``None``) reads the
    dataset's bytes from the verified file's descriptor, checked against the sealed table as
    they are read; a mismatch is recorded there, not raised (see its docstring)."""

    __slots__ = ("dataset", "verify", "tensors", "source")

    def __init__(self, dataset: Any, verify: bool, tensors: bool, source: Any = None) -> None:
        self.dataset, self.verify, self.tensors, self.source = dataset, verify, tensors, source

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.dataset.shape)

    @property
    def nbytes(self) -> int:
        return int(self.dataset.nbytes)

    @property
    def dtype(self) -> Any:
        """The torch dtype it reads as (from the metadata: nothing is read)."""
        return _torch_dtype(self.dataset)

    @property
    def _is_tensor(self) -> bool:
        """Read as a torch tensor (not left the numpy array stored)."""
        return self.tensors and self.dataset.attrs.get("kind") != "ndarray"

    def _ranged(self) -> int | None:
        """The dataset's offset where :attr:`source` reads it (one contiguous range), else None."""
        if self.source is None:
            return None
        offset = self.dataset.id.get_offset()
        return offset if offset is not None and self.source.covers(offset, self.nbytes) else None

    def _crc(self) -> int | None:
        crc = self.dataset.attrs.get("crc32") if self.verify else None
        return None if crc is None else int(crc)

    def read(self) -> Any:
        offset = self._ranged()
        if offset is None:
            return _read_dataset(self.dataset, self.verify, self.tensors, self.source)
        arr = np.empty(self.dataset.shape, self.dataset.dtype)
        self.source.read_into(offset, arr.reshape(-1).view(np.uint8).data, self.dataset.name, self._crc())
        return _as_tensor(arr, self.dataset) if self._is_tensor else arr

    def read_into(self, like: Any) -> Any:
        """The stored tensor, read into ``like`` (a contiguous CPU tensor of its shape and
        dtype: no second copy of it is made) and returned; anything else is :meth:`read`."""
        import torch

        offset = self._ranged() if self._is_tensor else None
        if offset is None or not isinstance(like, torch.Tensor) or like.device.type != "cpu" \
                or not like.is_contiguous() or tuple(like.shape) != self.shape or like.dtype != self.dtype:
            return self.read()
        view = like.detach().reshape(-1).view(torch.uint8).numpy()
        self.source.read_into(offset, view.data, self.dataset.name, self._crc())
        return like


def _torch_dtype(ds: Any) -> Any:
    """The torch dtype a tensor dataset reads as (its ``torch_dtype`` attribute, else its numpy dtype's)."""
    import torch

    dtype = getattr(torch, str(ds.attrs.get("torch_dtype", "")), None)
    return dtype if isinstance(dtype, torch.dtype) else torch.from_numpy(np.empty(0, ds.dtype)).dtype


def _as_tensor(arr: np.ndarray, ds: Any) -> Any:
    """A stored array as the tensor it was (bf16 and friends are viewed back from same-width ints)."""
    import torch

    tensor = torch.from_numpy(arr.copy() if arr.ndim == 0 else arr)
    dtype = _torch_dtype(ds)
    return tensor.view(dtype) if dtype != tensor.dtype else tensor


def materialize(tree: Any) -> Any:
    """``tree`` with every :class:`Stored` leaf read (for the small parts of a lazy tree)."""
    if isinstance(tree, Stored):
        return tree.read()
    if isinstance(tree, dict):
        return {k: materialize(v) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):
        return type(tree)(materialize(v) for v in tree)
    return tree


def materialize_into(tree: Any, like: Any) -> Any:
    """:func:`materialize`, but each tensor leaf is written into the tensor of the same shape and
    dtype at the same place in ``like`` (an optimizer's current state, say) where there is one,
    and that tensor is returned: a load then needs one tensor's memory above what is held, not
    a second copy of the whole state. Elsewhere the leaf is read as it is."""
    import torch

    if isinstance(tree, (Stored, torch.Tensor)):
        value = tree.read_into(like) if isinstance(tree, Stored) else tree
        if value is like:  # read straight into it
            return like
        if isinstance(like, torch.Tensor) and isinstance(value, torch.Tensor) and like is not value \
                and like.shape == value.shape and like.dtype == value.dtype:
            with torch.no_grad():
                like.copy_(value)
            return like
        return value
    if isinstance(tree, dict):
        mine = like if isinstance(like, dict) else {}
        # a file's keys are strings where the state's were ints (an optimizer's parameter indices)
        return {k: materialize_into(v, mine.get(k, mine.get(int(k)) if isinstance(k, str) and k.isdigit() else None))
                for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):
        likes = like if isinstance(like, (list, tuple)) and len(like) == len(tree) else [None] * len(tree)
        return type(tree)(materialize_into(v, m) for v, m in zip(tree, likes))
    return tree


def resolve(tree: Any) -> Any:
    """``tree`` with every :class:`Deferred` leaf fetched, in :func:`tree_leaves` order."""
    if isinstance(tree, Deferred):
        return tree.fetch()
    if isinstance(tree, dict):
        return {k: resolve(v) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):
        return type(tree)(resolve(v) for v in tree)
    return tree


def _is_leaf(obj: Any) -> bool:
    import torch

    return isinstance(obj, (torch.Tensor, np.ndarray, Deferred, Stored))


def tree_leaves(obj: Any) -> Any:
    """Every array leaf (tensor, ndarray, :class:`Deferred`) in the order :func:`layout_tree`
    writes them; what every rank walks to fetch deferred leaves in one order."""
    if _is_leaf(obj):
        yield obj
    elif isinstance(obj, dict) and _has_arrays(obj):
        for v in obj.values():
            yield from tree_leaves(v)
    elif isinstance(obj, (list, tuple)) and _has_arrays(obj):
        for v in obj:
            yield from tree_leaves(v)


class SparseImage(io.RawIOBase):
    """A file in memory that holds only the pages written to it (reads elsewhere are zeros).
    HDF5 lays a large file out here (``h5py.File(image, "w")``): its metadata costs memory,
    its datasets' allocated space does not; :meth:`write_to` then puts the pages in a real
    file, and the datasets' bytes follow with plain ``pwrite``. So HDF5 itself never writes
    to a disk that may be full (a write that failed inside HDF5 once crashed the process when
    the file was closed), and no process holds the file's data."""

    PAGE = 4096

    def __init__(self) -> None:
        super().__init__()
        self.pages: dict[int, bytearray] = {}
        self.pos = self.size = 0

    def readable(self) -> bool:
        return True

    def writable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def seek(self, offset: int, whence: int = 0) -> int:
        self.pos = offset if whence == 0 else self.pos + offset if whence == 1 else self.size + offset
        return self.pos

    def tell(self) -> int:
        return self.pos

    def _spans(self, start: int, length: int) -> Iterator[tuple[int, int, int, int]]:
        """(page, offset in page, offset in the caller's buffer, length) covering a range."""
        at = 0
        while at < length:
            page, within = divmod(start + at, self.PAGE)
            k = min(self.PAGE - within, length - at)
            yield page, within, at, k
            at += k

    def readinto(self, buffer: Any) -> int:
        n = min(len(buffer), max(0, self.size - self.pos))
        out = memoryview(buffer).cast("B")
        for page, within, at, k in self._spans(self.pos, n):
            held = self.pages.get(page)
            out[at:at + k] = held[within:within + k] if held is not None else bytes(k)
        self.pos += n
        return n

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        for page, within, at, k in self._spans(self.pos, len(view)):
            self.pages.setdefault(page, bytearray(self.PAGE))[within:within + k] = view[at:at + k]
        self.pos += len(view)
        self.size = max(self.size, self.pos)
        return len(view)

    def truncate(self, size: int | None = None) -> int:
        self.size = self.pos if size is None else size
        for page in [p for p in self.pages if p * self.PAGE >= self.size]:
            del self.pages[page]
        return self.size

    def write_to(self, fd: int) -> None:
        """Its pages into a real file (plain ``pwrite``: a full disk is an OSError here), sized."""
        for page, held in sorted(self.pages.items()):
            end = min(self.PAGE, self.size - page * self.PAGE)
            view, at = memoryview(held)[:end], page * self.PAGE
            while view:
                written = os.pwrite(fd, view, at)
                view, at = view[written:], at + written
        os.ftruncate(fd, self.size)


def contiguous_dataset(group: Any, key: str, np_dtype: Any, shape: tuple[int, ...]) -> Any:
    """An empty, contiguous dataset whose space is allocated now (and never filled by HDF5):
    its bytes are then one range of the file, at ``ds.id.get_offset()``."""
    import h5py

    dcpl = h5py.h5p.create(h5py.h5p.DATASET_CREATE)
    dcpl.set_layout(h5py.h5d.CONTIGUOUS)
    dcpl.set_alloc_time(h5py.h5d.ALLOC_TIME_EARLY)
    dcpl.set_fill_time(h5py.h5d.FILL_TIME_NEVER)
    space = h5py.h5s.create(h5py.h5s.SCALAR) if shape == () else h5py.h5s.create_simple(shape)
    return h5py.Dataset(h5py.h5d.create(group.id, key.encode(), h5py.h5t.py_create(np.dtype(np_dtype)), space,
                                        dcpl=dcpl))


class Slot:
    """Where a leaf's bytes go: the dataset's absolute file offset, its numpy dtype and shape."""

    __slots__ = ("name", "offset", "dtype", "shape")

    def __init__(self, name: str, offset: int | None, dtype: np.dtype, shape: tuple[int, ...]) -> None:
        self.name, self.offset, self.dtype, self.shape = name, offset, dtype, shape


def _leaf_spec(obj: Any) -> tuple[np.dtype, tuple[int, ...], dict[str, Any]]:
    """The numpy dtype and shape a leaf is stored with, and its attributes (but its CRC)."""
    import torch

    if isinstance(obj, np.ndarray):
        return obj.dtype, tuple(obj.shape), {"kind": "ndarray"}
    dtype = obj.dtype
    native, by_width = _dtype_tables()
    shape = tuple(obj.shape)
    stored = dtype if dtype in native else by_width[torch.empty((), dtype=dtype).element_size()]
    np_dtype = torch.empty((), dtype=stored).numpy().dtype
    return np_dtype, shape, {"kind": "tensor", "torch_dtype": str(dtype).removeprefix("torch.")}


def layout_tree(group: Any, name: str, obj: Any) -> list[Slot]:
    """Create ``obj``'s groups, JSON attributes and empty, allocated, contiguous datasets under
    ``group[name]``; returns one :class:`Slot` per array leaf, in :func:`tree_leaves` order.
    The caller writes each leaf's bytes at its offset and then its ``crc32`` attribute."""

    key = _escape(str(name))
    if _is_leaf(obj):
        np_dtype, shape, attrs = _leaf_spec(obj)
        ds = contiguous_dataset(group, key, np_dtype, shape)
        ds.attrs.update({**attrs, "crc32": np.uint32(0)})
        numel = int(np.prod(shape, dtype=np.int64))
        return [Slot(ds.name, ds.id.get_offset() if numel else None, np_dtype, shape)]
    if isinstance(obj, dict) and _has_arrays(obj):
        sub = group.create_group(key, track_order=True)
        sub.attrs["kind"] = "dict"
        key_types = {str(k): type(k).__name__ for k in obj if not isinstance(k, str)}
        slots = [slot for k, v in obj.items() for slot in layout_tree(sub, str(k), v)]
        sub.attrs["order"] = json.dumps([str(k) for k in obj])
        if key_types:
            sub.attrs["key_types"] = json.dumps(key_types)
        return slots
    if isinstance(obj, (list, tuple)) and _has_arrays(obj):
        sub = group.create_group(key, track_order=True)
        sub.attrs["kind"] = "tuple" if isinstance(obj, tuple) else "list"
        return [slot for i, v in enumerate(obj) for slot in layout_tree(sub, str(i), v)]
    group.attrs["json:" + key] = json.dumps(_tag(obj), default=_json_default)
    return []


def _has_arrays(obj: Any) -> bool:
    import torch

    if isinstance(obj, (torch.Tensor, np.ndarray, Deferred, Stored)):
        return True
    if isinstance(obj, dict):
        return any(_has_arrays(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return any(_has_arrays(v) for v in obj)
    return False


def write_tree(group: Any, name: str, obj: Any) -> None:
    """Store ``obj`` under ``group[name]`` (dataset, subgroup or JSON attribute)."""
    import torch

    key = _escape(str(name))
    if isinstance(obj, torch.Tensor):
        arr = _tensor_to_numpy(obj)
        ds = group.create_dataset(key, data=arr)
        ds.attrs.update({"kind": "tensor", "torch_dtype": str(obj.dtype).removeprefix("torch."),
                         "crc32": crc32_of(arr)})
    elif isinstance(obj, np.ndarray):
        ds = group.create_dataset(key, data=obj)
        ds.attrs.update({"kind": "ndarray", "crc32": crc32_of(obj)})
    elif isinstance(obj, dict) and _has_arrays(obj):
        sub = group.create_group(key, track_order=True)
        sub.attrs["kind"] = "dict"
        key_types = {}
        for k, v in obj.items():
            if not isinstance(k, str):
                key_types[str(k)] = type(k).__name__
            write_tree(sub, str(k), v)
        sub.attrs["order"] = json.dumps([str(k) for k in obj])
        if key_types:
            sub.attrs["key_types"] = json.dumps(key_types)
    elif isinstance(obj, (list, tuple)) and _has_arrays(obj):
        sub = group.create_group(key, track_order=True)
        sub.attrs["kind"] = "tuple" if isinstance(obj, tuple) else "list"
        for i, v in enumerate(obj):
            write_tree(sub, str(i), v)
    else:
        group.attrs["json:" + key] = json.dumps(_tag(obj), default=_json_default)


_KEY_TYPES = {"int": int, "float": float, "bool": lambda s: s == "True"}


def _read_dataset(ds: Any, verify: bool, tensors: bool, source: Any = None) -> Any:
    """One dataset as an array or tensor, its CRC attribute checked (``verify``): a mismatch
    raises, or is recorded in ``source.damaged`` where a source reads the file's tensors."""
    arr = ds[()]
    arr = np.asarray(arr)
    if verify and "crc32" in ds.attrs and crc32_of(arr) != int(ds.attrs["crc32"]):
        if source is None:
            raise ChecksumMismatch(f"checksum mismatch in dataset {ds.name}")
        source.damaged.append(ds.name)
    if ds.attrs.get("kind") == "ndarray" or not tensors:
        return arr
    return _as_tensor(arr, ds)


def read_tree(group: Any, name: str, verify: bool = True, tensors: bool = True, lazy: bool = False,
              source: Any = None) -> Any:
    """Inverse of :func:`write_tree`. Raises :class:`ChecksumMismatch` on corrupt data.

    ``tensors=False`` returns tensors as the numpy arrays stored (no torch import); ``lazy``
    returns :class:`Stored` leaves, read when asked (the file must stay open until then), by
    ``source`` where given (see :class:`Stored`).
    """
    import h5py

    key = _escape(str(name))
    if ("json:" + key) in group.attrs:
        return _untag(json.loads(group.attrs["json:" + key]))
    node = group[key]
    if isinstance(node, h5py.Dataset):
        return Stored(node, verify, tensors, source) if lazy else _read_dataset(node, verify, tensors, source)
    kind = node.attrs.get("kind", "dict")
    members = _children(node)
    if kind in ("list", "tuple"):
        items = [read_tree(node, str(i), verify, tensors, lazy, source) for i in range(len(members))]
        return tuple(items) if kind == "tuple" else items
    key_types = json.loads(node.attrs.get("key_types", "{}"))
    out = {}
    for member in members:
        raw = _unescape(member)
        k = _KEY_TYPES[key_types[raw]](raw) if raw in key_types else raw  # type: ignore[operator]
        out[k] = read_tree(node, raw, verify, tensors, lazy, source)
    return out


def _children(node: Any) -> list[str]:
    """Member names (datasets, groups and JSON attrs) in insertion order, unescaped."""
    names = [_unescape(k) for k in node.keys()]
    names += [_unescape(a[5:]) for a in node.attrs.keys() if a.startswith("json:")]
    if node.attrs.get("kind") in ("list", "tuple"):
        return sorted(names, key=int)
    if "order" in node.attrs:
        return list(json.loads(node.attrs["order"]))
    return names
