"""``--shard full`` on any communicator's collectives: ZeRO-3 (Horovod's path; DDP's is FSDP2).

Horovod has no model sharding of its own; this builds it on the :class:`Communicator`'s
all-gather and reduce-scatter (``hvd.allgather``/``hvd.reducescatter`` on Horovod), as
DeepSpeed's ZeRO-3 does on NCCL:

* **Units** are FSDP2's (:func:`hvdkit.blocks.shard_units`): each block, then the root with the
  rest (tied parameters, an embedding and its head, included).
* Every parameter is split by **rows**, as FSDP2 splits it (``torch.chunk`` on dim 0: each rank
  ``ceil(rows / N)``, the last parts shorter or empty). A rank keeps its rows as a parameter of
  its own, the *shard*, and the optimizer (your class, your hyper-parameters) steps the shards:
  its state is 1/N of the model, each tensor laid out as FSDP2's local shard, so the two modes
  take the same elementwise steps.
* The model's own parameters stay registered (names, ``isinstance``, ties unchanged) but hold no
  data between uses: a unit's **forward pre-hook** all-gathers its shards (one collective per
  unit, every parameter's rows padded to one size) into them, with the next unit's gather
  started ahead (prefetch, in the order the first forward recorded); its forward hook frees
  them again. A hook on the unit's outputs gathers them again when backward reaches it (and an
  activation-checkpointed block recomputes inside that window).
* The one bucket engine (:mod:`hvdkit.backends.buckets`, one bucket per unit) counts the
  gradients: when the last of a unit's has been accumulated its gradients go out in one
  **reduce-scatter** (same layout), started while backward goes on with earlier units, and the
  whole gradients and parameters are freed at once (at most ``MAX_IN_FLIGHT`` in flight). The
  step waits for the reduce-scatters, clips by the global norm (squares summed over ranks),
  and steps the shards.
* ``--accumulation-steps``: the engine counts the passes; each pass frees the unit's
  parameters, the unit's whole gradients accumulate (as under FSDP2's
  ``set_requires_gradient_sync(False)``), and the last pass reduce-scatters their sum.

Memory per rank is about 16 bytes x P / N for fp32 AdamW, plus the units in flight (the one
computing and the one prefetched) and the root unit, which stays gathered from its forward to
the end of its backward (it is used at both ends: the embedding first, the head last).

Checkpoints hold the standard layout, as FSDP2's do: each tensor a
:class:`~hvdkit.h5tree.Deferred` gathered (rows from every rank) when the writer fetches it, whole
on rank 0 alone, one at a time. A load is the reverse: rank 0 holds what it read, and the
broadcast that follows sends one tensor at a time, each rank keeping its rows (Horovod has no
scatter: every rank briefly holds that one tensor whole).
"""

from __future__ import annotations

import functools
import math
import time
import weakref
from collections.abc import Iterable, Iterator, Sized
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from ..blocks import shard_units
from ..errors import HvdkitError
from ..h5tree import Deferred, Stored
from ..materialise import own_tensors
from .buckets import MAX_IN_FLIGHT, BucketEngine
from .comm import Communicator, Wait, broadcast_tensors
from .strategy import Strategy, collective_eval_batches, loaded_mismatch, same_optimizer, scatter_optimizer

if TYPE_CHECKING:
    from ..materialise import MetaInit

__all__ = ["Zero3Strategy", "ShardedUnit"]

_EMPTY: dict[tuple[torch.dtype, torch.device], torch.Tensor] = {}


