"""Local launch lines: ``horovodrun`` or ``mpirun``, built as argument lists plus an env dict.

Horovod's own ``runner/mpi_run.py`` builds one huge format string; here every
piece is a list element, so paths with spaces or quotes need no escaping and
tests can compare structures instead of strings.
"""

from __future__ import annotations

import os
import shlex
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from .. import __version__
from ..backends.traits import traits
from ..errors import ConfigError
from .vocabulary import (
    ELASTIC_LAUNCHER,
    FORWARDED_VARS,
    HOST_SLOTS,
    MPIRUN_BASE,
    iface_env,
    mpi_env,
    root_mpi_env,
)

__all__ = [
    "LAUNCHERS", "CONTROLLERS", "horovod_controller", "parse_hosts", "LocalLaunch", "local_launcher",
    "build_local_command", "format_command", "root_mpi_env",
    "training_program", "render_launch_script", "render_discovery_script",
]

LAUNCHERS = ("horovodrun", "mpirun")
CONTROLLERS = ("auto", "gloo", "mpi")


def horovod_controller(requested: str = "auto", elastic: bool = False, python: str | None = None,
                       hosts: str | None = None) -> tuple[str, str]:
    """horovodrun's controller, and why: ``requested``, or for ``auto`` the fastest one usable.

    ``auto`` is MPI when Open MPI's ``mpirun`` is here and Horovod was built with MPI, unless
    the run is elastic (Horovod Elastic needs Gloo). Measured on this project's 2-core
    machines (mlp, 2 ranks): the MPI controller trains 1.2-1.9x faster than the Gloo one,
    whose per-cycle negotiation goes over TCP even between ranks of one node. Across nodes the
    link decides: a run on several ``hosts`` takes Gloo where this cluster's network bench
    measured it clearly faster on every model (:func:`hvdkit.advice.measured_controller`;
    ResNet-18 over 1 Gbit/s: Open MPI's TCP allreduce 1.14x Gloo's ring), never by guess.
    """
    if requested not in CONTROLLERS:
        raise ConfigError(f"controller {requested!r} is not known", f"use one of: {', '.join(CONTROLLERS)}")
    if elastic:
        if requested == "mpi":
            raise ConfigError("--controller mpi cannot run elastic training",
                              "Horovod Elastic runs on the Gloo controller: drop --controller")
        return "gloo", "elastic training runs on Gloo"
    if requested != "auto":
        return requested, "asked for"
    import shutil

    from ..backends.probe import horovod_has_mpi

    mpirun = resolve_launcher("mpirun", python)
    if not (os.path.isabs(mpirun) or shutil.which(mpirun)):
        return "gloo", "no mpirun here"
    if not horovod_has_mpi():
        return "gloo", "Horovod was built without MPI"
    if hosts and len({name for name, _ in parse_hosts(hosts)}) > 1:
        from ..advice import measured_controller

        measured = measured_controller()
        if measured:
            return measured
    return "mpi", "Open MPI and an MPI-built Horovod are here (faster than Gloo)"


def parse_hosts(spec: str) -> list[tuple[str, int]]:
    """``node1:2,node2:2`` -> ``[("node1", 2), ("node2", 2)]``; one-line ConfigError if malformed."""
    out = []
    for item in spec.split(","):
        m = HOST_SLOTS.match(item.strip())
        if not m or m.group(2) is None or int(m.group(2)) < 1:
            raise ConfigError(f"-H {spec!r}: {item!r} is not host:slots with slots >= 1",
                              "e.g. -H node1:2,node2:2")
        out.append((m.group(1), int(m.group(2))))
    return out


def local_launcher(backend: str, launcher: str = "auto") -> str:
    """The launcher that starts ``backend``'s ranks here: ``launcher``, or for ``auto`` the
    first this backend can use (horovodrun for Horovod, mpirun for DDP)."""
    usable = [name for name in traits(backend, launched=True).launchers if name in LAUNCHERS]
    if launcher == "auto":
        return usable[0]
    if launcher not in usable:
        raise ConfigError(f"{launcher} cannot launch the {backend} backend", f"use --launcher {' or '.join(usable)}")
    return launcher


def training_program(backend: str, args: Sequence[str], python: str | None = None) -> list[str]:
    """``args`` as given when they name a program, else ``python -m hvdkit train --backend B args``."""
    if args and not args[0].startswith("-"):
        return list(args)
    return [python or sys.executable, "-m", "hvdkit", "train", "--backend", backend, *args]


