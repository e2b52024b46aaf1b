"""A bucketed gradient reducer on Horovod's own allreduce: DDP's bucketing, Horovod's ring.

Why: ``hvd.DistributedOptimizer`` starts one asynchronous allreduce per parameter from an
autograd hook and synchronizes them one by one. Horovod's C++ tensor fusion merges them on
the wire, but the Python work (a hook, a handle, a synchronize and a copy per tensor)
stays, and on a model of ~200 small tensors it made the stock optimizer 1.35-1.7x slower
than DDP here. This reducer keeps Horovod's collectives (ring, fusion buffer, compression
classes, pre/postscale) and sends *buckets*: a few flat buffers instead of hundreds of
tensors, each started from the hooks as soon as its last gradient is ready, so
communication overlaps the rest of backward, as DDP's reducer does.

The semantics are the stock optimizer's, point by point: Average or Sum with
``gradient_predivide_factor`` split into pre- and postscale; compression applied per
buffer (elementwise, so the same as per tensor); ``backward_passes_per_step`` passes
accumulate locally and only the last one communicates; a parameter that got no gradient
this step is reduced as zeros (every rank submits every bucket, so nobody hangs and no
rank silently skips what another reduced); frozen parameters are left out; parameters of
every optimizer parameter group take part. Adasum and sparse gradients stay on the stock
optimizer (``--hvd-reducer stock``).
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

__all__ = ["Bucket", "plan_buckets", "bucketed_optimizer", "FIRST_BUCKET_BYTES"]

# DDP's first bucket is small (torch.distributed._DEFAULT_FIRST_BUCKET_BYTES, 1 MiB) so the
# first allreduce starts early in backward; the same here.
FIRST_BUCKET_BYTES = 1024 * 1024


@dataclass(frozen=True)
class Bucket:
    """Parameters reduced together in one flat buffer, in the order backward produces them."""

    index: int
    names: tuple[str, ...]
    numels: tuple[int, ...]
    dtype: torch.dtype

    @property
    def numel(self) -> int:
        return sum(self.numels)

    @property
    def nbytes(self) -> int:
        return self.numel * torch.empty((), dtype=self.dtype).element_size()

    @property
    def offsets(self) -> tuple[int, ...]:
        out, acc = [], 0
        for n in self.numels:
            out.append(acc)
            acc += n
        return tuple(out)


def plan_buckets(named_parameters: Iterable[tuple[str, torch.Tensor]], cap_bytes: int,
                 first_cap_bytes: int = FIRST_BUCKET_BYTES) -> list[Bucket]:
    """Group trainable parameters into buckets, the way DDP does.

    * Only parameters with ``requires_grad`` (frozen ones are never reduced).
    * In *reverse* order of registration: backward produces the last layer's gradients
      first, so the first bucket fills (and its allreduce starts) first.
    * A bucket is closed when adding the next parameter would pass its cap (``cap_bytes``;
      ``min(first_cap_bytes, cap_bytes)`` for the first bucket), and when the dtype changes
      (one flat buffer holds one dtype). No parameter is ever split.
    * Unlike DDP, a parameter of ``first_cap_bytes`` (1 MiB) or more always gets a bucket of
      its own: its size already amortises the per-message cost, and sharing a bucket would
      hold its allreduce back until the bucket's last gradient arrives. Measured on the CNN
      example (a 2 MiB linear weight whose bucket-mates were the conv layers, last in
      backward): without this the bucketed reducer was 6% slower than the stock optimizer.
    """
    if cap_bytes <= 0:
        raise ValueError(f"bucket cap must be > 0 bytes, got {cap_bytes}")
    trainable = [(n, p) for n, p in named_parameters if p.requires_grad]
    buckets: list[Bucket] = []
    names: list[str] = []
    numels: list[int] = []
    dtype: torch.dtype | None = None
    size = 0

    def close() -> None:
        nonlocal names, numels, size
        if names:
            assert dtype is not None
            buckets.append(Bucket(len(buckets), tuple(names), tuple(numels), dtype))
        names, numels, size = [], [], 0

    for name, p in reversed(trainable):
        nbytes = p.numel() * p.element_size()
        cap = min(first_cap_bytes, cap_bytes) if not buckets else cap_bytes
        alone = nbytes >= first_cap_bytes
        if names and (alone or p.dtype != dtype or size + nbytes > cap):
            close()
        dtype = p.dtype
        names.append(name)
        numels.append(p.numel())
        size += nbytes
        if alone:
            close()
    close()
    return buckets


class _BucketedOptimizer(torch.optim.Optimizer):
    """Mixed into a dynamic subclass of the user's optimizer class (as Horovod does), so the
    result *is* an SGD/Adam/...: schedulers, ``state_dict`` and checkpoints keep working."""

    def __init__(self, params: Any, hvd: Any, named_parameters: Sequence[tuple[str, nn.Parameter]],
                 compression: Any, backward_passes_per_step: int, op: Any,
                 gradient_predivide_factor: float, bucket_cap_mb: float) -> None:
        super(self.__class__, self).__init__(params)  # type: ignore[misc,call-arg]
        self._hvd = hvd
        self._compression = compression
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
        # only what the optimizer updates is reduced (stock: _requires_update)
        named = [(n, p) for n, p in named if id(p) in in_groups]
        self._params = {n: p for n, p in named}
        self._cap_bytes = int(bucket_cap_mb * 1024 * 1024)
        self._named = named
        self._hooks: list[Any] = []
        self.rebuild_buckets()
        self._should_synchronize = True
        self._synchronized = False

    # -- plan and hooks ---------------------------------------------------------------------
    def rebuild_buckets(self) -> None:
        """(Re)plan buckets and reset all per-step state (also after an elastic reset)."""
        for h in self._hooks:
            h.remove()
        self.buckets = plan_buckets(self._named, self._cap_bytes)
        self._bucket_of: dict[int, Bucket] = {}
        for b in self.buckets:
            for n in b.names:
                self._bucket_of[id(self._params[n])] = b
        self._buffers = [torch.empty(b.numel, dtype=b.dtype, device=self._params[b.names[0]].device)
                         for b in self.buckets]
        self._delay = {id(p): self.backward_passes_per_step for p in self._params.values()}
        self._waiting = [len(b.names) for b in self.buckets]
        self._handles: dict[int, tuple[Any, Any, torch.Tensor]] = {}
        # register_post_accumulate_grad_hook: runs once p.grad holds this pass's gradient
        self._hooks = [p.register_post_accumulate_grad_hook(self._hook)
                       for p in self._params.values() if p.requires_grad]

    def _hook(self, p: torch.Tensor) -> None:
        key = id(p)
        if self._delay[key] <= 0:
            raise AssertionError("gradients were computed more than backward_passes_per_step "
                                 "times before step(); raise --accumulation-steps")
        if p.grad is not None and p.grad.is_sparse:
            raise RuntimeError("the bucketed Horovod reducer has no sparse gradients; "
                               "use --hvd-reducer stock")
        self._delay[key] -= 1
        if self._delay[key] == 0:
            bucket = self._bucket_of[key]
            self._waiting[bucket.index] -= 1
            if self._waiting[bucket.index] == 0:
                self._launch(bucket)

    def _launch(self, bucket: Bucket) -> None:
        """Copy the bucket's gradients into its flat buffer once and start its allreduce."""
        buf = self._buffers[bucket.index]
        for name, off, n in zip(bucket.names, bucket.offsets, bucket.numels):
            p = self._params[name]
            if p.grad is None:
                # got no gradient this step on this rank (another rank may have): reduce
                # zeros, as stock Horovod does, so every rank submits every bucket
                p.grad = torch.zeros_like(p)
            buf[off:off + n].copy_(p.grad.reshape(-1))
        compressed, ctx = self._compression.compress(buf)
        handle = self._hvd.allreduce_async_(
            compressed, name=f"hvdkit.bucket.{bucket.index}", op=self.op,
            prescale_factor=self._prescale, postscale_factor=self._postscale)
        self._handles[bucket.index] = (handle, ctx, compressed)

    # -- the stock optimizer's public surface -------------------------------------------------
    def synchronize(self) -> None:
        """Start the buckets backward did not (missing gradients), wait for all, unflatten."""
        for bucket in self.buckets:
            if bucket.index not in self._handles:
                self._launch(bucket)
        for bucket in self.buckets:
            handle, ctx, compressed = self._handles[bucket.index]
            out = self._compression.decompress(self._hvd.synchronize(handle), ctx)
            for name, off, n in zip(bucket.names, bucket.offsets, bucket.numels):
                p = self._params[name]
                p.grad.copy_(out[off:off + n].view_as(p))  # type: ignore[union-attr]  # set by the hook
                self._delay[id(p)] = self.backward_passes_per_step
            self._waiting[bucket.index] = len(bucket.names)
        self._handles.clear()
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
        if self._handles:
            raise AssertionError("optimizer.zero_grad() between backward() and step(): "
                                 "gradient allreduces are still in flight")
        return super(self.__class__, self).zero_grad(set_to_none)  # type: ignore[misc]

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._handles.clear()
        self._delay = {k: self.backward_passes_per_step for k in self._delay}
        self._waiting = [len(b.names) for b in self.buckets]
        super(self.__class__, self).load_state_dict(state_dict)  # type: ignore[misc]


def bucketed_optimizer(hvd: Any, optimizer: torch.optim.Optimizer,
                       named_parameters: Iterable[tuple[str, nn.Parameter]], compression: Any,
                       backward_passes_per_step: int = 1, op: Any = None,
                       gradient_predivide_factor: float = 1.0,
                       bucket_cap_mb: float = 25.0) -> torch.optim.Optimizer:
    """Wrap ``optimizer`` like ``hvd.DistributedOptimizer`` does, reducing gradients in buckets."""
    cls = type(optimizer.__class__.__name__, (optimizer.__class__,), dict(_BucketedOptimizer.__dict__))
    return cls(optimizer.param_groups, hvd, list(named_parameters), compression,  # type: ignore[call-arg]
               backward_passes_per_step, hvd.Average if op is None else op,
               gradient_predivide_factor, bucket_cap_mb)