def _empty(dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """What a freed parameter holds: no elements (one shared tensor per dtype and device)."""
    if (dtype, device) not in _EMPTY:
        _EMPTY[dtype, device] = torch.empty(0, dtype=dtype, device=device)
    return _EMPTY[dtype, device]


class _Layout:
    """One parameter's split by rows over ``size`` ranks, as FSDP2's: ``rows`` per rank (padded),
    this rank's real rows ``mine``, each row ``width`` elements (a 0-dim parameter is one row)."""

    def __init__(self, shape: tuple[int, ...], size: int, rank: int) -> None:
        self.shape = shape
        self.n = shape[0] if shape else 1
        self.width = math.prod(shape[1:]) if shape else 1
        self.rows = -(-self.n // size)
        self.start = min(rank * self.rows, self.n)
        self.mine = max(0, min(self.rows, self.n - self.start))
        self.segment = self.rows * self.width  # padded: the same on every rank

    @property
    def shard_shape(self) -> tuple[int, ...]:
        return (self.mine, *self.shape[1:]) if self.shape else (self.mine,)

    def own_rows(self, whole: torch.Tensor) -> torch.Tensor:
        """This rank's rows of ``whole`` (a tensor of :attr:`shape`)."""
        return whole.reshape(self.n, self.width)[self.start:self.start + self.mine].reshape(self.shard_shape)

    def padded(self, part: torch.Tensor) -> torch.Tensor:
        """``part`` (this rank's rows) flattened and padded to :attr:`segment` elements."""
        flat = part.reshape(-1)
        if flat.numel() == self.segment:
            return flat
        return torch.cat([flat, flat.new_zeros(self.segment - flat.numel())])

    def whole(self, gathered: torch.Tensor, size: int) -> torch.Tensor:
        """The tensor of :attr:`shape` from every rank's padded segment (``gathered``: (size, segment))."""
        return gathered.reshape(size * self.rows, self.width)[:self.n].reshape(self.shape)


class ShardedUnit:
    """One unit's parameters: the registered ones (data only while gathered), their layouts,
    this rank's shards (what the optimizer steps), and the collectives in flight."""

    def __init__(self, index: int, module: nn.Module, params: list[nn.Parameter], comm: Communicator) -> None:
        self.index, self.module, self.params, self.comm = index, module, params, comm
        scalar = [tuple(p.shape) for p in params if p.dim() == 0]
        if scalar:  # a moment of its shard and the optimizer's step would be told apart by shape alone
            raise HvdkitError(f"--shard full on this backend splits every parameter by rows, and "
                              f"{type(module).__name__} has a 0-dimensional one",
                              "make it a 1-element tensor (shape (1,)), or use --shard optimizer")
        dtypes = sorted({str(p.dtype) for p in params})
        if len(dtypes) > 1:  # one flat buffer per unit, as FSDP2's
            raise HvdkitError(f"--shard full gathers each unit in one buffer, and {type(module).__name__} holds "
                              f"parameters of {len(dtypes)} dtypes ({', '.join(dtypes)})",
                              "give its parameters one dtype (autocast handles mixed precision), or use --shard "
                              "optimizer")
        self.layouts = [_Layout(tuple(p.shape), comm.size, comm.rank) for p in params]
        self.width = sum(lay.segment for lay in self.layouts)  # each rank's padded part
        with torch.no_grad():  # a meta-built model's are made by Zero3Strategy.wrap_meta
            self.shards = [nn.Parameter(torch.empty(lay.shard_shape, dtype=p.dtype, device=comm.device) if p.is_meta
                                        else lay.own_rows(p.detach()).clone(), requires_grad=p.requires_grad)
                           for p, lay in zip(params, self.layouts)]
        self.gathered = False
        self.gathering: Wait | None = None  # a prefetch in flight
        self.armed = False                  # its outputs' hook will gather it for backward
        if not any(p.is_meta for p in params):  # a meta-built model's: once made (their shapes guide it)
            self.free()

    def start_gather(self) -> None:
        """Start the all-gather of every rank's shards (nothing if gathered or in flight)."""
        if self.gathered or self.gathering is not None or not self.params:
            return
        with torch.no_grad():
            flat = torch.cat([lay.padded(s.detach()) for s, lay in zip(self.shards, self.layouts)]) \
                if len(self.shards) > 1 else self.layouts[0].padded(self.shards[0].detach())
        self.gathering = self.comm.start_all_gather_flat(flat.contiguous(), f"z3.ag.{self.index}")

    def gather(self) -> None:
        """The parameters whole (waits for the all-gather, started here if it was not)."""
        if self.gathered or not self.params:
            return
        self.start_gather()
        assert self.gathering is not None
        every = self.gathering().view(self.comm.size, self.width)
        self.gathering = None
        at = 0
        with torch.no_grad():
            for p, lay in zip(self.params, self.layouts):
                p.data = lay.whole(every[:, at:at + lay.segment], self.comm.size)
                at += lay.segment
        self.gathered = True

    def free(self) -> None:
        """Drop the whole parameters (their storage goes with the last use)."""
        for p in self.params:
            p.data = _empty(p.dtype, self.comm.device)
        self.gathered = False

    def start_reduce(self) -> Wait:
        """Start the reduce-scatter of the whole gradients (zeros for one that got none), which
        are freed at once: the flat buffer is what travels. The returned wait (once; later
        calls return the same) gives each shard its part of the result as its gradient."""
        size = self.comm.size
        first = self.params[0]
        flat = torch.zeros(size, self.width, dtype=first.dtype, device=first.device)
        at = 0
        with torch.no_grad():
            for p, lay in zip(self.params, self.layouts):
                if p.grad is not None:
                    rows = p.grad.reshape(lay.n, lay.width)
                    for r in range(size):  # rank r's rows into its part (the padding stays zero)
                        mine = rows[r * lay.rows:(r + 1) * lay.rows].reshape(-1)
                        flat[r, at:at + mine.numel()].copy_(mine)
                at += lay.segment
        for p in self.params:
            p.grad = None
        wait = self.comm.start_reduce_scatter_mean(flat.view(-1), f"z3.rs.{self.index}")
        done: list[torch.Tensor] = []

        def finish() -> torch.Tensor:
            if not done:
                done.append(wait())
                at = 0
                for shard, lay in zip(self.shards, self.layouts):
                    if shard.requires_grad:
                        g = done[0][at:at + lay.mine * lay.width].view(lay.shard_shape)
                        shard.grad = g if shard.grad is None else shard.grad + g
                    at += lay.segment
            return done[0]

        return finish


def _tensors(tree: Any) -> Iterator[torch.Tensor]:
    if isinstance(tree, torch.Tensor):
        yield tree
    elif isinstance(tree, (list, tuple)):
        for v in tree:
            yield from _tensors(v)
    elif isinstance(tree, dict):
        for v in tree.values():
            yield from _tensors(v)


class Zero3Strategy(Strategy):
    """``--shard full`` on any communicator (the Horovod path): see the module's docstring."""

    shard = "full"
    replicates_parameters = False

    def __init__(self, comm: Communicator, backward_passes: int = 1) -> None:
        super().__init__(comm)
        self.backward_passes = backward_passes
        self.units: list[ShardedUnit] = []
        self.model: nn.Module | None = None
        self.order: list[ShardedUnit] = []   # forward order, recorded by the first forward
        self._recording = True
        self.engine: BucketEngine | None = None
        self._started: list[Wait] = []  # this step's reduce-scatters, in the order started
        self._handles: list[Any] = []
        self._shard_of: dict[int, tuple[ShardedUnit, int]] = {}  # id(registered parameter) -> where
        self._loaded: weakref.WeakKeyDictionary[Any, dict[str, Any]] = weakref.WeakKeyDictionary()

    # -- building ----------------------------------------------------------------------------
    def wrap(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> tuple[nn.Module, torch.optim.Optimizer]:
        # rank 0's whole weights first: once sharded, no rank holds another's whole model
        broadcast_tensors(self.comm, model.state_dict().items(), 0)
        carried = optimizer.state_dict() if optimizer.state else None  # a restore before the wrap
        rebuilt = self._build(model, optimizer)
        self._arm()
        if carried is not None:
            self._loaded[rebuilt] = carried
        return model, rebuilt

    def wrap_meta(self, model: nn.Module, optimizer: torch.optim.Optimizer,
                  init: MetaInit) -> tuple[nn.Module, torch.optim.Optimizer]:
        """Shard the model while it is on meta, then make it one module at a time: root makes a
        module's tensors whole and initialises them (``init``'s hook), sends each, and every
        rank keeps its rows of a parameter (a buffer whole). No rank holds more than one
        module's tensors whole, at any moment."""
        rebuilt = self._build(model, optimizer)
        root = 0
        with torch.no_grad():
            for module in model.modules():  # buffers whole on every rank (small), made below
                for key, b in module.named_buffers(recurse=False):
                    if b.is_meta:
                        module._buffers[key] = torch.empty_like(b, device=self.comm.device)

            def send(module: nn.Module, tensors: dict[str, torch.Tensor] | None) -> None:
                for _, key, target in own_tensors(module):
                    where = self._shard_of.get(id(target))
                    self._take(tensors[key] if tensors is not None else None, self._shape(target),
                               where[0].shards[where[1]] if where else target, where, root)

            if self.comm.rank == root:
                init.make(send)
            else:  # the others receive, module by module in the same order
                for _, module in init.order:
                    if any(True for _ in own_tensors(module)):
                        send(module, None)
        # the registered parameters leave the meta device, holding nothing (a meta tensor's data
        # cannot be swapped for a real one: new objects, one per shared parameter, ties kept)
        fresh: dict[int, nn.Parameter] = {}
        for module in model.modules():
            for key, p in list(module._parameters.items()):
                if p is not None and p.is_meta:
                    if id(p) not in fresh:
                        fresh[id(p)] = nn.Parameter(_empty(p.dtype, self.comm.device), requires_grad=p.requires_grad)
                    module._parameters[key] = fresh[id(p)]
        for unit in self.units:
            unit.params = [fresh.get(id(p), p) for p in unit.params]
            unit.gathered = False
        self._index_params()
        self._arm()
        return model, rebuilt

    def _build(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        """Units, their shards and forward hooks; the optimizer rebuilt over the shards."""
        self.model = model
        seen: set[int] = set()
        for index, module in enumerate([*shard_units(model), model]):
            params = [p for p in module.parameters() if id(p) not in seen]
            seen.update(id(p) for p in params)
            unit = ShardedUnit(index, module, params, self.comm)
            self.units.append(unit)
            self._handles += [module.register_forward_pre_hook(functools.partial(self._pre_forward, unit)),
                              module.register_forward_hook(functools.partial(self._post_forward, unit))]
        self._index_params()
        groups = [{**{k: v for k, v in g.items() if k != "params"},
                   "params": [self._shard_param(p) for p in g["params"]]} for g in optimizer.param_groups]
        return same_optimizer(optimizer, groups)

    def _index_params(self) -> None:
        self._shard_of = {id(p): (unit, k) for unit in self.units for k, p in enumerate(unit.params)}

    def _arm(self) -> None:
        """The one bucket engine over the registered parameters (once they are the final
        objects), one bucket per unit, in the order backward completes them (the blocks last
        to first, then the root): it counts their gradients and starts each unit's
        reduce-scatter, and tells when a unit's backward pass is over (its parameters freed)."""
        params = [p for unit in self.units for p in unit.params]
        plan, at = [], 0
        for unit in self.units:
            plan.append(list(range(at, at + len(unit.params))))
            at += len(unit.params)
        self.engine = BucketEngine(params, plan, self._start_reduce, self.backward_passes,
                                   on_pass=lambda b: self.units[b].free())

    def _shard_param(self, p: nn.Parameter) -> nn.Parameter:
        unit, k = self._shard_of[id(p)]
        return unit.shards[k]

    # -- the hooks -----------------------------------------------------------------------------
    def _pre_forward(self, unit: ShardedUnit, _module: nn.Module, _args: Any) -> None:
        if self._recording and unit not in self.order:
            self.order.append(unit)
        unit.start_gather()
        if not self._recording and unit in self.order:  # the next unit's gather travels meanwhile
            at = self.order.index(unit)
            if at + 1 < len(self.order):
                self.order[at + 1].start_gather()
        unit.gather()

    def _post_forward(self, unit: ShardedUnit, _module: nn.Module, _args: Any, output: Any) -> Any:
        root = unit is self.units[-1]
        if root:
            self._recording = False
        if not torch.is_grad_enabled():  # evaluation: nothing will come back for these
            unit.free()
            return output
        if root:  # used again at once by backward (its head first): kept gathered
            return output
        unit.free()
        unit.armed = False
        for t in _tensors(output):
            if t.requires_grad:
                t.register_hook(functools.partial(self._pre_backward, unit))
        return output

    def _pre_backward(self, unit: ShardedUnit, grad: torch.Tensor) -> None:
        if not unit.armed:
            unit.armed = True
            unit.start_gather()
            at = self.order.index(unit) if unit in self.order else -1
            if at > 0:  # backward goes the other way: the unit before it next
                self.order[at - 1].start_gather()
            unit.gather()

    def _start_reduce(self, b: int) -> Wait:
        """The engine's start for unit ``b``; the oldest reduce-scatter beyond
        :data:`~hvdkit.backends.buckets.MAX_IN_FLIGHT` is waited for here."""
        wait = self.units[b].start_reduce()
        self._started.append(wait)
        if len(self._started) > MAX_IN_FLIGHT:
            self._started[-1 - MAX_IN_FLIGHT]()
        return wait

    # -- training ------------------------------------------------------------------------------
    # accumulate: the default nullcontext; the engine counts backward passes itself

    def optimizer_step(self, optimizer: torch.optim.Optimizer, scaler: torch.amp.GradScaler | None,
                       clip_grad_norm: float | None) -> float:
        """Wait for the reduce-scatters (starting any unit's whose gradients did not all come),
        clip by the global norm, step the shards."""
        started = time.perf_counter()
        assert self.engine is not None, "wrap() comes first"
        self.engine.finish()  # every unit's shards get their gradients
        self._started.clear()
        waited = time.perf_counter() - started
        if clip_grad_norm:
            self._clip(optimizer, clip_grad_norm)
        optimizer.step()
        for unit in self.units:  # nothing gathered before the step may be used after it
            if unit.gathering is not None:
                unit.gathering()
                unit.gathering = None
            unit.free()
        return waited

    def _clip(self, optimizer: torch.optim.Optimizer, max_norm: float) -> torch.Tensor:
        grads = [p.grad for g in optimizer.param_groups for p in g["params"] if p.grad is not None]
        sq = torch.zeros((), dtype=torch.float64)
        for g in grads:
            sq += g.detach().double().pow(2).sum().cpu()
        total = math.sqrt(self.comm.allreduce_metric(sq, "sum"))
        coef = max_norm / (total + 1e-6)
        if coef < 1.0:
            for g in grads:
                g.mul_(coef)
        return torch.as_tensor(total)

    def reset(self) -> None:
        self._started.clear()
        if self.engine is not None:
            self.engine.reset(wait=False)
        for unit in self.units:
            unit.gathering = None

    def close(self) -> None:
        if self.engine is not None:
            self.engine.remove()
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        self.model = None
        self._loaded.clear()

    # -- the whole state -------------------------------------------------------------------------
    def _deferred(self, unit: ShardedUnit, k: int, part: torch.Tensor) -> Deferred:
        lay = unit.layouts[k]

        def fetch() -> torch.Tensor | None:
            every = self.comm.start_all_gather_flat(lay.padded(part.detach()).contiguous(),
                                                    f"z3.save.{unit.index}.{k}")()
            whole = lay.whole(every.view(self.comm.size, lay.segment), self.comm.size)
            return whole.detach().cpu() if self.comm.rank == 0 else None  # a view: the gather is this one copy

        return Deferred(fetch, lay.shape, part.dtype)

    def module_state_dict(self, model: nn.Module) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for name, t in model.state_dict(keep_vars=True).items():
            where = self._shard_of.get(id(t))
            out[name] = self._deferred(where[0], where[1], where[0].shards[where[1]]) if where else t
        return out

    def replica_state_dict(self, model: nn.Module) -> dict[str, Any]:
        return self.module_state_dict(model)

    def load_module_state_dict(self, model: nn.Module, state: dict[str, Any]) -> None:
        self._loaded[model] = state  # rank 0 alone: scattered by broadcast_state

    def _params(self, optimizer: torch.optim.Optimizer) -> list[tuple[ShardedUnit, int]]:
        where = {id(s): (u, k) for u in self.units for k, s in enumerate(u.shards)}
        return [where[id(p)] for g in optimizer.param_groups for p in g["params"]]

    def optimizer_state_dict(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        state = optimizer.state_dict()
        places = self._params(optimizer)
        out: dict[int, dict[str, Any]] = {}
        for i, entry in state["state"].items():
            unit, k = places[int(i)]
            shard = unit.shards[k]
            out[i] = {key: self._deferred(unit, k, v) if _is_rows(v, shard) else v for key, v in entry.items()}
        return {"state": out, "param_groups": state["param_groups"]}

    def load_optimizer_state_dict(self, optimizer: torch.optim.Optimizer, state: dict[str, Any]) -> None:
        self._loaded[optimizer] = state

    def broadcast_state(self, model: nn.Module, optimizer: torch.optim.Optimizer | None, root: int) -> None:
        loaded = self._loaded.pop(model, None)
        is_root = self.comm.rank == root
        own = model.state_dict(keep_vars=True)
        shapes = {n: self._shape(t) for n, t in own.items()}
        problem = loaded_mismatch(shapes, loaded) if is_root and loaded is not None else None
        answer: Any = self.comm.broadcast_object((loaded is not None, problem) if is_root else None, root)
        holds, problem = answer
        if problem:
            raise HvdkitError(*problem)
        if holds:
            with torch.no_grad():
                for name, t in own.items():
                    value = loaded[name] if is_root and loaded is not None else None
                    value = value.read() if isinstance(value, Stored) else value
                    where = self._shard_of.get(id(t))
                    target = where[0].shards[where[1]] if where else t
                    self._take(value, shapes[name], target, where, root)
                    del value
        elif root == 0:
            broadcast_tensors(self.comm, model.named_buffers(), root)
        else:
            raise HvdkitError(f"--shard full: every rank's parameters are rank 0's since wrap(), so rank {root}'s "
                              f"can come only from a state loaded on rank {root}",
                              f"broadcast from root 0, or load the state on rank {root} before broadcasting from it")
        if optimizer is not None:
            self.broadcast_optimizer(optimizer, root)

    def _shape(self, t: torch.Tensor) -> tuple[int, ...]:
        where = self._shard_of.get(id(t))
        return where[0].layouts[where[1]].shape if where else tuple(t.shape)

    def _take(self, whole: torch.Tensor | None, shape: tuple[int, ...], target: torch.Tensor,
              where: tuple[ShardedUnit, int] | None, root: int) -> None:
        """Collective: ``target`` (a shard, or a whole tensor) overwritten with its part of root's ``whole``."""
        buf = whole.to(self.comm.device, target.dtype).contiguous() if self.comm.rank == root and whole is not None \
            else torch.empty(shape, dtype=target.dtype, device=self.comm.device)
        self.comm.start_broadcast_(buf, root, "z3.load")()
        target.copy_(where[0].layouts[where[1]].own_rows(buf) if where else buf)

    def broadcast_optimizer(self, optimizer: torch.optim.Optimizer, root: int) -> None:
        places = self._params(optimizer)

        def take(i: int, _key: str, whole: torch.Tensor | None, spec: tuple[Any, ...]) -> torch.Tensor:
            unit, k = places[i]
            lay = unit.layouts[k]
            rows = tuple(spec[1]) == lay.shape  # a moment, laid out as its parameter; else whole
            out = torch.empty(lay.shard_shape if rows else spec[1], dtype=spec[2], device=self.comm.device)
            self._take(whole, tuple(spec[1]), out, (unit, k) if rows else None, root)
            return out

        scatter_optimizer(self.comm, optimizer, self._loaded.pop(optimizer, None), root, take)

    # -- evaluation and reports -------------------------------------------------------------------
    def eval_batches(self, loader: Iterable[Any], shard: Sized) -> Iterator[tuple[Any, int]]:
        return collective_eval_batches(self.comm, loader, "hvdkit's ZeRO-3")

    def held(self, model: nn.Module,
             optimizer: torch.optim.Optimizer) -> tuple[list[torch.Tensor], list[torch.Tensor], list[Any]]:
        """This rank's shards, the gradients it keeps (its shards'), and its optimizer state."""
        shards: list[torch.Tensor] = [s for u in self.units for s in u.shards]
        return shards, [s for s in shards if s.requires_grad], [v for s in optimizer.state.values() for v in s.values()]


def _is_rows(value: Any, shard: torch.Tensor) -> bool:
    """Whether an optimizer state tensor is laid out as its parameter's shard (a moment), not a
    scalar or anything else: the same answer on every rank (by dimensions, not by row count)."""
    return isinstance(value, torch.Tensor) and value.dim() == shard.dim() and value.dim() > 0 \
        and tuple(value.shape[1:]) == tuple(shard.shape[1:])
