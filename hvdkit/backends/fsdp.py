"""``--shard full`` on the DDP path: FSDP2 (``torch.distributed.fsdp.fully_shard``).

Each rank holds 1/N of every parameter, its gradient and its optimizer state; a unit's
parameters are all-gathered for its forward and backward and its gradients reduce-scattered.
Units: every block of every ``nn.ModuleList``/``nn.Sequential`` that holds at least
:data:`MIN_UNIT_PARAMS` parameters (transformer layers, ResNet stages' blocks), then the root
for the rest. Smaller blocks stay in their parent's unit: each unit costs an all-gather in
forward and in backward and a reduce-scatter, and on a model of 198 small tensors one unit per
layer measured 11.6x DDP's step time (2 ranks, gloo, ``hvdkit bench --paths "ddp shard=full"``). A model whose
parameters are shared between modules (tied embeddings) is sharded as one unit: FSDP2
cannot split one parameter between two units.

Checkpoints stay whole: :func:`full_model_state` and :func:`full_optimizer_state` gather
the state one tensor at a time onto rank 0's CPU (torch's ``get_*_state_dict`` with
``full_state_dict`` and ``cpu_offload``), the optimizer in ``torch.optim``'s own layout
(parameters by index, not by name), so a sharded run resumes unsharded and the other way
round, at any world size. Loading is the reverse: rank 0 *holds* what it read
(:meth:`FullyShardedStrategy.load_module_state_dict`), and the broadcast that follows
every restore scatters it (``broadcast_from_rank0``).
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterable, Iterator, Sized
from typing import Any

import torch
from torch import nn

from ..errors import HvdkitError
from .comm import Communicator, broadcast_tensors
from .strategy import Strategy, same_optimizer

__all__ = ["FullyShardedStrategy", "shard_model", "full_model_state", "full_optimizer_state",
           "scatter_model_state", "scatter_optimizer_state"]

MIN_UNIT_PARAMS = 100_000  # a block smaller than this is gathered with its parent


def _units(model: nn.Module) -> list[nn.Module]:
    """Sub-modules to shard on their own, children before parents (FSDP2 wants inner first)."""
    shared = len(list(model.named_parameters(remove_duplicate=False))) != len(list(model.parameters()))
    if shared:
        return []
    units = []
    for container in model.modules():
        if isinstance(container, (nn.ModuleList, nn.Sequential)):
            units += [m for m in container if sum(p.numel() for p in m.parameters()) >= MIN_UNIT_PARAMS]
    return list(reversed(list(dict.fromkeys(units))))


def shard_model(model: nn.Module, optimizer: torch.optim.Optimizer) -> tuple[nn.Module, torch.optim.Optimizer]:
    """Shard ``model`` in place and rebuild ``optimizer`` (same class, groups and
    hyper-parameters) over the sharded parameters, which are new objects."""
    from torch.distributed.fsdp import fully_shard

    names = {id(p): n for n, p in model.named_parameters()}
    groups = [([names[id(p)] for p in g["params"]], {k: v for k, v in g.items() if k != "params"})
              for g in optimizer.param_groups]
    for unit in _units(model):
        fully_shard(unit)
    fully_shard(model)
    params = dict(model.named_parameters())
    rebuilt = same_optimizer(optimizer, [{**hyper, "params": [params[n] for n in group]}
                                         for group, hyper in groups])
    return model, rebuilt


def _options(**kw: Any) -> Any:
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(full_state_dict=True, **kw)


def full_model_state(model: nn.Module) -> dict[str, Any]:
    """Collective: the whole ``state_dict`` on rank 0's CPU (``{}`` elsewhere)."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    return get_model_state_dict(model, options=_options(cpu_offload=True))


def _reshard(model: nn.Module) -> None:
    """Register every unit's sharded parameters again. A forward pass without backward (the
    data check, evaluation) leaves the root unit's parameters gathered, and registered in
    place of the sharded ones the optimizer steps: its parameters would then not be found
    in the model (a resume failed so) and a load would write into the gathered copies."""
    from torch.distributed.fsdp import FSDPModule

    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()


def _index_of(optimizer: torch.optim.Optimizer, model: nn.Module) -> dict[str, int]:
    """Parameter name -> its index in ``optimizer`` (the model resharded: see :func:`_reshard`)."""
    names = {id(p): n for n, p in model.named_parameters()}
    order = [names[id(p)] for g in optimizer.param_groups for p in g["params"]]
    return {name: i for i, name in enumerate(order)}


