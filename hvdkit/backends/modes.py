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
from .traits import TRAITS
from .zero import ZeroStrategy
from .zero3 import Zero3Strategy

# --shard full: torch's FSDP2 where the backend is torch.distributed's, else hvdkit's ZeRO-3 on
# the backend's own collectives (BackendTraits.full_shard says which)
FULL: dict[str, Callable[[Communicator, BackendConfig], Strategy]] = {
    "fsdp2": lambda comm, _config: FullyShardedStrategy(comm),
    "zero3": lambda comm, config: Zero3Strategy(comm, config.accumulation_steps),
}

__all__ = ["SHARDED", "make_strategy"]

SHARDED: dict[str, Callable[[Communicator, BackendConfig], Strategy]] = {
    "optimizer": lambda comm, config: ZeroStrategy(comm, config.bucket_cap_mb, config.accumulation_steps),
    "full": lambda comm, config: FULL[str(TRAITS[config.name].full_shard)](comm, config),
}


def make_strategy(config: BackendConfig, comm: Communicator, replicated: Callable[[], Strategy]) -> Strategy:
    """The strategy of ``config.shard``; ``replicated`` makes the backend's own for ``none``."""
    return replicated() if config.shard == "none" else SHARDED[config.shard](comm, config)