@dataclass(frozen=True)
class LocalLaunch:
    """How to start ``np`` ranks of a program on this machine (or on ``hosts``)."""

    np: int = 2
    launcher: str = "horovodrun"
    controller: str = "gloo"
    hosts: str | None = None
    oversubscribe: bool | None = None
    env: Mapping[str, str] = field(default_factory=dict)
    min_np: int | None = None
    max_np: int | None = None
    discovery_script: str | None = None
    iface: str | None = None
    blacklist_cooldown: tuple[int, int] | None = None  # elastic: (min, max) s a failed host waits
    elastic_nic: str | None = None   # elastic: horovodrun's --network-interface (see launch/discovery.py)
    elastic_timeout: int | None = None  # elastic: s horovodrun waits for --min-np slots, then fails

    def __post_init__(self) -> None:
        if self.np < 1:
            raise ConfigError(f"-np must be >= 1, got {self.np}", "start at least one process")
        if self.launcher not in LAUNCHERS:
            raise ConfigError(f"launcher {self.launcher!r} is not known", f"use one of: {', '.join(LAUNCHERS)}")
        if self.controller not in ("gloo", "mpi"):
            raise ConfigError(f"controller {self.controller!r} is not known", "use gloo or mpi")
        if self.hosts is not None:
            parse_hosts(self.hosts)
        if self.elastic:
            if self.launcher != ELASTIC_LAUNCHER:
                raise ConfigError(f"elastic training needs {ELASTIC_LAUNCHER}", f"use --launcher {ELASTIC_LAUNCHER}")
            if not self.discovery_script:
                raise ConfigError("elastic training needs a host discovery script",
                                  "pass --host-discovery-script (see --write-discovery-script)")
            if self.blacklist_cooldown and not 0 < self.blacklist_cooldown[0] <= self.blacklist_cooldown[1]:
                raise ConfigError(f"--blacklist-cooldown-range {self.blacklist_cooldown} is not 0 < MIN <= MAX",
                                  "e.g. --blacklist-cooldown-range 60 300")
            lo, hi = self.min_np or 1, self.max_np or self.np
            if not 1 <= lo <= self.np <= hi:
                raise ConfigError(f"need 1 <= --min-np ({lo}) <= -np ({self.np}) <= --max-np ({hi})",
                                  "pick bounds around -np")

    @property
    def elastic(self) -> bool:
        """Horovod Elastic: a discovery script or np bounds were given."""
        return bool(self.discovery_script or self.min_np or self.max_np)

    @property
    def needs_oversubscribe(self) -> bool:
        """Open MPI refuses more ranks than cores unless asked; decide automatically."""
        if self.oversubscribe is not None:
            return self.oversubscribe
        return self.hosts is None and self.np > (os.cpu_count() or 1)


def build_local_command(
    spec: LocalLaunch, program: Sequence[str], environ: Mapping[str, str] | None = None
) -> tuple[list[str], dict[str, str]]:
    """Return ``(argv, extra_env)`` that start ``program`` on ``spec.np`` ranks.

    ``environ`` (default ``os.environ``) only decides which of PATH, PYTHONPATH,
    ... exist and so can be forwarded with ``mpirun -x``.
    """
    environ = os.environ if environ is None else environ
    env = {**mpi_env(environ), **(iface_env(spec.iface) if spec.iface else {}), **dict(spec.env)}
    if spec.launcher == "horovodrun":
        argv = ["horovodrun", "-np", str(spec.np)]
        if spec.iface:  # the interface horovodrun's driver and Gloo rendezvous use
            argv += ["--network-interface", spec.iface]
        if spec.elastic:  # Horovod Elastic runs on the Gloo controller
            argv += ["--min-np", str(spec.min_np or 1), "--max-np", str(spec.max_np or spec.np),
                     "--host-discovery-script", str(spec.discovery_script), "--gloo"]
            if spec.blacklist_cooldown:  # else a host that failed once never comes back
                argv += ["--blacklist-cooldown-range", *map(str, spec.blacklist_cooldown)]
            if spec.elastic_nic and not spec.iface:  # else horovodrun waits for a second host
                argv += ["--network-interface", spec.elastic_nic]
            if spec.elastic_timeout:
                argv += ["--elastic-timeout", str(spec.elastic_timeout)]
            return argv + list(program), env
        argv += ["-H", spec.hosts or f"localhost:{spec.np}"]
        argv.append("--gloo" if spec.controller == "gloo" else "--mpi")
        if spec.controller == "mpi" and spec.needs_oversubscribe:
            argv += ["--mpi-args=--oversubscribe"]
        return argv + list(program), env
    argv = ["mpirun", "-np", str(spec.np), *MPIRUN_BASE]
    if spec.hosts:
        argv += ["-H", spec.hosts]
    if spec.needs_oversubscribe:
        argv.append("--oversubscribe")
    for var in dict.fromkeys((*FORWARDED_VARS, *env)):
        if (var in environ or var in env) and not var.startswith("OMPI_"):  # mpirun sends OMPI_*
            argv += ["-x", var]
    return argv + list(program), env


def resolve_launcher(name: str, python: str | None = None) -> str:
    """Path of launcher ``name``: next to the interpreter first (a venv's horovodrun), then PATH.

    ``.venv/bin/hvdkit run`` without an activated venv must still find the horovodrun
    installed beside it, and the one matching this interpreter's Horovod.
    """
    import shutil
    from pathlib import Path

    beside = Path(python or sys.executable).parent / name
    if beside.is_file() and os.access(beside, os.X_OK):
        return str(beside)
    return shutil.which(name) or name


def format_command(argv: Sequence[str], env: Mapping[str, str] | None = None) -> str:
    """A copy-pasteable shell line for ``argv`` with ``env`` assignments in front."""
    prefix = [f"{k}={shlex.quote(v)}" for k, v in sorted((env or {}).items())]
    return " ".join(prefix + [shlex.quote(a) for a in argv])


def render_launch_script(argv: Sequence[str], env: Mapping[str, str], np: int) -> str:
    """A standalone bash script (from ``slurm/mpirun.sh``) that runs ``argv`` with ``env``."""
    from .templates import Raw, check_env_name, render_template

    return render_template("mpirun.sh", {
        "argv": list(argv), "exports": [(Raw(check_env_name(k)), v) for k, v in sorted(env.items())],
        "np": np, "version": __version__,
    })


def render_discovery_script(slots: int) -> str:
    """Horovod Elastic host discovery for a Slurm allocation (from ``slurm/discover_hosts.sh``)."""
    from .templates import render_template

    if slots < 1:
        raise ConfigError("--slots must be >= 1", "one slot per GPU (or per rank) on each host")
    return render_template("discover_hosts.sh", {"slots": slots, "version": __version__})
