"""Rank-0 HDF5 checkpoints: written atomically, sealed and checksummed, resumed on every rank.

- :mod:`.fileformat`: one file, a dict of named states (``write_checkpoint``/``read_checkpoint``);
- :mod:`.integrity`: the sealed header and the content checksum;
- :mod:`.rng`: every rank's generator states;
- :mod:`.manager`: the collective :class:`CheckpointManager` (rotation, ``latest``, keep-best);
- :mod:`.summary`: what ``hvdkit ckpt show`` prints (no torch import).
"""

from .fileformat import (
    FORMAT,
    FORMAT_VERSION,
    Snapshot,
    checkpoint_name,
    read_checkpoint,
    step_of,
    verify_checkpoint,
    write_checkpoint,
)
from .manager import CheckpointManager, Restored, nonfinite_tensor, parse_keep_best
from .rng import capture_rng, restore_rng
from .summary import summarize_checkpoint

__all__ = [
    "FORMAT", "FORMAT_VERSION", "CheckpointManager", "Restored", "Snapshot", "capture_rng",
    "checkpoint_name", "nonfinite_tensor", "parse_keep_best", "read_checkpoint", "restore_rng",
    "step_of", "summarize_checkpoint", "verify_checkpoint", "write_checkpoint",
]
