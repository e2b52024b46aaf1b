"""Bytes of tensors: the one count that every memory figure is made of (the preflight, the
footprint of a sharding mode, ZeRO's report, the metrics file's rank memory)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

__all__ = ["nbytes"]


def nbytes(tensors: Iterable[Any]) -> int:
    """Bytes of the tensors among ``tensors`` (anything else is skipped); a meta tensor counts
    what it would hold."""
    return sum(t.numel() * t.element_size() for t in tensors if isinstance(t, torch.Tensor))
