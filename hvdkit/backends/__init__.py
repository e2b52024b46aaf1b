"""Backends: Horovod, native DDP and a single-process fallback, behind one interface.

:mod:`.traits` (what launching each needs) imports nothing heavy; the backends themselves
(torch, horovod) are imported on first use, so the CLI can read the traits cheaply.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from ..errors import ConfigError
from .traits import traits

if TYPE_CHECKING:
    from ..config import BackendConfig
    from .base import Backend
    from .local import LocalBackend

__all__ = ["Backend", "LocalBackend", "create_backend"]


def create_backend(config: BackendConfig) -> Backend:
    """Initialise the backend ``config.name`` and return it (imports it lazily)."""
    from ..config import launched_backend
    from ..environments import check_network_interface

    launched = launched_backend()
    if launched is not None and launched != config.name:
        raise ConfigError(f"the ranks were launched for --backend {launched} (HVDKIT_BACKEND), but this program asks "
                          f"for BackendConfig(name={config.name!r})",
                          f"leave name= out to follow the launcher, or launch with --backend {config.name}")
    module, cls = traits(config.name).implementation.split(":")
    check_network_interface()  # before any library opens a socket on the wrong network
    return getattr(importlib.import_module(module), cls)(config)


def __getattr__(name: str) -> object:  # PEP 562: torch only when a backend class is asked for
    if name == "Backend":
        from .base import Backend

        return Backend
    if name == "LocalBackend":
        from .local import LocalBackend

        return LocalBackend
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
