"""What one rank holds: bytes of parameters, gradients and optimizer state, and peak RSS.

Counted from the tensors themselves, so sharding shows as it is: a DTensor (``--shard full``)
counts its local shard, a sharded optimizer (``--shard optimizer``) the state of the parameters
this rank owns. The training loop measures at the end of a run, when gradients of the last
step are still allocated (``zero_grad`` comes before the next backward), and writes every
rank's figures into the metrics file under ``memory``. ``grads`` counts the gradients a rank
holds when it steps (the loop frees them right after): every trainable parameter's, or under
``--shard optimizer`` only those of the parameters it owns (the others' are freed once
reduce-scattered), each a local shard under ``--shard full``.
"""

from __future__ import annotations

import resource
import sys
from typing import Any

import torch
from torch import nn

from .backends.zero import ShardedOptimizer

__all__ = ["rank_memory"]


def _local(t: torch.Tensor) -> torch.Tensor:
    to_local = getattr(t, "to_local", None)  # DTensor: this rank's shard
    return to_local() if callable(to_local) else t


def _nbytes(tensors: Any) -> int:
    return sum(_local(t).numel() * _local(t).element_size() for t in tensors if isinstance(t, torch.Tensor))


def rank_memory(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, int]:
    """This rank's ``params``, ``grads`` and ``optimizer_state`` bytes and ``peak_rss`` bytes."""
    params = list(model.parameters())
    if isinstance(optimizer, ShardedOptimizer):  # the owned part: its state, and its gradients,
        inner = optimizer.local                  # which are all that survive the reduction
        trainable = [optimizer.params[i] for i in optimizer.mine if optimizer.params[i].requires_grad]
    else:
        inner, trainable = optimizer, [p for p in params if p.requires_grad]
    state = [] if inner is None else [v for s in inner.state.values() for v in s.values()]
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * (1 if sys.platform == "darwin" else 1024)
    return {"params": _nbytes(params), "grads": _nbytes(trainable),
            "optimizer_state": _nbytes(state), "peak_rss": int(peak)}
