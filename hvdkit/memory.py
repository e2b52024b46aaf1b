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
from typing import TYPE_CHECKING

import torch
from torch import nn

from .sizes import nbytes

if TYPE_CHECKING:
    from .backends.base import Backend

__all__ = ["rank_memory", "peak_rss"]


def peak_rss() -> int:
    """This process's peak resident set size so far, in bytes."""
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * (1 if sys.platform == "darwin" else 1024))


def rank_memory(backend: Backend, model: nn.Module, optimizer: torch.optim.Optimizer,
                built_rss: int = 0) -> dict[str, int]:
    """This rank's ``params``, ``grads`` and ``optimizer_state`` bytes and ``peak_rss`` bytes
    (what its strategy keeps between steps: ZeRO, the owned part; FSDP, local shards), and
    ``built_rss``: the peak RSS once the model was built and wrapped, before any step (what
    building it cost: the meta-device path keeps it to this rank's share)."""
    params, trainable, state = backend.strategy.held(model, optimizer)
    return {"params": nbytes(params), "grads": nbytes(trainable),
            "optimizer_state": nbytes(state), "peak_rss": peak_rss(), "built_rss": built_rss}
