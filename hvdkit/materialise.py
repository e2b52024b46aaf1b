"""Build a model without holding it whole: the factory runs on the meta device, and each module's
own tensors are made and initialised one module at a time (issue #43, "build without holding
the whole model anywhere").

A model opts in by defining ``hvdkit_init(self, name, module)`` on its root module: initialise
``module``'s *own* parameters and buffers (not its children's) in place. hvdkit calls it once per
module, in ``named_modules()`` order, from one seeded generator, on a copy of that module whose
own tensors are real (CPU) and whole. That is all the hook sees, so the bits it draws do not
depend on the world size, the sharding mode or the backend; the backend decides what happens to
each tensor afterwards: kept (replicated), or sent and cut to each rank's shard (``--shard
full``, where no rank ever holds more than one module's tensors whole).

Why a declared hook and not ``reset_parameters`` alone: most models re-initialise after
construction (GPT-2's normal(0.02), torchvision's kaiming for convolutions, zeroed BatchNorm
weights), and on the meta device those draws are no-ops that cannot be seen. Initialising such
a model by ``reset_parameters`` would silently change its initial distribution.

Only a factory that says it builds such a model (the class itself, or a function annotated to
return it) is called on meta; any other is called once, whole, as before. A model without the
hook is built exactly as before; one with the hook whose factory is not annotated, or fails on
meta (it makes CPU tensors itself, or reads a value), is built whole and then given the same
hook pass: the same bits as the meta path either way. :func:`build` says which path it took.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

__all__ = ["HOOK", "Built", "MetaInit", "build", "declared_class", "has_meta", "own_tensors"]

HOOK = "hvdkit_init"


def has_meta(model: nn.Module) -> bool:
    """Whether any of ``model``'s parameters or buffers is on the meta device (not made yet)."""
    return any(t.is_meta for t in (*model.parameters(), *model.buffers()))


def own_tensors(module: nn.Module) -> Iterator[tuple[str, str, torch.Tensor]]:
    """``(kind, key, tensor)`` for each parameter and buffer ``module`` holds itself."""
    for key, p in module.named_parameters(recurse=False):
        yield "param", key, p
    for key, b in module.named_buffers(recurse=False):
        yield "buffer", key, b


@dataclass
class MetaInit:
    """How to make a model that was built on the meta device: the root's hook, the seed, and the
    modules in the order the hook is called (taken at build time, before activation
    checkpointing or sharding wraps any of them)."""

    hook: Callable[[str, nn.Module], None]
    seed: int
    order: list[tuple[str, nn.Module]] = field(default_factory=list)

    def make(self, sink: Callable[[nn.Module, dict[str, torch.Tensor]], None]) -> None:
        """``sink(module, {key: tensor})`` for each module with tensors of its own, in order, once
        they are made whole on the CPU and initialised by the hook. A tensor two modules share
        (tied weights) is made once and given to both, so it ends as the last owner's hook left
        it, as on a real model. The sink runs under ``no_grad``; it must draw no random numbers
        (the hook's draws are one seeded sequence)."""
        last = {id(t): i for i, (_, module) in enumerate(self.order) for _, _, t in own_tensors(module)}
        made: dict[int, torch.Tensor] = {}  # only what a later module shares outlives its module
        with torch.random.fork_rng(devices=[]), torch.no_grad():
            torch.manual_seed(self.seed)
            for i, (name, module) in enumerate(self.order):
                own = list(own_tensors(module))
                if own:
                    self.hook(name, _shadow(module, own, made))
                    sink(module, {key: made[id(t)] for _, key, t in own})
                    for _, _, t in own:
                        if last[id(t)] == i:
                            made.pop(id(t), None)

    def apply_whole(self, model: nn.Module) -> None:
        """Make every tensor of the meta-built ``model`` in place (the replicated path): each
        parameter is a new ``nn.Parameter`` (shared ones stay shared), each buffer a tensor."""
        kept: dict[int, tuple[torch.Tensor, nn.Parameter]] = {}  # by the meta tensor, kept alive: ids stay unique

        def keep(module: nn.Module, tensors: dict[str, torch.Tensor]) -> None:
            for kind, key, t in list(own_tensors(module)):
                if kind == "param":
                    if id(t) not in kept:  # a shared parameter stays one object
                        kept[id(t)] = (t, nn.Parameter(tensors[key], requires_grad=t.requires_grad))
                    module._parameters[key] = kept[id(t)][1]
                else:
                    module._buffers[key] = tensors[key]

        self.make(keep)
        left = [n for n, t in (*model.named_parameters(), *model.named_buffers()) if t.is_meta]
        if left:  # a tensor no module in the order holds: the hook was never asked to make it
            from .errors import HvdkitError

            raise HvdkitError(f"{len(left)} tensor(s) are still on the meta device after {HOOK}: {left[:3]}",
                              "register every parameter and buffer on a module of the model")

    def rerun(self, model: nn.Module) -> None:
        """The hook pass over a model built whole (its factory was not tried on meta, or failed
        there): the same bits as :meth:`apply_whole` gives, written into its existing tensors."""
        def write(module: nn.Module, tensors: dict[str, torch.Tensor]) -> None:
            for _, key, t in own_tensors(module):
                t.copy_(tensors[key])

        self.make(write)


