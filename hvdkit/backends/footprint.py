"""What one rank holds under each sharding mode, in bytes, from a model's sizes alone: the one
place that knows it (the memory preflight, :mod:`hvdkit.preflight`, asks it for every mode to
name one that fits).

Per rank, at ``N`` ranks, for ``P`` bytes of parameters (``T`` of them trainable) and an
optimizer that keeps ``r`` bytes of state per trainable byte (AdamW: 2):

=========== ============ =========== ============ ===================================================
mode        parameters   gradients   optimizer    in flight
=========== ============ =========== ============ ===================================================
none        P            T           r*T          Horovod: MAX_IN_FLIGHT buckets and the one being
                                                  filled (its reducer's flat copies); DDP: none (its
                                                  buckets are the gradients themselves)
optimizer   P            G           r*T/N        a bound: MAX_IN_FLIGHT+1 times the largest
                                                  bucket's flat buffer and segment (backward), or
                                                  MAX_IN_FLIGHT times its all-gather, a segment and
                                                  its result (after the step), whichever is more
full        P/N          T/N         r*T/N        two units whole (the one running, the prefetched
                                                  one) and two units' whole gradients
=========== ============ =========== ============ ===================================================

``G``: the reduced gradients of the parameters ZeRO's plan (:func:`~hvdkit.backends.zero.plan_owned`,
at this world size) gives the rank that owns the most (about T/N: whole parameters are owned,
so a few large ones make it uneven); each rank keeps its own and frees the rest as it arrives.

These are the strategies' own rules (``buckets.MAX_IN_FLIGHT``, ZeRO's plan, ZeRO-3's and FSDP2's
prefetch of one unit), not fitted numbers. Left out: what the allocator keeps of freed memory and
the collectives' own buffers (gloo, Horovod's fusion buffer), which is why the preflight refuses
only what its estimate says cannot fit.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from ..blocks import shard_units
from ..sizes import nbytes
from .buckets import MAX_IN_FLIGHT
from .zero import plan_owned

__all__ = ["ModelSizes", "Needs", "model_sizes", "needs"]


@dataclass(frozen=True)
class ModelSizes:
    """A model's sizes, whole, in bytes (a meta-built model's too: only shapes are read)."""

    params: int          # every parameter (a tied one once)
    trainable: int       # those that require a gradient
    largest_unit: int    # the largest unit --shard full gathers whole (a block, or the root's rest)
    largest_tensor: int  # what a checkpoint's writer holds at once (hvdkit.checkpoint streams)
    zero_grads: int = 0  # --shard optimizer: the reduced gradients the busiest owner keeps (ZeRO's plan)
    zero_flat: int = 0   # --shard optimizer: its largest bucket in backward (flat buffer sent, segment received)
    zero_gather: int = 0  # --shard optimizer: its largest all-gather after the step (segment and result)


@dataclass(frozen=True)
class Needs:
    """One rank's bytes under one mode, by part."""

    params: int
    grads: int
    optimizer: int
    in_flight: int

    @property
    def state(self) -> int:
        """Everything but what is in flight: what lives between steps, gradients included."""
        return self.params + self.grads + self.optimizer


def model_sizes(model: nn.Module, optimized: Sequence[torch.Tensor] = (), world: int = 1,
                bucket_cap_mb: float = 25.0) -> ModelSizes:
    """The sizes of ``model`` as built (whole, before any strategy wraps it), with the units
    ``--shard full`` would make of it (:func:`hvdkit.blocks.shard_units`, the root taking the
    rest) and, for ``--shard optimizer`` at ``world`` ranks, ZeRO's plan of ``optimized`` (the
    optimizer's parameters in its groups' order)."""
    params = list(model.parameters())  # each shared parameter once
    seen: set[int] = set()
    units = []
    for module in [*shard_units(model), model]:
        own = [p for p in module.parameters() if id(p) not in seen]
        seen.update(id(p) for p in own)
        units.append(nbytes(own))
    zero_grads = zero_flat = zero_gather = 0
    if optimized and world > 1:
        _, buckets, owner = plan_owned(optimized, bucket_cap_mb, world)
        owned = [0] * world  # each rank keeps its own parameters' reduced gradients, no padding
        for i, r in enumerate(owner):
            owned[r] += nbytes([optimized[i]])
        zero_grads = max(owned)
        sent, gathered = [], []
        for b in buckets:
            size = optimized[b.params[0]].element_size()
            whole = sum(optimized[i].numel() for i in b.params) * size
            # backward: the flat buffer sent (every owner's padded segment) and the segment received,
            # or the bucket whole; after the step: this rank's segment and the all-gathered buffer
            # (a broadcast is in place)
            sent.append((world + 1) * b.width * size if b.scatter else whole)
            gathered.append((world + 1) * b.width * size if b.scatter else 0)
        zero_flat, zero_gather = max(sent), max(gathered)
    return ModelSizes(params=nbytes(params), trainable=nbytes(p for p in params if p.requires_grad),
                      largest_unit=max(units), largest_tensor=max((nbytes([p]) for p in params), default=0),
                      zero_grads=zero_grads, zero_flat=zero_flat, zero_gather=zero_gather)


# --shard none: the buckets a backend's replicated reducer holds beside the gradients
_REPLICATED_BUCKETS = {"horovod": MAX_IN_FLIGHT + 1, "ddp": 0}  # DDP: gradient_as_bucket_view


def needs(mode: str, sizes: ModelSizes, world: int, optimizer_ratio: float, bucket_bytes: int,
          backend: str = "ddp") -> Needs:
    """One rank's parts under ``mode`` (``none``, ``optimizer``, ``full``) at ``world`` ranks of ``backend``."""
    T = sizes.trainable
    bucket_bytes = min(bucket_bytes, T)  # a bucket holds no more than every gradient there is
    if mode == "none":
        return Needs(sizes.params, T, math.ceil(optimizer_ratio * T),
                     _REPLICATED_BUCKETS.get(backend, 0) * bucket_bytes)
    if mode == "optimizer":
        # a bound, every bucket in flight as large as the largest: the runs of consecutive buckets
        # would be tighter, but the collectives' own copies of them are not counted (on the wide
        # MLP of tests/test_preflight.py the estimate is still under the cgroup's peak)
        return Needs(sizes.params, sizes.zero_grads or math.ceil(T / world), math.ceil(optimizer_ratio * T / world),
                     max((MAX_IN_FLIGHT + 1) * max(sizes.zero_flat, bucket_bytes), MAX_IN_FLIGHT * sizes.zero_gather))
    if mode == "full":
        return Needs(math.ceil(sizes.params / world), math.ceil(T / world), math.ceil(optimizer_ratio * T / world),
                     4 * sizes.largest_unit)
    raise ValueError(f"unknown sharding mode {mode!r}")
