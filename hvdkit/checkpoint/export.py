"""``hvdkit ckpt export``: a checkpoint's model weights as one file other tools load, one tensor
at a time (memory: the largest tensor, whatever the model's size).

* ``safetensors``: what ``safetensors.torch.load_file`` and ``transformers`` read: an 8-byte
  little-endian header length, a JSON header (name -> dtype, shape, byte range), then the raw
  little-endian bytes in header order (the format is that simple, so it is written directly).
* ``torch``: what ``torch.load(path, weights_only=True)`` reads: torch's zip archive, written
  record by record (the pickled dict of tensors refers to one storage record per tensor).

The weights are the checkpoint's standard layout, whatever the sharding or world size they
were trained at: this replaces DeepSpeed's ``zero_to_fp32``. The file is written atomically.
"""

from __future__ import annotations

import collections
import io
import json
import os
import pickle
import struct
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import CheckpointError, first_line
from ..fileio import fsync_dir
from ..h5tree import Stored, read_tree
from .fileformat import DAMAGED_HINT, _open_verified, _read_meta, damaged_tensor

__all__ = ["export_weights", "FORMATS"]

FORMATS = ("safetensors", "torch")
# torch dtype name -> safetensors dtype
_SAFETENSORS = {"float64": "F64", "float32": "F32", "float16": "F16", "bfloat16": "BF16", "int64": "I64",
                "int32": "I32", "int16": "I16", "int8": "I8", "uint8": "U8", "bool": "BOOL",
                "float8_e4m3fn": "F8_E4M3", "float8_e5m2": "F8_E5M2", "uint16": "U16", "uint32": "U32",
                "uint64": "U64"}


def _module_key(meta: dict[str, Any], state: str | None) -> str:
    """The state to export: ``state``, or the checkpoint's one module state."""
    modules = [k for k, kind in meta["states"].items() if kind == "module"]
    if state is not None:
        if state not in meta["states"]:
            raise CheckpointError(f"the checkpoint has no state {state!r}",
                                  f"it holds {', '.join(meta['states'])}; pass --state with one of them")
        return state
    if len(modules) != 1:
        raise CheckpointError(f"the checkpoint holds {len(modules)} module states ({', '.join(modules) or 'none'})",
                              "name the one to export with --state")
    return modules[0]


def _tensors(f: Any, key: str, source: Any) -> list[tuple[str, Stored]]:
    """The module state's tensors in its order (non-tensor entries, a module's extra state, left
    out), read by ``source`` where it is a reader."""
    tree = read_tree(f, key, verify=True, tensors=False, lazy=True, source=source)
    if not isinstance(tree, dict):
        raise CheckpointError(f"state {key!r} is not a module's state dict", "pass --state naming a model")
    return [(name, leaf) for name, leaf in tree.items() if isinstance(leaf, Stored)]


def _torch_dtype(leaf: Stored) -> str:
    return str(leaf.dataset.attrs.get("torch_dtype", leaf.dataset.dtype.name))


def _raw(leaf: Stored) -> np.ndarray:
    """A tensor's bytes as stored (bf16 as its 16-bit pattern), its CRC checked: a flat,
    contiguous little-endian byte array, the one read (no copy of it, as tobytes() made)."""
    arr = leaf.read()
    return np.ascontiguousarray(arr).astype(arr.dtype.newbyteorder("<"), copy=False).reshape(-1).view(np.uint8)


def _write_safetensors(out: Path, tensors: list[tuple[str, Stored]]) -> None:
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    at = 0
    for name, leaf in tensors:
        dtype = _torch_dtype(leaf)
        if dtype not in _SAFETENSORS:
            raise CheckpointError(f"{name} is {dtype}, which safetensors cannot hold", "use --format torch")
        header[name] = {"dtype": _SAFETENSORS[dtype], "shape": list(leaf.shape), "data_offsets": [at, at + leaf.nbytes]}
        at += leaf.nbytes
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    with out.open("wb") as fh:
        fh.write(struct.pack("<Q", len(text)) + text)
        for _, leaf in tensors:
            fh.write(_raw(leaf).data)
        fh.flush()
        os.fsync(fh.fileno())


