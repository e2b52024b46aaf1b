"""Which strategy serves which ``--shard``: the one registry of sharding modes.

``none`` is the backend's own replicated strategy (its reducer); the sharded modes take only a
communicator and plain values from the config. A new mode is one :class:`Strategy` subclass and
one entry here (and its name in ``config.SHARD_MODES``, which the CLI reads without torch).
"""

from __future__ import annotations

from collections.abc import Callable

from ..config import BackendConfig
from .comm import Communicator
from .fsdp import FullyShardedStrategy
from .strategy import Strategy
from .zero import ZeroStrategy

__all__ = ["SHARDED", "make_strategy"]

SHARDED: dict[str, Callable[[Communicator, BackendConfig], Strategy]] = {
    "optimizer": lambda comm, config: ZeroStrategy(comm, config.bucket_cap_mb, config.accumulation_steps),
    "full": lambda comm, _config: FullyShardedStrategy(comm),
}


def make_strategy(config: BackendConfig, comm: Communicator, replicated: Callable[[], Strategy]) -> Strategy:
    """The strategy of ``config.shard``; ``replicated`` makes the backend's own for ``none``."""
    return replicated() if config.shard == "none" else SHARDED[config.shard](comm, config)
