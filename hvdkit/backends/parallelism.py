"""How the model and optimizer are spread over the ranks: one strategy object, chosen once.

A :class:`~hvdkit.backends.base.Backend` is two things. It is a **communicator**: rank,
size, the collectives and abort, the :class:`Communicator` protocol below, which is all that
ZeRO, FSDP and the bucket engine need. And it holds a **parallelism**, chosen in
``Backend.wrap`` from ``BackendConfig.shard``, which owns everything that depends on how
the state is spread: the wrap, the micro-batch context, the optimizer step, gathering the
whole state for a checkpoint, loading it on rank 0, and the broadcast that scatters it.

* :class:`Replicated` (``--shard none``, here): every rank holds everything; the backend's
  own reducer (DDP's, Horovod's) averages the gradients, so this class asks the backend for
  its replicated primitives (``wrap_replicated``, ``step_replicated``, ...).
* ``ZeroParallelism`` (``--shard optimizer``, :mod:`hvdkit.backends.zero`): whole parameters
  everywhere, optimizer state and reduced gradients by owner.
* ``FullyShardedParallelism`` (``--shard full``, :mod:`hvdkit.backends.fsdp`): FSDP2.

Nothing outside these classes asks "is it sharded?": the loop, the state capture and the
memory report call the backend, which asks its parallelism.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator, Sized
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

import torch
from torch import nn

from .powersgd import STATE_KEY as POWERSGD_KEY

if TYPE_CHECKING:
    from .base import Backend

__all__ = ["Communicator", "Parallelism", "Replicated", "state_tensors", "to_cpu"]

T = TypeVar("T")


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


class Communicator(Protocol):
    """Rank, size and the collectives: what sharding and the bucket engine need of a backend."""

    @property
    def rank(self) -> int: ...

    @property
    def size(self) -> int: ...

    @property
    def device(self) -> torch.device: ...

    def broadcast_object(self, obj: T, root: int = 0) -> T: ...

    def allreduce_metric(self, value: float | torch.Tensor, op: str = "mean") -> float: ...

    def start_reduce_scatter_mean(self, flat: torch.Tensor, name: str) -> Callable[[], torch.Tensor]: ...

    def start_all_gather_flat(self, shard: torch.Tensor, name: str) -> Callable[[], torch.Tensor]: ...

    def start_allreduce_mean(self, tensor: torch.Tensor, name: str) -> Callable[[], torch.Tensor]: ...

    def start_broadcast_(self, tensor: torch.Tensor, root: int, name: str) -> Callable[[], torch.Tensor]: ...


class Parallelism:
    """The default, replicated: every rank holds the whole model and optimizer, and the
    backend's own reducer averages the gradients. A sharding mode overrides what it changes."""

    shard = "none"                 # BackendConfig.shard's value for this strategy
    replicates_parameters = True   # False: each rank holds part of the parameters (FSDP)
    comm_wait_measured = True      # False: the gradient wait cannot be told from compute

    def __init__(self, backend: Backend) -> None:
        self.backend = backend
        self._powersgd_loaded: dict[str, Any] | None = None  # rank 0's, between a load and the broadcast

    def wrap(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> tuple[nn.Module, torch.optim.Optimizer]:
        """``model`` is on the device already; make its gradients data-parallel."""
        return self.backend.wrap_replicated(model, optimizer)

    def accumulate(self, model: nn.Module, sync: bool) -> contextlib.AbstractContextManager[None]:
        """Context for one micro-batch's backward; ``sync=False`` skips communication."""
        return self.backend.accumulate_replicated(model, sync)

    def optimizer_step(self, optimizer: torch.optim.Optimizer, scaler: torch.amp.GradScaler | None,
                       clip_grad_norm: float | None) -> None:
        """Apply the reduced gradients (unscale, clip, step)."""
        self.backend.step_replicated(optimizer, scaler, clip_grad_norm)

    # -- the whole state, for checkpoints and elastic commits ------------------------------
    def module_state_dict(self, model: nn.Module) -> dict[str, Any]:
        return self.backend.unwrap(model).state_dict()

    def replica_state_dict(self, model: nn.Module) -> dict[str, Any]:
        return self.backend.unwrap(model).state_dict()

    def load_module_state_dict(self, model: nn.Module, state: dict[str, Any]) -> None:
        self.backend.unwrap(model).load_state_dict(state)

    def optimizer_state_dict(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        """The optimizer's state; with PowerSGD also its state, every rank's error feedback
        gathered (collective, as a checkpoint's capture is)."""
        state = optimizer.state_dict()
        powersgd = self.backend.powersgd
        if powersgd is None:
            return state
        mine = powersgd.state_dict()
        errors = self.backend.gather_objects(to_cpu(mine.pop("error")))
        return {**state, POWERSGD_KEY: {**mine, "q": to_cpu(mine["q"]), "error": errors}}

    def load_optimizer_state_dict(self, optimizer: torch.optim.Optimizer, state: dict[str, Any]) -> None:
        """Rank 0 loads a checkpoint; :meth:`broadcast_optimizer` then gives each rank its own
        PowerSGD error feedback."""
        state = dict(state)
        saved = state.pop(POWERSGD_KEY, None)
        optimizer.load_state_dict(state)
        if self.backend.powersgd is not None:
            self._powersgd_loaded = saved  # None: saved without PowerSGD, which starts afresh
            self._apply_powersgd(saved)

    def _apply_powersgd(self, saved: dict[str, Any] | None) -> None:
        """This rank's part of a gathered PowerSGD state (its own error feedback, where the
        world size is the one it was saved at; else the error feedback restarts from zero)."""
        assert self.backend.powersgd is not None
        if saved is None:
            return
        errors = saved["error"]
        mine = errors[self.backend.rank] if len(errors) == self.backend.size else {}
        self.backend.powersgd.load_state_dict({**saved, "error": mine})

    def broadcast_state(self, model: nn.Module, optimizer: torch.optim.Optimizer | None, root: int) -> None:
        """Collective: every rank takes ``root``'s model and optimizer state. The optimizer
        first: Horovod's optimizer broadcast may take a zero-gradient step on a rank that had
        no state, and the parameters' broadcast must come after it."""
        if optimizer is not None:
            self.broadcast_optimizer(optimizer, root)
        self.backend.broadcast_parameters(model, root)

    def broadcast_optimizer(self, optimizer: torch.optim.Optimizer, root: int) -> None:
        self.backend.broadcast_replicated_optimizer(optimizer, root)
        if self.backend.powersgd is not None:  # what root loaded (and applied), each rank its own error feedback
            saved = self.backend.broadcast_object(self._powersgd_loaded if self.backend.rank == root else None, root)
            if self.backend.rank != root:
                self._apply_powersgd(saved)
            self._powersgd_loaded = None

    # -- evaluation and reports --------------------------------------------------------------
    def eval_batches(self, loader: Iterable[Any], shard: Sized) -> Iterator[tuple[Any, int]]:
        """This rank's evaluation batches with their weight (1 each)."""
        for batch in loader:
            yield batch, 1

    def held(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """What this rank holds between steps, for the memory report: the gradients it keeps,
        and its optimizer state's tensors."""
        return [p for p in model.parameters() if p.requires_grad], state_tensors(optimizer)

    def report(self) -> dict[str, int] | None:
        """What this mode has to say in the metrics file (ZeRO: its buckets and overlap)."""
        return None


Replicated = Parallelism
