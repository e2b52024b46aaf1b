"""Single process, no launcher: ``python examples/train.py`` just works."""

from __future__ import annotations

import copy
from typing import TypeVar

import torch
from torch import nn

from .base import Backend

T = TypeVar("T")


class LocalBackend(Backend):
    """World of size 1; collectives are identities."""

    name = "local"

    @property
    def rank(self) -> int:
        return 0

    @property
    def size(self) -> int:
        return 1

    @property
    def local_rank(self) -> int:
        return 0

    def broadcast_parameters(self, model: nn.Module, root: int = 0) -> None:
        return None

    def sync_buffers(self, model: nn.Module, root: int = 0) -> None:
        return None

    def broadcast_object(self, obj: T, root: int = 0) -> T:
        return copy.deepcopy(obj)

    def gather_objects(self, obj: T) -> list[T]:
        return [copy.deepcopy(obj)]

    def allreduce_tensor(self, tensor: torch.Tensor, op: str = "mean") -> torch.Tensor:
        return tensor.clone()

    def barrier(self) -> None:
        return None

    def shutdown(self) -> None:
        return None
