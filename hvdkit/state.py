"""The state of a training run: a dict of named objects, captured, applied and broadcast one way.

A *states* dict maps names to what makes up a run, as in Lightning Fabric's ``save``/``load``
and torchtitan's ``states``::

    states = {"model": model, "optimizer": optimizer, "scheduler": scheduler,
              "sampler": sampler, "progress": progress, "seed": 17}

Each value is one of four kinds (:func:`kind_of`): a ``torch.nn.Module`` (possibly wrapped by
the backend), a ``torch.optim.Optimizer``, any other *Stateful* object (it has ``state_dict``
and ``load_state_dict``: schedulers, scalers, samplers, your own), or a plain value saved as it
is. The same three functions serve the checkpoint files (:mod:`hvdkit.checkpoint`) and
elastic training's host-memory commits (:mod:`hvdkit.elastic`), so there is one serialisation.
"""

from __future__ import annotations

import copy
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

if TYPE_CHECKING:
    from .backends.base import Backend

__all__ = ["Stateful", "kind_of", "kinds", "capture", "apply", "broadcast", "KINDS"]

KINDS = ("module", "optimizer", "stateful", "value")


@runtime_checkable
class Stateful(Protocol):
    """Anything with ``state_dict()`` and ``load_state_dict(state)``."""

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state_dict: dict[str, Any]) -> Any: ...


def kind_of(obj: Any) -> str:
    """``module``, ``optimizer``, ``stateful`` or ``value``."""
    import torch

    if isinstance(obj, torch.nn.Module):
        return "module"
    if isinstance(obj, torch.optim.Optimizer):
        return "optimizer"
    if isinstance(obj, Stateful):
        return "stateful"
    return "value"


def kinds(states: dict[str, Any]) -> dict[str, str]:
    """The kind of every state, by name (recorded in checkpoint files)."""
    return {key: kind_of(obj) for key, obj in states.items()}


def capture(states: dict[str, Any], backend: Backend, *, copy_: bool = False, lazy: bool = False) -> dict[str, Any]:
    """Every state as plain data (state dicts and values), as this rank holds it.

    Modules and optimizers go through the backend's strategy (``Strategy.module_state_dict``:
    the plain module inside a wrapper; a sharded one gathered, which makes this collective).
    ``lazy`` leaves a sharded tensor :class:`~hvdkit.h5tree.Deferred`, gathered only when a
    checkpoint writer fetches it (every rank fetches in one order); otherwise each is
    fetched now. ``copy_`` deep-copies the result, for a snapshot that training must not
    change (elastic commits).
    """
    from .h5tree import resolve

    out: dict[str, Any] = {}
    for key, obj in states.items():
        kind = kind_of(obj)
        if kind == "module":
            out[key] = backend.strategy.module_state_dict(obj)
        elif kind == "optimizer":
            out[key] = backend.strategy.optimizer_state_dict(obj)
        elif kind == "stateful":
            out[key] = obj.state_dict()
        else:
            out[key] = obj
    if not lazy:
        out = resolve(out)
    return copy.deepcopy(out) if copy_ else out


def apply(states: dict[str, Any], captured: dict[str, Any], backend: Backend,
          *, strict: bool = True) -> dict[str, Any]:
    """Load ``captured`` into ``states`` in place on this rank; returns what ``states`` did not name.

    Plain values are replaced in the ``states`` dict itself. With ``strict`` a state that
    ``captured`` lacks is an error naming it. ``captured`` may hold tensors still in an open
    checkpoint (:class:`~hvdkit.h5tree.Stored`): modules and optimizers read them one at a
    time; everything else is read whole (it is small).
    """
    from .errors import CheckpointError
    from .h5tree import materialize

    missing = [key for key in states if key not in captured]
    if strict and missing:
        raise CheckpointError(f"the checkpoint has no state {', '.join(map(repr, missing))} "
                              f"(it holds {', '.join(map(repr, captured)) or 'nothing'})",
                              "load with the names it was saved with, or pass strict=False")
    for key, obj in states.items():
        if key not in captured:
            continue
        kind = kind_of(obj)
        if kind == "module":
            backend.strategy.load_module_state_dict(obj, captured[key])
        elif kind == "optimizer":
            backend.strategy.load_optimizer_state_dict(obj, captured[key])
        elif kind == "stateful":
            obj.load_state_dict(materialize(captured[key]))
        else:
            states[key] = materialize(captured[key])
    return {key: materialize(value) for key, value in captured.items() if key not in states}


def broadcast(states: dict[str, Any], backend: Backend, root: int = 0) -> None:
    """Collective: every rank takes ``root``'s states.

    Optimizers first: Horovod's optimizer broadcast may take a zero-gradient step on a rank
    whose state was empty, and the parameters broadcast after it overwrite that step.
    """
    ordered = sorted(states, key=lambda k: {"optimizer": 0, "module": 1}.get(kind_of(states[k]), 2))
    for key in ordered:
        obj = states[key]
        kind = kind_of(obj)
        if kind == "optimizer":
            backend.strategy.broadcast_optimizer(obj, root)
        elif kind == "module":
            backend.strategy.broadcast_state(obj, None, root)
        elif kind == "stateful":
            value = backend.broadcast_object(obj.state_dict() if backend.rank == root else None, root)
            if backend.rank != root:
                obj.load_state_dict(value)
        else:
            states[key] = backend.broadcast_object(obj if backend.rank == root else None, root)
