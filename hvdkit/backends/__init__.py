"""Backends: Horovod, native DDP and a single-process fallback, behind one interface."""

from __future__ import annotations

from ..config import BackendConfig
from ..environments import check_network_interface
from ..errors import ConfigError
from .base import Backend
from .local import LocalBackend

__all__ = ["Backend", "LocalBackend", "create_backend"]


def create_backend(config: BackendConfig) -> Backend:
    """Initialise the backend ``config.name`` and return it (imports it lazily)."""
    check_network_interface()  # before any library opens a socket on the wrong network
    if config.name == "horovod":
        from .horovod import HorovodBackend

        return HorovodBackend(config)
    if config.name == "ddp":
        from .ddp import DDPBackend

        return DDPBackend(config)
    if config.name == "local":
        return LocalBackend(config)
    raise ConfigError(f"backend {config.name!r} is not known", "use one of: horovod, ddp, local")
