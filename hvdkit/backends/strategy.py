"""How the model and optimizer are spread over the ranks: one :class:`Strategy`, chosen once.

A strategy owns everything that depends on how the state is spread: wrapping the model and
optimizer, the micro-batch context, the optimizer step, the whole state for a checkpoint
(gathered where sharded), loading it, the broadcast that scatters it, evaluation batches and
the memory report. It talks to the other ranks only through a
:class:`~hvdkit.backends.comm.Communicator`. The modes (``--shard``):

* replicated (``none``): every rank holds everything. :class:`Replicated` is its plain form,
  for a communicator without a reducer of its own (the single-process backend); each backend
  with one supplies its subclass (``DDPReplicated`` in ``ddp.py``, ``HorovodReplicated`` in
  ``horovod.py``), which owns that reducer, its compression and its quirks.
* ``optimizer``: ZeRO-1/2 on any communicator (:mod:`hvdkit.backends.zero`).
* ``full``: FSDP2 (:mod:`hvdkit.backends.fsdp`).

:mod:`hvdkit.backends.modes` holds which class serves which ``--shard``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator, Sized
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from ..h5tree import Stored, materialize, materialize_into
from .comm import Communicator, broadcast_tensors, broadcast_tree, state_tensors
from .powersgd import STATE_KEY as POWERSGD_KEY
from .powersgd import PowerSGD, apply_state, gather_state

if TYPE_CHECKING:
    from ..materialise import MetaInit

__all__ = ["Strategy", "Replicated", "local_step", "clip_gradients", "same_optimizer", "regrouped",
           "load_module_tensors", "collective_eval_batches", "loaded_mismatch", "state_spec", "scatter_optimizer"]


def load_module_tensors(module: nn.Module, state: dict[str, Any]) -> None:
    """``module.load_state_dict(state)``, strictly, one tensor at a time: a :class:`Stored`
    leaf (a tensor still in an open checkpoint) is read, copied in place and dropped, so a
    load needs no second copy of the model."""
    own = module.state_dict()
    missing, unexpected = sorted(own.keys() - state.keys()), sorted(state.keys() - own.keys())
    if missing or unexpected:
        raise RuntimeError(f"Error(s) in loading state_dict for {type(module).__name__}: "
                           + "; ".join(f"{what} key(s): {', '.join(keys[:5])}{' ...' if len(keys) > 5 else ''}"
                                       for what, keys in (("Missing", missing), ("Unexpected", unexpected)) if keys))
    rest = {}
    with torch.no_grad():
        for name, target in own.items():
            value = state[name]
            value = value.read_into(target) if isinstance(value, Stored) else value
            if value is target:  # read straight into it
                continue
            if not isinstance(target, torch.Tensor) or not isinstance(value, torch.Tensor):
                rest[name] = value  # a module's extra state: its own loader takes it
                continue
            if value.shape != target.shape:
                raise RuntimeError(f"Error(s) in loading state_dict for {type(module).__name__}: size mismatch for "
                                   f"{name}: copying a param with shape {tuple(value.shape)} from checkpoint, the "
                                   f"shape in current model is {tuple(target.shape)}")
            target.copy_(value)
    if rest:
        module.load_state_dict(rest, strict=False)


def same_optimizer(optimizer: torch.optim.Optimizer, groups: list[dict[str, Any]]) -> torch.optim.Optimizer:
    """A new optimizer of ``optimizer``'s class and defaults over other parameter ``groups``
    (defaults that its constructor does not take, such as AdamW's derived flags, are left to
    it)."""
    import inspect

    takes = inspect.signature(type(optimizer).__init__).parameters
    anything = any(p.kind is p.VAR_KEYWORD for p in takes.values())
    kwargs = {k: v for k, v in optimizer.defaults.items() if anything or k in takes}
    return type(optimizer)(groups, **kwargs)


def regrouped(optimizer: torch.optim.Optimizer, model: nn.Module,
              make: Callable[[], None]) -> torch.optim.Optimizer:
    """``make()`` replaces ``model``'s parameters with new objects (sharding, making a meta-built
    model); then a new optimizer like ``optimizer`` (same groups and hyper-parameters) over them,
    each parameter found again by its name."""
    names = {id(p): n for n, p in model.named_parameters()}
    groups = [([names[id(p)] for p in g["params"]], {k: v for k, v in g.items() if k != "params"})
              for g in optimizer.param_groups]
    make()
    params = dict(model.named_parameters())
    return same_optimizer(optimizer, [{**hyper, "params": [params[n] for n in group]} for group, hyper in groups])


def clip_gradients(optimizer: torch.optim.Optimizer, max_norm: float) -> torch.Tensor:
    """``clip_grad_norm_`` over every parameter the optimizer updates; returns the norm before."""
    params = [p for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
    return torch.nn.utils.clip_grad_norm_(params, max_norm)


def local_step(optimizer: torch.optim.Optimizer, scaler: torch.amp.GradScaler | None,
               clip_grad_norm: float | None) -> None:
    """Unscale (fp16 ``scaler``), clip to ``clip_grad_norm``, step: for gradients that are
    already reduced."""
    if clip_grad_norm:
        if scaler is not None:
            scaler.unscale_(optimizer)
        clip_gradients(optimizer, clip_grad_norm)
    if scaler is None:
        optimizer.step()
        return
    scaler.step(optimizer)
    scaler.update()


def held_state(optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """The state tensors ``optimizer`` holds now, where its ``state_dict()`` puts them (by
    parameter index): what a load can be read into. Not ``state_dict()`` itself, which is
    collective for a sharded optimizer and a load may run on one rank alone."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    return {"state": {i: optimizer.state[p] for i, p in enumerate(params) if p in optimizer.state}}


