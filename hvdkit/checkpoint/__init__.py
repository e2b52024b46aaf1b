"""Rank-0 HDF5 checkpoints: written atomically, sealed and checksummed, resumed on every rank.

- :mod:`.fileformat`: one file, a dict of named states, written one tensor at a time
  (``write_checkpoint``) and read the same way (``open_checkpoint``);
- :mod:`.integrity`: the sealed header and the content checksum;
- :mod:`.rng`: every rank's generator states;
- :mod:`.manager`: the collective :class:`CheckpointManager` (rotation, ``latest``, keep-best);
- :mod:`.summary`: what ``hvdkit ckpt show`` prints (no torch import).
"""

from .fileformat import (
    FORMAT,
    FORMAT_VERSION,
    OpenCheckpoint,
    Snapshot,
    checkpoint_name,
    drain,
    open_checkpoint,
    read_checkpoint,
    step_of,
    verify_checkpoint,
    write_checkpoint,
)
from .manager import CheckpointManager, Restored, parse_keep_best
from .rng import capture_rng, restore_rng
from .summary import summarize_checkpoint

__all__ = [
    "FORMAT", "FORMAT_VERSION", "CheckpointManager", "OpenCheckpoint", "Restored", "Snapshot", "capture_rng",
    "checkpoint_name", "drain", "open_checkpoint", "parse_keep_best", "read_checkpoint", "restore_rng",
    "step_of", "summarize_checkpoint", "verify_checkpoint", "write_checkpoint",
]
