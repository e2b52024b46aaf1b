"""Mixed precision: autocast for bf16/fp16 and, for fp16, a gradient scaler.

The model's parameters and the optimizer stay in fp32; autocast runs the forward
pass in the lower precision where that is safe. fp16 needs loss scaling (its
range is small: gradients underflow); bf16 has fp32's range and needs none. The
order of scaler calls around the gradient reduction is backend knowledge and
lives in :meth:`hvdkit.backends.Backend.optimizer_step`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from .config import PRECISIONS

__all__ = ["PRECISIONS", "autocast", "make_scaler"]

_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


@contextlib.contextmanager
def autocast(precision: str, device: torch.device) -> Iterator[None]:
    """Autocast to ``precision`` on ``device`` (CPU and CUDA); nothing for fp32."""
    if precision == "fp32":
        yield
        return
    with torch.autocast(device_type=device.type, dtype=_DTYPES[precision]):
        yield


def make_scaler(precision: str, device: torch.device) -> torch.amp.GradScaler | None:
    """A dynamic loss scaler for fp16 (its state goes into checkpoints); ``None`` otherwise."""
    return torch.amp.GradScaler(device.type) if precision == "fp16" else None