def collective_eval_batches(comm: Communicator, loader: Iterable[Any], what: str) -> Iterator[tuple[Any, int]]:
    """Evaluation batches where the forward is collective (a sharded model gathers each unit):
    a rank with fewer batches runs its first one again with weight 0, until every rank has run
    as many, so every sample still counts exactly once."""
    mine = len(loader)  # type: ignore[arg-type]
    most = int(comm.allreduce_metric(float(mine), "max"))
    first = None
    for batch in loader:
        first = batch if first is None else first
        yield batch, 1
    for _ in range(most - mine):
        if first is None:
            from ..errors import HvdkitError

            raise HvdkitError(f"a rank has no validation batch to keep {what} collective forward in step with the "
                              "others", "use at least one validation sample per rank")
        yield first, 0


def loaded_mismatch(shapes: dict[str, tuple[int, ...]], loaded: dict[str, Any]) -> tuple[str, str] | None:
    """Why a loaded model state does not fit a model whose tensors have ``shapes`` (message, hint), or None."""
    hint = "restore into the model the checkpoint was written from"
    if set(loaded) != set(shapes):
        missing, extra = sorted(set(shapes) - set(loaded)), sorted(set(loaded) - set(shapes))
        return f"the checkpoint's model does not match: missing {missing[:5]}, unexpected {extra[:5]}", hint
    wrong = [f"{k} {tuple(v.shape)} (the model's {shapes[k]})" for k, v in loaded.items()
             if hasattr(v, "shape") and tuple(v.shape) != shapes[k]]
    if wrong:
        return f"the checkpoint's model does not match: {', '.join(wrong[:3])}", hint
    return None


def state_spec(value: Any) -> tuple[Any, ...]:
    """An optimizer state entry as others need it before its bytes: ("tensor", shape, dtype),
    ("value", the value itself), or ("tree",) for a nesting that holds tensors."""
    from ..h5tree import tree_leaves

    if isinstance(value, Stored):
        return "tensor", value.shape, value.dtype
    if isinstance(value, torch.Tensor):
        return "tensor", tuple(value.shape), value.dtype
    if any(True for _ in tree_leaves(value)):
        return ("tree",)
    return "value", value


def scatter_optimizer(comm: Communicator, optimizer: torch.optim.Optimizer, loaded: dict[str, Any] | None,
                      root: int, take: Callable[[int, str, Any, tuple[Any, ...]], Any]) -> None:
    """Collective: every rank loads its part of the optimizer state ``root`` ``loaded`` (a
    resume into a sharded model), one tensor at a time; nothing when root holds none. Each
    entry's shape and dtype (from the file's metadata: nothing read yet), or its value, go first
    in one object; then each tensor entry is ``take(index, key, root's tensor or None, spec)``,
    a collective that returns this rank's part. A nested entry (an optimizer of one's own) is
    sent whole."""
    is_root = comm.rank == root
    if not comm.broadcast_object(is_root and loaded is not None, root):
        return
    assert loaded is not None or not is_root
    groups = comm.broadcast_object(materialize(loaded["param_groups"]) if is_root and loaded else None, root)
    specs: Any = comm.broadcast_object({int(i): {k: state_spec(v) for k, v in entry.items()}
                                        for i, entry in loaded["state"].items()}
                                       if is_root and loaded is not None else None, root)
    state: dict[int, dict[str, Any]] = {}
    with torch.no_grad():
        for i, entry_specs in specs.items():
            entry = loaded["state"].get(i, loaded["state"].get(str(i))) if is_root and loaded is not None else None
            state[i] = {}
            for key, spec in entry_specs.items():
                value = entry[key] if entry is not None else None
                if spec[0] == "value":
                    state[i][key] = spec[1]
                elif spec[0] == "tree":
                    state[i][key] = broadcast_tree(comm, materialize(value) if is_root else None, root)
                else:
                    state[i][key] = take(i, key, value.read() if isinstance(value, Stored) else value, spec)
                del value
    optimizer.load_state_dict({"state": state, "param_groups": groups})


