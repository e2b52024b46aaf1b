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
broadcast that follows every restore sends one tensor at a time, each rank keeping its shard
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
from .comm import Communicator, broadcast_tensors, broadcast_tree
from .strategy import Strategy, regrouped

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
            whole = tensors[key].to(comm.device) if tensors is not None else \
                torch.empty(tuple(target.shape), dtype=target.dtype, device=comm.device)
            comm.start_broadcast_(whole, root, f"init.{key}")()
            target.copy_(_scattered(comm, whole, target))
            del whole

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


def _scattered(comm: Communicator, whole: torch.Tensor, like: Any) -> Any:
    """This rank's part of ``whole`` (on every rank) shaped as ``like``: a DTensor's shard, or
    the tensor itself."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    if isinstance(like, DTensor) and tuple(whole.shape) == tuple(like.shape):
        return distribute_tensor(whole.to(like.device), like.device_mesh, like.placements, src_data_rank=None)
    return whole


def scatter_model_state(model: nn.Module, comm: Communicator, loaded: dict[str, Any] | None, root: int = 0) -> None:
    """Collective: every rank takes its shards of the state ``root`` ``loaded`` (a restore),
    one tensor at a time; without one, ``root``'s buffers (the parameters exist once already:
    they were rank 0's before sharding)."""
    is_root = comm.rank == root
    _reshard(model)
    own = model.state_dict()
    problem: tuple[str, str] | None = None
    if is_root and loaded is not None and set(loaded) != set(own):
        missing, extra = sorted(set(own) - set(loaded)), sorted(set(loaded) - set(own))
        problem = (f"the checkpoint's model does not match: missing {missing[:5]}, unexpected {extra[:5]}",
                   "restore into the model the checkpoint was written from")
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
            whole = broadcast_tree(comm, value.read() if isinstance(value, Stored) else value, root)
            target.copy_(_scattered(comm, whole.to(target.dtype), target))
            del whole


def scatter_optimizer_state(model: nn.Module, optimizer: torch.optim.Optimizer, comm: Communicator,
                            loaded: dict[str, Any] | None, root: int = 0) -> None:
    """Collective: every rank takes its shards of the optimizer state ``root`` ``loaded`` (a
    resume), one tensor at a time; nothing when it holds none (a fresh optimizer has no state
    to agree on)."""
    is_root = comm.rank == root
    if not comm.broadcast_object(is_root and loaded is not None, root):
        return
    _reshard(model)
    params = [p for g in optimizer.param_groups for p in g["params"]]
    groups = comm.broadcast_object(loaded["param_groups"] if is_root and loaded is not None else None, root)
    keys: Any = comm.broadcast_object({int(i): list(entry) for i, entry in loaded["state"].items()}
                                      if is_root and loaded is not None else None, root)
    state: dict[int, dict[str, Any]] = {}
    with torch.no_grad():
        for i, names in keys.items():
            entry = loaded["state"].get(i, loaded["state"].get(str(i))) if is_root and loaded is not None else None
            state[i] = {}
            for key in names:
                value = entry[key] if entry is not None else None
                value = broadcast_tree(comm, value.read() if isinstance(value, Stored) else value, root)
                state[i][key] = _scattered(comm, value, params[i]) if isinstance(value, torch.Tensor) else value
    optimizer.load_state_dict({"state": state, "param_groups": groups})


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
        """FSDP2's forward is collective: a rank with fewer batches runs its first one again
        with weight 0, until every rank has run as many."""
        mine = len(loader)  # type: ignore[arg-type]
        most = int(self.comm.allreduce_metric(float(mine), "max"))
        first = None
        for batch in loader:
            first = batch if first is None else first
            yield batch, 1
        for _ in range(most - mine):
            if first is None:
                raise HvdkitError("a rank has no validation batch to keep FSDP's collective forward "
                                  "in step with the others", "use at least one validation sample per rank")
            yield first, 0
