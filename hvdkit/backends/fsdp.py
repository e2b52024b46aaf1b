"""``--shard full`` on the DDP path: FSDP2 (``torch.distributed.fsdp.fully_shard``).

Each rank holds 1/N of every parameter, its gradient and its optimizer state; a unit's
parameters are all-gathered for its forward and backward and its gradients reduce-scattered.
Units: each of the model's blocks (:func:`hvdkit.blocks.shard_units`: transformer layers, ResNet
stages' blocks), then the root for the rest, tied parameters (an embedding and its head)
included.

Checkpoints stay whole, streamed: :func:`model_state` and :func:`optimizer_state` give the
whole state in the standard layout (the optimizer's in ``torch.optim``'s, parameters by index)
with every sharded tensor :class:`~hvdkit.h5tree.Deferred`: gathered (``full_tensor``) only
when the writer fetches it, whole on rank 0 alone, one at a time. So a sharded run resumes
unsharded and the other way round, at any world size, and no rank ever holds the model. Loading
is the reverse: rank 0 *holds* what it read (tensors still in the open file), and the
broadcast that follows every restore sends one tensor at a time, each rank sent only its own
rows of a sharded one (a ``scatter``: no other rank holds it whole)
(:func:`scatter_model_state`, :func:`scatter_optimizer_state`).
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterable, Iterator, Sized
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from ..blocks import shard_units
from ..errors import HvdkitError
from ..h5tree import Deferred, Stored
from ..materialise import own_tensors
from .comm import Communicator, broadcast_tensors
from .strategy import Strategy, collective_eval_batches, held_state, loaded_mismatch, regrouped, scatter_optimizer

if TYPE_CHECKING:
    from ..materialise import MetaInit

__all__ = ["FullyShardedStrategy", "shard_model", "model_state", "optimizer_state",
           "scatter_model_state", "scatter_optimizer_state"]

def shard_model(model: nn.Module, optimizer: torch.optim.Optimizer) -> tuple[nn.Module, torch.optim.Optimizer]:
    """Shard ``model`` in place and rebuild ``optimizer`` (same class, groups and
    hyper-parameters) over the sharded parameters, which are new objects."""
    from torch.distributed.fsdp import fully_shard

    def shard() -> None:
        for unit in shard_units(model):
            fully_shard(unit)
        fully_shard(model)

    return model, regrouped(optimizer, model, shard)


def make_sharded(model: nn.Module, comm: Communicator, init: MetaInit, root: int = 0) -> None:
    """Collective: the tensors of a meta-built, sharded ``model`` made, one module at a time:
    ``root`` makes each module's own tensors whole and initialises them (``init``'s hook), sends
    each, and every rank keeps its shard. No rank holds more than one module's tensors whole."""
    _reshard(model)
    model.to_empty(device=comm.device)  # FSDP2 keeps each sharded parameter object (and ties)

    def send(module: nn.Module, tensors: dict[str, torch.Tensor] | None) -> None:
        for _, key, target in own_tensors(module):
            _load_part(comm, tensors[key] if tensors is not None else None, target, root)

    if comm.rank == root:
        init.make(send)
        return
    with torch.no_grad():  # the others receive, module by module in the same order
        for _, module in init.order:
            if any(True for _ in own_tensors(module)):
                send(module, None)


def _reshard(model: nn.Module) -> None:
    """Register every unit's sharded parameters again. A forward pass without backward (the
    data check, evaluation) leaves the root unit's parameters gathered, and registered in
    place of the sharded ones the optimizer steps: its parameters would then not be found
    in the model (a resume failed so) and a load would write into the gathered copies."""
    from torch.distributed.fsdp import FSDPModule

    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()


def _whole_on_rank0(rank: int, tree: Any) -> Any:
    """``tree`` with each DTensor a Deferred: its ``full_tensor()`` (collective), on rank 0's CPU."""
    from torch.distributed.tensor import DTensor

    def gather(t: DTensor) -> torch.Tensor | None:
        whole = t.full_tensor()
        return whole.detach().cpu() if rank == 0 else None

    if isinstance(tree, DTensor):
        return Deferred(lambda t=tree: gather(t), tuple(tree.shape), tree.dtype)
    if isinstance(tree, dict):
        return {k: _whole_on_rank0(rank, v) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):
        return type(tree)(_whole_on_rank0(rank, v) for v in tree)
    return tree