class _StorageRef:
    def __init__(self, key: str, dtype: Any, numel: int) -> None:
        self.key, self.dtype, self.numel = key, dtype, numel


class _TensorRef:
    """Pickles as the tensor ``torch.load`` rebuilds from storage record ``data/<key>``."""

    def __init__(self, storage: _StorageRef, shape: tuple[int, ...]) -> None:
        self.storage, self.shape = storage, shape

    def __reduce__(self) -> Any:
        import torch
        from torch._utils import _rebuild_tensor_v2

        stride = torch.empty(self.shape, device="meta").stride()
        return (_rebuild_tensor_v2, (self.storage, 0, torch.Size(self.shape), stride, False,
                                     collections.OrderedDict()))


def _write_torch(out: Path, tensors: list[tuple[str, Stored]]) -> None:
    import torch

    storage_names = torch.storage._dtype_to_storage_type_map()

    class Pickler(pickle.Pickler):
        def persistent_id(self, obj: Any) -> Any:
            if isinstance(obj, _StorageRef):
                return ("storage", getattr(torch, storage_names[obj.dtype]), obj.key, "cpu", obj.numel)
            return None

    refs = {}
    for k, (name, leaf) in enumerate(tensors):
        dtype = getattr(torch, _torch_dtype(leaf))
        refs[name] = _TensorRef(_StorageRef(str(k), dtype, int(np.prod(leaf.shape, dtype=np.int64))), leaf.shape)
    pickled = io.BytesIO()
    Pickler(pickled, protocol=2).dump(collections.OrderedDict(refs))
    writer = torch._C.PyTorchFileWriter(str(out))
    writer.write_record("data.pkl", pickled.getvalue(), len(pickled.getvalue()))
    writer.write_record("byteorder", b"little", len(b"little"))
    for k, (_, leaf) in enumerate(tensors):
        raw = _raw(leaf)
        writer.write_record(f"data/{k}", raw.ctypes.data, raw.nbytes)  # from its memory, as torch.save does
        del raw
    writer.write_end_of_file()


def export_weights(path: str | os.PathLike[str], out: str | os.PathLike[str], fmt: str = "safetensors",
                   state: str | None = None) -> tuple[int, int]:
    """Write the weights of ``path``'s module state (``state``, or its one module) to ``out`` in
    ``fmt``, atomically; returns (tensors, bytes). One-line :class:`CheckpointError` on a bad
    or corrupt checkpoint."""
    if fmt not in FORMATS:
        raise CheckpointError(f"--format {fmt} is not known", f"use one of: {', '.join(FORMATS)}")
    path, out = Path(path), Path(out)
    tmp = out.with_name(f".{out.name}.tmp{os.getpid()}")
    # the metadata verified first; each tensor exported is checked as it is read (one pass
    # over the model's bytes: an optimizer's state is not read; `hvdkit ckpt verify` reads all)
    f, reader, _ = _open_verified(path, as_read=True)
    try:
        with f:
            key = _module_key(_read_meta(f), state)
            tensors = _tensors(f, key, reader)
            (_write_safetensors if fmt == "safetensors" else _write_torch)(tmp, tensors)
        if reader is not None and reader.damaged:
            raise damaged_tensor(path, reader.damaged[0])
        os.replace(tmp, out)
        fsync_dir(out.parent)
        return len(tensors), sum(leaf.nbytes for _, leaf in tensors)
    except CheckpointError:
        raise
    except OSError as exc:
        raise CheckpointError(f"cannot write {out}: {exc.strerror or exc}", "choose a writable path") from None
    except Exception as exc:
        raise CheckpointError(f"checkpoint {path} is corrupt: {first_line(exc)}", DAMAGED_HINT) from None
    finally:
        tmp.unlink(missing_ok=True)
        if reader is not None:
            reader.close()
