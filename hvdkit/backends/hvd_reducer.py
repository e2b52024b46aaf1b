"""A bucketed gradient reducer on Horovod's own allreduce: DDP's bucketing, Horovod's ring.

Why: ``hvd.DistributedOptimizer`` starts one asynchronous allreduce per parameter from an
autograd hook and synchronizes them one by one. Horovod's C++ tensor fusion merges them on
the wire, but the Python work (a hook, a handle, a synchronize and a copy per tensor)
stays, and on a model of ~200 small tensors it made the stock optimizer 1.35-1.7x slower
than DDP here. This reducer keeps Horovod's collectives (ring, fusion buffer, compression
classes, pre/postscale) and sends *buckets*: a few flat buffers instead of hundreds of
tensors, started by hvdkit's one bucket engine (:mod:`hvdkit.backends.buckets`) as soon as
each is complete, so communication overlaps the rest of backward, as DDP's reducer does.
This module holds only what is Horovod's: the allreduce of one bucket, and the stock
optimizer's surface around it.

The semantics are the stock optimizer's, point by point: Average or Sum with
``gradient_predivide_factor`` split into pre- and postscale; compression applied per
buffer (elementwise, so the same as per tensor); ``backward_passes_per_step`` passes
accumulate locally and only the last one communicates; a parameter that got no gradient
this step is reduced as zeros (every rank submits every bucket, so nobody hangs and no
rank silently skips what another reduced); frozen parameters are left out; parameters of
every optimizer parameter group take part. Two deliberate differences, both the engine's:
a loop that runs more backward passes than it said gets the summed gradients re-sent (stock
asserts), and ``zero_grad()`` between backward and step (a skipped step) finishes and drops
the buckets in flight (stock asserts). Adasum and sparse gradients stay on the stock optimizer
(``--hvd-reducer stock``).
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import torch
from torch import nn

from ..sizes import nbytes
from .buckets import FIRST_BUCKET_BYTES, BucketEngine, plan_buckets
from .comm import Wait
from .powersgd import PowerSGD

__all__ = ["bucketed_optimizer", "plan_allreduce_buckets"]


def plan_allreduce_buckets(params: Sequence[torch.Tensor], cap_bytes: int) -> list[list[int]]:
    """The allreduce reducer's plan: DDP's small first bucket, and a parameter of 1 MiB or more
    alone (see :func:`~hvdkit.backends.buckets.plan_buckets`)."""
    return plan_buckets([nbytes([p]) for p in params], [(p.dtype, p.device) for p in params],
                        cap_bytes, first_cap_bytes=FIRST_BUCKET_BYTES, alone_bytes=FIRST_BUCKET_BYTES)


class _BucketedOptimizer(torch.optim.Optimizer):
    """Mixed into a dynamic subclass of the user's optimizer class (as Horovod does), so the
    result *is* an SGD/Adam/...: schedulers, ``state_dict`` and checkpoints keep working."""

    def __init__(self, params: Any, hvd: Any, named_parameters: Sequence[tuple[str, nn.Parameter]],
                 compression: Any, backward_passes_per_step: int, op: Any,
                 gradient_predivide_factor: float, bucket_cap_mb: float, powersgd: PowerSGD | None) -> None:
        super(self.__class__, self).__init__(params)  # type: ignore[misc,call-arg]
        self._hvd = hvd
        self._compression = compression
        self._powersgd = powersgd  # replaces the compression class: low-rank factors, not the buffer
        self.backward_passes_per_step = backward_passes_per_step
        self.op = op
        if op == hvd.Average:
            # as stock: the C++ side applies 1/size on top of the postscale factor
            self._prescale, self._postscale = 1.0 / gradient_predivide_factor, gradient_predivide_factor
        else:
            self._prescale = self._postscale = 1.0
        named = list(named_parameters)
        in_groups = {id(p) for g in self.param_groups for p in g["params"]}
        unnamed = in_groups - {id(p) for _, p in named}
        if unnamed:
            raise ValueError("the optimizer holds parameters that named_parameters does not name")
        # only what the optimizer updates and what is trainable is reduced (stock: _requires_update)
        self._reduced = [p for _, p in named if id(p) in in_groups and p.requires_grad]
        self._cap_bytes = int(bucket_cap_mb * 1024 * 1024)
        self._engine: BucketEngine | None = None
        self.rebuild_buckets()
        self._should_synchronize = True
        self._synchronized = False

    def rebuild_buckets(self) -> None:
        """(Re)plan buckets and reset all per-step state (also after an elastic reset, when no
        collective of the old ring can be waited for)."""
        if self._engine is not None:
            self._engine.remove()
        plan = plan_allreduce_buckets(self._reduced, self._cap_bytes)
        self._buffers = [torch.empty(sum(self._reduced[i].numel() for i in members),
                                     dtype=self._reduced[members[0]].dtype, device=self._reduced[members[0]].device)
                         for members in plan]
        self._views = []  # each bucket's parameters' gradients as views of its buffer (PowerSGD's matrices)
        for members, buf in zip(plan, self._buffers):
            sizes = [self._reduced[i].numel() for i in members]
            self._views.append([part.view_as(self._reduced[i]) for i, part in zip(members, buf.split(sizes))])
        self._engine = BucketEngine(self._reduced, plan, self._allreduce, self.backward_passes_per_step)

    def remove_hooks(self) -> None:
        """Stop watching the gradients and drop what is in flight (the optimizer is discarded)."""
        if self._engine is not None:
            self._engine.reset(wait=False)
            self._engine.remove()

    @property
    def buckets(self) -> list[tuple[int, ...]]:
        """The plan: indices into the reduced parameters, bucket by bucket."""
        assert self._engine is not None
        return self._engine.plan

    def _allreduce(self, b: int) -> Wait:
        """Copy bucket ``b``'s gradients into its flat buffer once and start its allreduce."""
        assert self._engine is not None
        buf, at = self._buffers[b], 0
        for i in self._engine.plan[b]:
            p = self._reduced[i]
            if p.grad is None:
                # got no gradient this step on this rank (another rank may have): reduce
                # zeros, as stock Horovod does, so every rank submits every bucket
                p.grad = torch.zeros_like(p)
            elif p.grad.is_sparse:
                raise RuntimeError("the bucketed Horovod reducer has no sparse gradients; "
                                   "use --hvd-reducer stock")
            buf[at:at + p.numel()].copy_(p.grad.reshape(-1))
            at += p.numel()
        if self._powersgd is not None:
            members = self._engine.plan[b]
            # the engine finishes buckets in plan order: Q's allreduces go out in that order too
            return self._powersgd.start(b, b == len(self._buffers) - 1, buf, self._views[b],
                                        [self._reduced[i] for i in members], self._allreduce_sum,
                                        self._hvd.size()).finish
        compressed, ctx = self._compression.compress(buf)
        handle = self._hvd.allreduce_async_(compressed, name=f"hvdkit.bucket.{b}", op=self.op,
                                            prescale_factor=self._prescale, postscale_factor=self._postscale)
        return lambda: self._compression.decompress(self._hvd.synchronize(handle), ctx)

    def _allreduce_sum(self, tensor: torch.Tensor, name: str) -> Wait:
        handle = self._hvd.allreduce_async_(tensor, name=name, op=self._hvd.Sum)
        return lambda: self._hvd.synchronize(handle)

    # -- the stock optimizer's public surface -------------------------------------------------
    def synchronize(self) -> None:
        """Start the buckets backward did not (missing gradients), wait for all, unflatten."""
        assert self._engine is not None
        for members, out in zip(self._engine.plan, self._engine.finish()):
            at = 0
            for i in members:
                p = self._reduced[i]
                p.grad.copy_(out[at:at + p.numel()].view_as(p))  # type: ignore[union-attr]  # set by _allreduce
                at += p.numel()
        self._synchronized = True

    @contextlib.contextmanager
    def skip_synchronize(self) -> Iterator[None]:
        """``optimizer.synchronize(); with optimizer.skip_synchronize(): optimizer.step()``."""
        self._should_synchronize = False
        try:
            yield
        finally:
            self._should_synchronize = True

    def step(self, closure: Any = None) -> Any:
        if self._should_synchronize:
            if self._synchronized:
                warnings.warn("optimizer.step() after optimizer.synchronize() without "
                              "skip_synchronize(): gradients are reduced twice", stacklevel=2)
            self.synchronize()
        self._synchronized = False
        return super(self.__class__, self).step(closure)  # type: ignore[misc]

    def zero_grad(self, set_to_none: bool = True) -> None:
        assert self._engine is not None
        self._engine.reset()  # a skipped step: finish and drop what is in flight
        return super(self.__class__, self).zero_grad(set_to_none)  # type: ignore[misc]

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        assert self._engine is not None
        self._engine.reset(wait=False)
        super(self.__class__, self).load_state_dict(state_dict)  # type: ignore[misc]


def bucketed_optimizer(hvd: Any, optimizer: torch.optim.Optimizer,
                       named_parameters: Iterable[tuple[str, nn.Parameter]], compression: Any,
                       backward_passes_per_step: int = 1, op: Any = None,
                       gradient_predivide_factor: float = 1.0,
                       bucket_cap_mb: float = 25.0, powersgd: PowerSGD | None = None) -> torch.optim.Optimizer:
    """Wrap ``optimizer`` like ``hvd.DistributedOptimizer`` does, reducing gradients in buckets
    (``powersgd``: compressed by :mod:`hvdkit.backends.powersgd` instead, with op Average)."""
    cls = type(optimizer.__class__.__name__, (optimizer.__class__,), dict(_BucketedOptimizer.__dict__))
    return cls(optimizer.param_groups, hvd, list(named_parameters), compression,  # type: ignore[call-arg]
               backward_passes_per_step, hvd.Average if op is None else op,
               gradient_predivide_factor, bucket_cap_mb, powersgd)