class Strategy:
    """The interface, and what a replicated model does where a mode does not say otherwise."""

    shard = "none"                 # BackendConfig.shard's value for this strategy
    replicates_parameters = True   # False: each rank holds part of the parameters (FSDP)
    comm_wait_measured = True      # False: the gradient wait cannot be told from compute

    def __init__(self, comm: Communicator) -> None:
        self.comm = comm

    # -- training -------------------------------------------------------------------------
    def wrap(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> tuple[nn.Module, torch.optim.Optimizer]:
        """``model`` is on the device already; make its gradients data-parallel."""
        return model, optimizer

    def wrap_meta(self, model: nn.Module, optimizer: torch.optim.Optimizer,
                  init: MetaInit) -> tuple[nn.Module, torch.optim.Optimizer]:
        """:meth:`wrap` for a model built on the meta device (:mod:`hvdkit.materialise`): here
        made whole on every rank, module by module (each rank holds the whole model anyway;
        the broadcast that follows every start makes it rank 0's)."""
        optimizer = regrouped(optimizer, model, lambda: init.apply_whole(model))
        return self.wrap(model.to(self.comm.device), optimizer)

    def unwrap(self, model: nn.Module) -> nn.Module:
        """The plain module inside what :meth:`wrap` returned (for ``state_dict``)."""
        return model

    def accumulate(self, model: nn.Module, sync: bool) -> contextlib.AbstractContextManager[None]:
        """Context for one micro-batch's backward; ``sync=False`` skips communication."""
        return contextlib.nullcontext()

    def optimizer_step(self, optimizer: torch.optim.Optimizer, scaler: torch.amp.GradScaler | None,
                       clip_grad_norm: float | None) -> float:
        """Apply the reduced gradients (unscale, clip, step); returns the seconds this step waited
        for communication that compute did not hide."""
        local_step(optimizer, scaler, clip_grad_norm)
        return 0.0

    def join(self, model: nn.Module) -> contextlib.AbstractContextManager[None]:
        """Around a loop in which ranks take different numbers of steps (see ``Backend.join``)."""
        return contextlib.nullcontext()

    def reset(self) -> None:
        """The world was re-formed (elastic): nothing in flight of the old one survives."""

    def close(self) -> None:
        """The communicator is going: drop whatever ties this strategy and the model to each
        other through hooks that Python's collector cannot see (they live in C++), so the model,
        and what it holds of the communicator, is freed with its holder's last reference."""

    # -- the whole state, for checkpoints and elastic commits ------------------------------
    # A state dict here may hold, where the state is sharded, Deferred leaves
    # (hvdkit.h5tree): a tensor gathered only when whoever consumes the dict fetches it, one
    # at a time, in tree order, on every rank (a checkpoint writer, the digest); and a state
    # being loaded may hold Stored leaves: tensors still in an open checkpoint file.
    def module_state_dict(self, model: nn.Module) -> dict[str, Any]:
        """The whole model's ``state_dict`` in its standard layout (sharded tensors Deferred)."""
        return self.unwrap(model).state_dict()

    def replica_state_dict(self, model: nn.Module) -> dict[str, Any]:
        """The whole model as this rank's replica holds it (where no rank holds one, Deferred:
        each tensor gathered when fetched, whole on rank 0 only)."""
        return self.unwrap(model).state_dict()

    def load_module_state_dict(self, model: nn.Module, state: dict[str, Any]) -> None:
        """Inverse of :meth:`module_state_dict` on this rank, one tensor at a time (where
        sharded, rank 0 holds it until :meth:`broadcast_state` scatters it)."""
        load_module_tensors(self.unwrap(model), state)

    def optimizer_state_dict(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        """The whole optimizer's ``state_dict`` in ``torch.optim``'s layout (sharded tensors Deferred)."""
        return optimizer.state_dict()

    def load_optimizer_state_dict(self, optimizer: torch.optim.Optimizer, state: dict[str, Any]) -> None:
        """Inverse of :meth:`optimizer_state_dict` on this rank: read tensor by tensor into the
        state the optimizer holds where it has one (else the tensors read become the state)."""
        optimizer.load_state_dict(materialize_into(state, held_state(optimizer)))

    def broadcast_state(self, model: nn.Module, optimizer: torch.optim.Optimizer | None, root: int) -> None:
        """Collective: every rank takes ``root``'s model and optimizer state. The optimizer
        first: Horovod's optimizer broadcast may take a zero-gradient step on a rank that had
        no state, and the parameters' broadcast must come after it."""
        if optimizer is not None:
            self.broadcast_optimizer(optimizer, root)
        broadcast_tensors(self.comm, self.unwrap(model).state_dict().items(), root)

    def broadcast_optimizer(self, optimizer: torch.optim.Optimizer, root: int) -> None:
        """Collective: every rank takes ``root``'s whole optimizer state, one tensor at a time."""
        state = broadcast_tree(self.comm, optimizer.state_dict() if self.comm.rank == root else None, root,
                               into=held_state(optimizer))  # received into the state held, if any
        if self.comm.rank != root:
            optimizer.load_state_dict(state)

    def sync_buffers(self, model: nn.Module, root: int = 0) -> None:
        """Every rank takes ``root``'s buffers (BatchNorm running statistics; see ``Backend.sync_buffers``)."""
        broadcast_tensors(self.comm, self.unwrap(model).named_buffers(), root)

    # -- evaluation and reports --------------------------------------------------------------
    def eval_module(self, model: nn.Module) -> nn.Module:
        """What held-out evaluation runs: the plain module (no gradient hooks, no collective)."""
        return self.unwrap(model)

    def eval_batches(self, loader: Iterable[Any], shard: Sized) -> Iterator[tuple[Any, int]]:
        """This rank's evaluation batches with their weight (1 each)."""
        for batch in loader:
            yield batch, 1

    def held(self, model: nn.Module,
             optimizer: torch.optim.Optimizer) -> tuple[list[torch.Tensor], list[torch.Tensor], list[Any]]:
        """What this rank holds between steps, for the memory report: its parameters, the
        gradients it keeps, and its optimizer state's tensors (each as this rank holds it)."""
        params: list[torch.Tensor] = list(self.unwrap(model).parameters())
        return params, [p for p in params if p.requires_grad], state_tensors(optimizer)

    def report(self) -> dict[str, Any]:
        """What this strategy has to say in the metrics file, by ``TrainResult`` field
        (``shard_overlap``: ZeRO's buckets; ``compression``: PowerSGD's settings and savings)."""
        return {}


class Replicated(Strategy):
    """``--shard none``: the interface's replicated defaults, plus what every replicated
    reducer with ``--compression powersgd`` shares: its state in the optimizer's checkpoint
    (every rank's error feedback gathered; the broadcast after a load gives each rank its own).
    As it is, the strategy of a communicator without a reducer of its own (one process); the
    backends' reducers subclass it."""

    def __init__(self, comm: Communicator) -> None:
        super().__init__(comm)
        self.powersgd: PowerSGD | None = None  # set by a subclass's wrap with --compression powersgd
        self._powersgd_loaded: dict[str, Any] | None = None  # rank 0's, between a load and the broadcast

    def optimizer_state_dict(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        state = optimizer.state_dict()
        return state if self.powersgd is None else {**state, POWERSGD_KEY: gather_state(self.comm, self.powersgd)}

    def load_optimizer_state_dict(self, optimizer: torch.optim.Optimizer, state: dict[str, Any]) -> None:
        state = dict(state)
        saved = materialize(state.pop(POWERSGD_KEY, None))
        optimizer.load_state_dict(materialize_into(state, held_state(optimizer)))
        if self.powersgd is not None:
            self._powersgd_loaded = saved  # None: saved without PowerSGD, which starts afresh
            apply_state(self.comm, self.powersgd, saved)

    def broadcast_optimizer(self, optimizer: torch.optim.Optimizer, root: int) -> None:
        self.broadcast_replicated_optimizer(optimizer, root)
        if self.powersgd is not None:  # what root loaded (and applied), each rank its own error feedback
            saved = self.comm.broadcast_object(self._powersgd_loaded if self.comm.rank == root else None, root)
            if self.comm.rank != root:
                apply_state(self.comm, self.powersgd, saved)
            self._powersgd_loaded = None

    def broadcast_replicated_optimizer(self, optimizer: torch.optim.Optimizer, root: int) -> None:
        """The optimizer's own state from ``root`` (a reducer with its own broadcast overrides it)."""
        super().broadcast_optimizer(optimizer, root)

    def report(self) -> dict[str, Any]:
        return {"compression": self.powersgd.report()} if self.powersgd is not None else {}
