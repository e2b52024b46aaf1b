"""What is installed for a backend, found without importing it (the CLI must stay light)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

__all__ = ["horovod_has_mpi"]


def horovod_has_mpi() -> bool:
    """True when the installed ``horovod.torch`` extension links an MPI library.

    Read from the extension file itself (its ELF ``DT_NEEDED`` names ``libmpi.so``):
    importing horovod would import torch, seconds on a login node.
    """
    spec = importlib.util.find_spec("horovod")  # a top-level find_spec imports nothing
    if spec is None or not spec.submodule_search_locations:
        return False
    for location in spec.submodule_search_locations:
        for lib in Path(location, "torch").glob("mpi_lib_v2*.so"):
            try:
                if b"libmpi.so" in lib.read_bytes():
                    return True
            except OSError:
                continue
    return False
