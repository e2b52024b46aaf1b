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

__all__ = ["Communicator", "Wait", "to_cpu", "state_tensors", "broadcast_tensors", "broadcast_tree", "TensorSpec",
           "skeleton"]

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


class TensorSpec:
    """A tensor's place in a broadcast tree: its shape and dtype, sent ahead of its bytes."""

    def __init__(self, shape: tuple[int, ...], dtype: torch.dtype, device: str) -> None:
        self.shape, self.dtype, self.device = shape, dtype, device


def skeleton(tree: Any) -> Any:
    """``tree`` with each tensor replaced by its :class:`TensorSpec` (what others need to receive it)."""
    if isinstance(tree, torch.Tensor):
        return TensorSpec(tuple(tree.shape), tree.dtype, str(tree.device))
    if isinstance(tree, dict):
        return {k: skeleton(v) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):
        return type(tree)(skeleton(v) for v in tree)
    return tree


def broadcast_tree(comm: Communicator, tree: Any, root: int = 0, into: Any = None) -> Any:
    """Collective: ``root``'s nested dicts and lists of tensors and plain values on every rank,
    one tensor in flight at a time (its structure first, as one small object): memory is the
    largest tensor, not the tree. Root gets its own tree back; the others, new tensors on
    :attr:`Communicator.device`, or, where ``into`` (a tree of theirs, such as an optimizer's
    current state) holds a contiguous tensor of the same shape and dtype at the same place on
    that device, that tensor overwritten: no second copy of the tree."""
    shapes = comm.broadcast_object(skeleton(tree) if comm.rank == root else None, root)
    counter = [0]

    def fill(mine: Any, shape: Any, like: Any) -> Any:
        if isinstance(shape, TensorSpec):  # sent on the communicator's device, kept where root keeps it
            counter[0] += 1
            reuse = isinstance(like, torch.Tensor) and tuple(like.shape) == shape.shape and \
                like.dtype == shape.dtype and like.device == comm.device and like.is_contiguous()
            t = mine.contiguous().to(comm.device) if comm.rank == root else like if reuse else \
                torch.empty(shape.shape, dtype=shape.dtype, device=comm.device)
            comm.start_broadcast_(t, root, f"tree.{counter[0]}")()
            return mine if comm.rank == root else t if reuse else t.to(shape.device)
        if isinstance(shape, dict):
            named = like if isinstance(like, dict) else {}
            return {k: fill(mine[k] if comm.rank == root else None, v, named.get(k)) for k, v in shape.items()}
        if isinstance(shape, (list, tuple)):
            likes = like if isinstance(like, (list, tuple)) and len(like) == len(shape) else [None] * len(shape)
            return type(shape)(fill(mine[i] if comm.rank == root else None, v, likes[i])
                               for i, v in enumerate(shape))
        return shape

    with torch.no_grad():
        return fill(tree, shapes, into if comm.rank != root else None)