def model_state(model: nn.Module, rank: int) -> dict[str, Any]:
    """The whole ``state_dict``, each sharded tensor Deferred (whole on rank 0 when fetched)."""
    _reshard(model)
    return _whole_on_rank0(rank, model.state_dict())  # type: ignore[no-any-return]


def optimizer_state(model: nn.Module, optimizer: torch.optim.Optimizer, rank: int) -> dict[str, Any]:
    """The whole optimizer ``state_dict`` in ``torch.optim``'s layout (by parameter index),
    each sharded tensor Deferred."""
    _reshard(model)
    return _whole_on_rank0(rank, optimizer.state_dict())  # type: ignore[no-any-return]


def _rows(like: Any, shape: tuple[int, ...], size: int) -> int | None:
    """Rows of each rank's part of a tensor of ``shape`` where ``like`` is a DTensor of that
    shape sharded on dim 0 over ``size`` ranks (``torch.chunk``'s split, as FSDP2's: the last
    parts may be shorter or empty); else ``None`` (the tensor is sent whole). The one decision
    both the sending (:func:`_part`) and the state built from it (:func:`_as_like`) follow."""
    from torch.distributed.tensor import DTensor, Shard

    if not isinstance(like, DTensor) or size == 1 or len(like.placements) != 1 \
            or like.placements[0] != Shard(0) or like.dim() == 0 or tuple(shape) != tuple(like.shape):
        return None
    return -(-like.shape[0] // size)


def _part(comm: Communicator, whole: torch.Tensor | None, shape: tuple[int, ...], dtype: torch.dtype,
          like: Any, root: int) -> torch.Tensor:
    """Collective: this rank's part of ``root``'s ``whole`` (``None`` elsewhere; every rank
    knows its ``shape`` and ``dtype``). Where ``like`` is sharded on dim 0 and ``whole`` has its
    shape, each rank is sent only its own rows (``scatter``, each part padded to one size), so
    no other rank ever holds the tensor whole, and root sends each byte once; else every rank
    gets it whole (a broadcast)."""
    import torch.distributed as dist

    rows = _rows(like, shape, comm.size)
    if rows is None:
        out = whole.to(comm.device, dtype).contiguous() if comm.rank == root and whole is not None else \
            torch.empty(shape, dtype=dtype, device=comm.device)
        comm.start_broadcast_(out, root, "part")()
        return out
    out = torch.empty((rows, *shape[1:]), dtype=dtype, device=comm.device)
    pieces = None
    if comm.rank == root and whole is not None:
        whole = whole.to(comm.device, dtype).contiguous()
        pieces = []
        for r in range(comm.size):
            piece = whole[r * rows:(r + 1) * rows]
            if piece.shape[0] != rows:  # the last, shorter parts: padded to the scatter's one size
                piece = torch.cat([piece, piece.new_zeros((rows - piece.shape[0], *shape[1:]))])
            pieces.append(piece)
    dist.scatter(out, pieces, src=root)
    start = min(comm.rank * rows, shape[0])
    return out[:max(0, min(rows, shape[0] - start))]


def _load_part(comm: Communicator, whole: torch.Tensor | None, target: Any, root: int) -> None:
    """Collective: ``target`` (a model's tensor, sharded or not) overwritten with its part of
    ``root``'s ``whole``."""
    from torch.distributed.tensor import DTensor

    part = _part(comm, whole, tuple(target.shape), target.dtype, target, root)
    local = target.to_local() if isinstance(target, DTensor) else target
    if tuple(local.shape) != tuple(part.shape):
        raise HvdkitError(f"--shard full: this rank's part has shape {tuple(part.shape)}, its shard "
                          f"{tuple(local.shape)}", "report this: FSDP2 split the tensor in an unexpected way")
    local.copy_(part)


def _as_like(part: torch.Tensor, like: Any, shape: tuple[int, ...], into: Any = None) -> Any:
    """A received part as the state tensor it is: a DTensor shaped as ``like`` where ``like``
    is sharded and the part is its shard, else the (whole) tensor itself; copied into
    ``into`` (the state tensor held now) where that has its shape, dtype and placement."""
    from torch.distributed.tensor import DTensor

    sharded = isinstance(like, DTensor) and _rows(like, shape, like.device_mesh.size()) is not None
    if isinstance(into, DTensor) and sharded and into.shape == like.shape and into.placements == like.placements \
            and into.dtype == part.dtype and tuple(into.to_local().shape) == tuple(part.shape):
        into.to_local().copy_(part)
        return into
    if not isinstance(into, DTensor) and not sharded and isinstance(into, torch.Tensor) \
            and into.shape == part.shape and into.dtype == part.dtype and into.device == part.device:
        into.copy_(part)
        return into
    if sharded:
        return DTensor.from_local(part.clone(), like.device_mesh, like.placements, run_check=False,
                                  shape=like.shape, stride=like.stride())
    return part


def scatter_model_state(model: nn.Module, comm: Communicator, loaded: dict[str, Any] | None, root: int = 0) -> None:
    """Collective: every rank takes its shards of the state ``root`` ``loaded`` (a restore),
    one tensor at a time; without one, ``root``'s buffers (the parameters exist once already:
    they were rank 0's before sharding)."""
    is_root = comm.rank == root
    _reshard(model)
    own = model.state_dict()
    problem = loaded_mismatch({k: tuple(v.shape) for k, v in own.items()}, loaded) \
        if is_root and loaded is not None else None
    if is_root and loaded is None and root != 0:
        problem = (f"--shard full: every rank's parameters are rank 0's since wrap() (sharded, no rank holds "
                   f"another's whole model), so rank {root}'s can come only from a state loaded on rank {root}",
                   f"broadcast from root 0, or load the state on rank {root} before broadcasting from it")
    answer: Any = comm.broadcast_object((loaded is not None, problem) if is_root else None, root)
    holds, problem = answer
    if problem:
        raise HvdkitError(*problem)
    if not holds:
        broadcast_tensors(comm, model.named_buffers(), root)
        return
    with torch.no_grad():
        for name, target in own.items():
            value = loaded[name] if is_root and loaded is not None else None
            _load_part(comm, value.read() if isinstance(value, Stored) else value, target, root)
            del value


def scatter_optimizer_state(model: nn.Module, optimizer: torch.optim.Optimizer, comm: Communicator,
                            loaded: dict[str, Any] | None, root: int = 0) -> None:
    """Collective: every rank takes its shards of the optimizer state ``root`` ``loaded`` (a
    resume), one tensor at a time; nothing when it holds none (a fresh optimizer has no state
    to agree on)."""
    _reshard(model)
    params = [p for g in optimizer.param_groups for p in g["params"]]
    held = held_state(optimizer)["state"]  # read into where it is held: never the state twice

    def take(i: int, key: str, whole: torch.Tensor | None, spec: tuple[Any, ...]) -> Any:
        part = _part(comm, whole, spec[1], spec[2], params[i], root)
        return _as_like(part, params[i], spec[1], held.get(i, {}).get(key))

    scatter_optimizer(comm, optimizer, loaded, root, take)


class FullyShardedStrategy(Strategy):
    """``--shard full``: FSDP2 units; whole states gathered on rank 0 and scattered from it.
    FSDP2 runs its own collectives on torch.distributed's default group: the communicator
    serves only the broadcasts around it (the traits allow this mode on DDP alone)."""

    shard = "full"
    replicates_parameters = False  # "identical on every rank" holds by construction
    comm_wait_measured = False     # FSDP2 waits inside backward: not told apart from compute

    def __init__(self, comm: Communicator) -> None:
        super().__init__(comm)
        self.model: nn.Module | None = None
        # what rank 0 read in a restore, until the broadcast that follows scatters it; a
        # weak map so that a model or optimizer that is gone takes what it held with it
        self._loaded: weakref.WeakKeyDictionary[Any, dict[str, Any]] = weakref.WeakKeyDictionary()

    def wrap(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> tuple[nn.Module, torch.optim.Optimizer]:
        # rank 0's whole weights first: once sharded, a "whole model" is every rank's part
        # of its own initialisation, and no rank holds rank 0's any more
        broadcast_tensors(self.comm, model.state_dict().items(), 0)
        carried = optimizer.state_dict() if optimizer.state else None  # a restore before the wrap
        self.model, rebuilt = shard_model(model, optimizer)
        if carried is not None:  # the rebuilt optimizer starts empty: the broadcast scatters root's
            self._loaded[rebuilt] = carried
        return self.model, rebuilt

    def wrap_meta(self, model: nn.Module, optimizer: torch.optim.Optimizer,
                  init: MetaInit) -> tuple[nn.Module, torch.optim.Optimizer]:
        # sharded while still on meta, then made: rank 0 initialises one module at a time
        # and each rank keeps its shard of what it sends (make_sharded)
        self.model, rebuilt = shard_model(model, optimizer)
        make_sharded(self.model, self.comm, init)
        return self.model, rebuilt

    def close(self) -> None:
        """Let go of the model, and make its device mesh let go of the process group: DTensor's
        sharding caches keep every mesh they saw for the life of the process, and a mesh keeps
        its group's connections open (a failed rank then waits in MPI_Finalize with them open,
        and its peers never hear that it failed)."""
        from torch.distributed.tensor import DTensor

        if self.model is not None:
            for mesh in {p.device_mesh for p in self.model.parameters() if isinstance(p, DTensor)}:
                getattr(mesh, "_pg_registry", {}).clear()  # torch 2.13's; the caches hold the mesh only
        self.model = None
        self._loaded.clear()

    def _model(self) -> nn.Module:
        assert self.model is not None, "wrap() comes first"
        return self.model

    def accumulate(self, model: nn.Module, sync: bool) -> contextlib.AbstractContextManager[None]:
        model.set_requires_gradient_sync(sync)  # type: ignore[operator]  # FSDP2 reduce-scatters in backward unless told not to
        return contextlib.nullcontext()

    def module_state_dict(self, model: nn.Module) -> dict[str, Any]:
        return model_state(model, self.comm.rank)

    def replica_state_dict(self, model: nn.Module) -> dict[str, Any]:
        # whole on rank 0 only, one tensor at a time: a whole model anywhere is what sharding saves
        return model_state(model, self.comm.rank)

    def load_module_state_dict(self, model: nn.Module, state: dict[str, Any]) -> None:
        self._loaded[model] = state  # rank 0 alone: scattered by broadcast_state

    def optimizer_state_dict(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        return optimizer_state(self._model(), optimizer, self.comm.rank)

    def load_optimizer_state_dict(self, optimizer: torch.optim.Optimizer, state: dict[str, Any]) -> None:
        self._loaded[optimizer] = state

    def broadcast_state(self, model: nn.Module, optimizer: torch.optim.Optimizer | None, root: int) -> None:
        scatter_model_state(model, self.comm, self._loaded.pop(model, None), root)
        if optimizer is not None:
            self.broadcast_optimizer(optimizer, root)

    def broadcast_optimizer(self, optimizer: torch.optim.Optimizer, root: int) -> None:
        scatter_optimizer_state(self._model(), optimizer, self.comm, self._loaded.pop(optimizer, None), root)

    def held(self, model: nn.Module,
             optimizer: torch.optim.Optimizer) -> tuple[list[torch.Tensor], list[torch.Tensor], list[Any]]:
        """Each rank's local shards (of DTensors) of its parameters, gradients and optimizer state."""
        from torch.distributed.tensor import DTensor

        def local(items: list[Any]) -> list[Any]:
            return [t.to_local() if isinstance(t, DTensor) else t for t in items]

        return tuple(local(items) for items in super().held(model, optimizer))  # type: ignore[return-value]

    def eval_batches(self, loader: Iterable[Any], shard: Sized) -> Iterator[tuple[Any, int]]:
        return collective_eval_batches(self.comm, loader, "FSDP's")
