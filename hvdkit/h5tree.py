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
"""

from __future__ import annotations

import functools
import json
import zlib
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    import torch

__all__ = ["write_tree", "read_tree", "crc32_of", "ChecksumMismatch"]


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


def crc32_of(array: np.ndarray, value: int = 0) -> int:
    """CRC-32 of an array's raw bytes (C order)."""
    return zlib.crc32(np.ascontiguousarray(array).tobytes(), value) & 0xFFFFFFFF


def _escape(name: str) -> str:
    return name.replace("%", "%25").replace("/", "%2F") or "%00"


def _unescape(name: str) -> str:
    return "" if name == "%00" else name.replace("%2F", "/").replace("%25", "%")


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


def _has_arrays(obj: Any) -> bool:
    import torch

    if isinstance(obj, (torch.Tensor, np.ndarray)):
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


def _read_dataset(ds: Any, verify: bool, tensors: bool) -> Any:
    arr = ds[()]
    arr = np.asarray(arr)
    if verify and "crc32" in ds.attrs and crc32_of(arr) != int(ds.attrs["crc32"]):
        raise ChecksumMismatch(f"checksum mismatch in dataset {ds.name}")
    if ds.attrs.get("kind") == "ndarray" or not tensors:
        return arr
    import torch

    tensor = torch.from_numpy(arr.copy() if arr.ndim == 0 else arr)
    dtype = getattr(torch, str(ds.attrs.get("torch_dtype", "")), None)
    if isinstance(dtype, torch.dtype) and dtype != tensor.dtype:
        tensor = tensor.view(dtype)
    return tensor


def read_tree(group: Any, name: str, verify: bool = True, tensors: bool = True) -> Any:
    """Inverse of :func:`write_tree`. Raises :class:`ChecksumMismatch` on corrupt data.

    ``tensors=False`` returns tensors as the numpy arrays stored (no torch import).
    """
    import h5py

    key = _escape(str(name))
    if ("json:" + key) in group.attrs:
        return _untag(json.loads(group.attrs["json:" + key]))
    node = group[key]
    if isinstance(node, h5py.Dataset):
        return _read_dataset(node, verify, tensors)
    kind = node.attrs.get("kind", "dict")
    members = _children(node)
    if kind in ("list", "tuple"):
        items = [read_tree(node, str(i), verify, tensors) for i in range(len(members))]
        return tuple(items) if kind == "tuple" else items
    key_types = json.loads(node.attrs.get("key_types", "{}"))
    out = {}
    for member in members:
        raw = _unescape(member)
        k = _KEY_TYPES[key_types[raw]](raw) if raw in key_types else raw  # type: ignore[operator]
        out[k] = read_tree(node, raw, verify, tensors)
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