def full_optimizer_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """Collective: the whole optimizer ``state_dict`` on rank 0, keyed by parameter index as
    ``torch.optim`` keys it (``{}`` elsewhere)."""
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    _reshard(model)
    by_name: dict[str, Any] = get_optimizer_state_dict(model, optimizer, options=_options(cpu_offload=True))  # type: ignore[assignment]
    if not by_name:
        return {}
    index = _index_of(optimizer, model)
    return {"state": {index[n]: v for n, v in by_name["state"].items()},
            "param_groups": [{**g, "params": [index[n] for n in g["params"]]} for g in by_name["param_groups"]]}


def _only_rank0(root: int) -> None:
    """torch scatters a sharded model's state from rank 0 only (``broadcast_from_rank0``)."""
    if root != 0:
        raise ValueError(f"a sharded model's state is scattered from rank 0 only (torch's broadcast_from_rank0), "
                         f"not from rank {root}; HINT: load the checkpoint on rank 0")


def scatter_model_state(model: nn.Module, rank: int, loaded: dict[str, Any] | None, root: int = 0) -> None:
    """Collective: every rank takes its shards of the state rank 0 ``loaded`` (a restore), or of
    rank 0's current weights when it holds none (a fresh start: all begin from rank 0's)."""
    from torch.distributed.checkpoint.state_dict import set_model_state_dict

    _only_rank0(root)
    is_root = rank == root
    loaded = loaded if is_root else None
    _reshard(model)
    if not _root_holds(is_root, loaded):
        loaded = full_model_state(model)  # collective; whole on rank 0 only
    set_model_state_dict(model, loaded if is_root and loaded is not None else {},
                         options=_options(broadcast_from_rank0=True))


def _root_holds(is_root: bool, state: Any) -> bool:
    """Collective: does rank 0 hold a state to scatter?"""
    import torch.distributed as dist

    flag = [bool(is_root and state is not None)]
    dist.broadcast_object_list(flag, src=0)
    return bool(flag[0])


def scatter_optimizer_state(model: nn.Module, optimizer: torch.optim.Optimizer, rank: int,
                            loaded: dict[str, Any] | None, root: int = 0) -> None:
    """Collective: every rank takes its shards of the optimizer state rank 0 ``loaded`` (a
    resume); nothing when it holds none (a fresh optimizer has no state to agree on)."""
    from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict

    _only_rank0(root)
    is_root = rank == root
    loaded = loaded if is_root else None
    if not _root_holds(is_root, loaded):
        return
    _reshard(model)
    if is_root:
        names = {i: n for n, i in _index_of(optimizer, model).items()}
        state = {"state": {names[int(i)]: v for i, v in loaded["state"].items()},  # type: ignore[index]
                 "param_groups": [{**g, "params": [names[int(i)] for i in g["params"]]}
                                  for g in loaded["param_groups"]]}  # type: ignore[index]
    else:
        state = {}
    set_optimizer_state_dict(model, optimizer, state, options=_options(broadcast_from_rank0=True))  # type: ignore[arg-type]


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
        self.model, rebuilt = shard_model(model, optimizer)
        return self.model, rebuilt

    def _model(self) -> nn.Module:
        assert self.model is not None, "wrap() comes first"
        return self.model

    def accumulate(self, model: nn.Module, sync: bool) -> contextlib.AbstractContextManager[None]:
        model.set_requires_gradient_sync(sync)  # type: ignore[operator]  # FSDP2 reduce-scatters in backward unless told not to
        return contextlib.nullcontext()

    def module_state_dict(self, model: nn.Module) -> dict[str, Any]:
        return full_model_state(model)

    def replica_state_dict(self, model: nn.Module) -> dict[str, Any]:
        # whole on rank 0 only: gathering it on every rank would need the memory sharding saves
        return full_model_state(model)

    def load_module_state_dict(self, model: nn.Module, state: dict[str, Any]) -> None:
        self._loaded[model] = state  # rank 0 alone: scattered by broadcast_state

    def optimizer_state_dict(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        return full_optimizer_state(self._model(), optimizer)

    def load_optimizer_state_dict(self, optimizer: torch.optim.Optimizer, state: dict[str, Any]) -> None:
        self._loaded[optimizer] = state

    def broadcast_state(self, model: nn.Module, optimizer: torch.optim.Optimizer | None, root: int) -> None:
        scatter_model_state(model, self.comm.rank, self._loaded.pop(model, None), root)
        if optimizer is not None:
            self.broadcast_optimizer(optimizer, root)

    def broadcast_optimizer(self, optimizer: torch.optim.Optimizer, root: int) -> None:
        scatter_optimizer_state(self._model(), optimizer, self.comm.rank, self._loaded.pop(optimizer, None), root)

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
