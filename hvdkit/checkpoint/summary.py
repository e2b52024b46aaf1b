"""What ``hvdkit ckpt show`` prints: metadata, metrics, the model tensors, the checksum verdict.

Reads arrays only (no torch import): a login node answers in a fraction of a second.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from ..errors import CheckpointError, first_line
from ..h5tree import read_tree
from .fileformat import DAMAGED_HINT, _read_meta, check_checkpoint, open_metadata

__all__ = ["summarize_checkpoint"]


def summarize_checkpoint(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Metadata, tensors of every module state (name, dtype, shape, bytes) and checksum verdict.

    Raises :class:`CheckpointError` (one line) if the file cannot be read or does not verify
    (:func:`~hvdkit.checkpoint.fileformat.check_checkpoint`, one pass over it).
    """
    import h5py

    check_checkpoint(path)  # the one pass over the file: damage is one line, as any error
    f = open_metadata(Path(path))
    try:
        with f:
            meta = _read_meta(f)
            modules = [k for k, kind in meta["states"].items() if kind == "module"] or \
                [k for k in ("model",) if k in f]
            tensors = []
            for key in modules:
                def visit(name: str, node: Any, key: str = key) -> None:
                    if isinstance(node, h5py.Dataset):
                        label = name.replace("%2F", "/") if len(modules) == 1 else f"{key}/{name}"
                        dtype = str(node.attrs.get("torch_dtype", node.dtype))
                        tensors.append((label, dtype, tuple(node.shape), int(node.nbytes)))
                f[key].visititems(visit)
            loop: Any = {}
            for key in ("loop", "progress"):  # hvdkit train's loop state (small: a JSON attribute)
                if ("json:" + key) in f.attrs or key in f:
                    loop = read_tree(f, key, verify=False, tensors=False)
            for name in ("epoch", "global_step", "samples_seen"):
                if isinstance(loop, dict) and name in loop:
                    meta.setdefault(name, loop[name])
    except CheckpointError:
        raise
    except Exception as exc:
        raise CheckpointError(f"checkpoint {path} is corrupt: {first_line(exc)}", DAMAGED_HINT) from None
    return {"meta": meta, "tensors": tensors, "checksum_ok": True, "checksum_message": "checksum OK"}