def _shadow(module: nn.Module, own: list[tuple[str, str, torch.Tensor]], made: dict[int, torch.Tensor]) -> nn.Module:
    """A copy of ``module`` (same class and attributes, so ``isinstance`` and ``module.weight``
    work in the hook) whose own tensors are real CPU tensors, shared through ``made``."""
    shadow = type(module).__new__(type(module))
    shadow.__dict__ = dict(module.__dict__)
    shadow._parameters, shadow._buffers = dict(module._parameters), dict(module._buffers)
    for kind, key, t in own:
        if id(t) not in made:
            whole = torch.empty(tuple(t.shape), dtype=t.dtype)  # a DTensor's shape is the whole one
            made[id(t)] = whole
        value = made[id(t)]
        if kind == "param":
            shadow._parameters[key] = nn.Parameter(value, requires_grad=t.requires_grad)  # shares value's storage
        else:
            shadow._buffers[key] = value
    return shadow


@dataclass
class Built:
    """What :func:`build` made: the model (on meta when ``init`` is set), and how, in words."""

    model: nn.Module
    init: MetaInit | None
    how: str
    declared: bool = False  # the model defines the hook (built on meta, or whole and then given the hook pass)


def declared_class(target: Any) -> type[nn.Module] | None:
    """The module class ``target`` (a model factory: a class, or a function) says it builds, when
    that class defines :data:`HOOK`: the class itself, or a function's return annotation."""
    cls = target
    if not isinstance(target, type):
        import typing

        try:
            cls = typing.get_type_hints(target).get("return")
        except Exception:  # an annotation that does not resolve says nothing
            return None
    if isinstance(cls, type) and issubclass(cls, nn.Module) and callable(getattr(cls, HOOK, None)):
        return cls
    return None


def build(factory: Callable[[], Any], seed: int, target: Any = None) -> Built:
    """Build a model by calling ``factory`` once, on the meta device when ``target`` (what the
    factory calls: a class, or a function annotated to return one) declares :data:`HOOK`;
    otherwise, or when it cannot be built there, whole on the CPU from ``seed``.

    Only a declared factory is tried on meta: any other is called once, as before (a factory
    may have side effects: a download, a log line, Python's own random numbers). A meta-built
    model comes back with its :class:`MetaInit` (the backend makes it: see ``Backend.wrap``);
    a whole-built model that has the hook has had the hook pass already, so the bits depend on
    the model and the seed alone, never on the path.
    """
    reason = f"its factory does not say it returns a model with {HOOK} (annotate its return type)"
    if declared_class(target) is not None:
        try:
            with torch.device("meta"):
                model = factory()
        except Exception as e:  # any failure on meta means: build it whole
            model, reason = None, f"its factory failed on the meta device ({type(e).__name__}: {str(e)[:120]})"
        if isinstance(model, nn.Module) and callable(getattr(model, HOOK, None)):
            if all(t.is_meta for t in (*model.parameters(), *model.buffers())):
                return Built(model, MetaInit(getattr(model, HOOK), seed, list(model.named_modules())),
                             f"built on the meta device; each module made and initialised by "
                             f"{type(model).__name__}.{HOOK}, one at a time", declared=True)
            reason = "its factory made some tensors off the meta device"
        elif model is not None:
            reason = f"it returned a {type(model).__name__} without {HOOK}"
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = factory()
    hook = getattr(model, HOOK, None) if isinstance(model, nn.Module) else None
    if not callable(hook):
        return Built(model, None, f"built whole on every rank: it defines no {HOOK}(name, module)")
    MetaInit(hook, seed, list(model.named_modules())).rerun(model)
    return Built(model, None, f"built whole on every rank: {reason}; then initialised by {HOOK} (the bits "
                              f"the meta path gives)", declared=True)
