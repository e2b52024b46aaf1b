"""What every strategy and the bucket engine need of a backend: the :class:`Communicator`.

The lowest layer of ``hvdkit/backends/``: rank, size, device and the collectives, as a
protocol. A :class:`~hvdkit.backends.base.Backend` is one; the strategies
(:mod:`~hvdkit.backends.strategy`, ``zero``, ``fsdp``) and the bucket engine take one and know
nothing else about it, so they import nothing above this module.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any, Protocol, TypeVar

import torch

__all__ = ["Communicator", "Wait", "to_cpu", "state_tensors", "broadcast_tensors"]

T = TypeVar("T")

Wait = Callable[[], torch.Tensor]
"""Returned by an asynchronous collective: blocks until it is done and returns its result."""


class Communicator(Protocol):
    """Rank, size and the collectives."""

    @property
    def rank(self) -> int: ...

    @property
    def size(self) -> int: ...

    @property
    def device(self) -> torch.device: ...

    def broadcast_object(self, obj: T, root: int = 0) -> T: ...

    def gather_objects(self, obj: T) -> list[T]: ...

    def allreduce_metric(self, value: float | torch.Tensor, op: str = "mean") -> float: ...

    def start_reduce_scatter_mean(self, flat: torch.Tensor, name: str) -> Wait:
        """Average ``flat`` (a length divisible by the world size); the result is this rank's 1/N."""
        ...

    def start_all_gather_flat(self, shard: torch.Tensor, name: str) -> Wait:
        """Every rank's equal-length 1D ``shard``, concatenated in rank order."""
        ...

    def start_allreduce_mean(self, tensor: torch.Tensor, name: str) -> Wait: ...

    def start_broadcast_(self, tensor: torch.Tensor, root: int, name: str) -> Wait:
        """Overwrite ``tensor`` in place with ``root``'s."""
        ...


def to_cpu(obj: Any) -> Any:
    """Copy every tensor in a nested structure to CPU (so it pickles without CUDA)."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().cpu()
    if isinstance(obj, dict):
        return {k: to_cpu(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(to_cpu(v) for v in obj)
    return obj


def state_tensors(optimizer: torch.optim.Optimizer | None) -> list[Any]:
    """Every value in ``optimizer``'s per-parameter state (momenta, steps), for the memory report."""
    return [] if optimizer is None else [v for s in optimizer.state.values() for v in s.values()]


def broadcast_tensors(comm: Communicator, tensors: Iterable[tuple[str, torch.Tensor]], root: int = 0) -> None:
    """Collective: every rank's named ``tensors`` overwritten in place with ``root``'s, all started
    before the first is waited for (parameters and buffers of a model, in one order everywhere)."""
    with torch.no_grad():
        waits = [comm.start_broadcast_(t, root, f"bcast.{name}") for name, t in tensors]
        for wait in waits:
            wait()
