#!/usr/bin/env python3
"""Print the NAME=value build variables that point Horovod's CMake at CUDA and NCCL.

usage: cuda_home.py SCRATCH_DIR  (run with the venv's python, after torch's CUDA wheels)

NCCL comes from the ``nvidia-nccl-cu*`` wheel torch depends on: its ``lib`` holds only
``libnccl.so.2``, so a ``libnccl.so`` link is made in SCRATCH_DIR for the linker. CUDA is
the system's (``nvcc`` on PATH, or CUDA_HOME) or else pip's ``nvidia-cuda-nvcc-cu*`` and
``nvidia-cuda-runtime-cu*``, whose files are merged by links into SCRATCH_DIR/cuda so
that it looks like one toolkit directory.
"""

from __future__ import annotations

import importlib
import os
import shutil
import sys
from pathlib import Path


def _pkg_dir(name: str) -> Path | None:
    try:
        return Path(list(importlib.import_module(name).__path__)[0])
    except (ImportError, IndexError):
        return None


def _link_tree(src: Path, dst: Path) -> None:
    for path in src.rglob("*"):
        target = dst / path.relative_to(src)
        if path.is_dir():
            target.mkdir(parents=True, exist_ok=True)
        elif not target.exists():
            target.parent.mkdir(parents=True, exist_ok=True)
            target.symlink_to(path)


def main(scratch: Path) -> int:
    scratch.mkdir(parents=True, exist_ok=True)
    nccl = _pkg_dir("nvidia.nccl")
    if nccl is None:
        print("cuda_home: no nvidia-nccl wheel in this venv (is torch the CUDA build?)", file=sys.stderr)
        return 1
    nccl_lib = scratch / "nccl-lib"
    _link_tree(nccl / "lib", nccl_lib)
    if not (nccl_lib / "libnccl.so").exists():
        (nccl_lib / "libnccl.so").symlink_to(nccl / "lib" / "libnccl.so.2")
    print(f"HOROVOD_NCCL_INCLUDE={nccl / 'include'}")
    print(f"HOROVOD_NCCL_LIB={nccl_lib}")
    nvcc = shutil.which("nvcc")
    if os.environ.get("CUDA_HOME"):
        home = Path(os.environ["CUDA_HOME"])
    elif nvcc:
        home = Path(nvcc).resolve().parent.parent
    else:
        home = scratch / "cuda"
        for part in ("cuda_nvcc", "cuda_runtime", "cuda_cccl"):
            found = _pkg_dir(f"nvidia.{part}")
            if found is not None:
                _link_tree(found, home)
        if (home / "lib").is_dir() and not (home / "lib64").exists():
            (home / "lib64").symlink_to(home / "lib")
        if not (home / "bin" / "nvcc").exists():
            print("cuda_home: no nvcc: install CUDA or pip's nvidia-cuda-nvcc-cu*", file=sys.stderr)
            return 1
    print(f"HOROVOD_CUDA_HOME={home}")
    print(f"CUDACXX={home / 'bin' / 'nvcc'}")
    return 0


if __name__ == "__main__":
    sys.exit(main(Path(sys.argv[1])))
