"""Checkpoint I/O: HDF5 (hvdkit) vs ``torch.save``, same state, alternating, both fsync'd."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import torch

from ..checkpoint import Snapshot, read_checkpoint, write_checkpoint


def _state(params_millions: float) -> dict[str, torch.Tensor]:
    """Square fp32 layers adding up to ~``params_millions`` M parameters."""
    width = 4096
    layers = max(1, round(params_millions * 1e6 / (width * width + width)))
    gen = torch.Generator().manual_seed(0)
    out = {}
    for i in range(layers):
        out[f"layer{i}.weight"] = torch.randn(width, width, generator=gen)
        out[f"layer{i}.bias"] = torch.randn(width, generator=gen)
    return out


def _torch_save(state: dict[str, torch.Tensor], path: Path) -> None:
    with open(path, "wb") as f:  # same durability as hvdkit: flushed and fsync'd
        torch.save(state, f)
        f.flush()
        os.fsync(f.fileno())


def run_ckpt_io(directory: Path, params_millions: float = 100.0, rounds: int = 3) -> dict[str, Any]:
    """Seconds to save and to load (page-cache warm) the same state both ways, A/B/A/B."""
    state = _state(params_millions)
    nbytes = sum(t.numel() * t.element_size() for t in state.values())
    times: dict[str, list[float]] = {"hdf5_save": [], "torch_save": [], "hdf5_load": [], "torch_load": []}
    directory.mkdir(parents=True, exist_ok=True)
    h5, pt = directory / "bench-ckpt.h5", directory / "bench-ckpt.pt"
    for _ in range(rounds):
        t0 = time.perf_counter()
        write_checkpoint(h5, Snapshot(states={"model": state}))
        t1 = time.perf_counter()
        _torch_save(state, pt)
        t2 = time.perf_counter()
        read_checkpoint(h5, verify=True)
        t3 = time.perf_counter()
        torch.load(pt, weights_only=True)
        t4 = time.perf_counter()
        times["hdf5_save"].append(t1 - t0)
        times["torch_save"].append(t2 - t1)
        times["hdf5_load"].append(t3 - t2)
        times["torch_load"].append(t4 - t3)
    sizes = {"hdf5_file_bytes": h5.stat().st_size, "torch_file_bytes": pt.stat().st_size}
    h5.unlink()
    pt.unlink()
    return {"params": sum(t.numel() for t in state.values()), "state_bytes": nbytes, **sizes, "seconds": times}
