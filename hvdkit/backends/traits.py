"""What launching each backend needs, known without importing it.

The CLI renders job scripts and launch lines on login nodes, where importing torch or
horovod costs seconds, so the launch-side facts about a backend live here as plain data:
which launchers can start its ranks, which ``srun --mpi`` plugin it needs, whether it
runs elastic, which process group GPUs need, and which class implements it. Code outside
``hvdkit/backends/`` asks this table instead of comparing backend names.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import ConfigError

__all__ = ["BackendTraits", "TRAITS", "BACKENDS", "DEFAULT_BACKEND", "LAUNCHABLE", "traits"]


@dataclass(frozen=True)
class BackendTraits:
    """Launch-side facts about one backend."""

    name: str
    implementation: str                # "module:Class", imported only by create_backend
    launchers: tuple[str, ...] = ()    # what can start its ranks (first: what 'auto' picks); () = no launcher
    srun_mpi: tuple[str, ...] = ()     # srun --mpi plugins it can meet over (first: the default)
    elastic: bool = False              # Horovod Elastic (horovodrun --min-np/--max-np)
    gpu_process_group: str | None = None  # the only process group that uses GPUs, if it picks one
    ray_runner: str | None = None      # on Ray: "horovod.ray" (Horovod's RayExecutor) or "group" (hvdkit's)
    options: str | None = None         # its own options section in BackendConfig ("horovod", "ddp"): --hvd-op ...
    full_shard: str | None = None      # --shard full: "fsdp2" (torch's) or "zero3" (hvdkit's, its collectives)

    @property
    def multi_process(self) -> bool:
        """Whether it runs several ranks (and so needs a launcher and can go into a job script)."""
        return bool(self.launchers)

    @property
    def sbatch_template(self) -> str:
        return f"{self.name}.sbatch"


TRAITS: dict[str, BackendTraits] = {t.name: t for t in (
    # Horovod meets over MPI or Gloo: horovodrun, mpirun or srun (PMIx gives it MPI ranks)
    BackendTraits("horovod", "hvdkit.backends.horovod:HorovodBackend",
                  launchers=("horovodrun", "mpirun", "srun", "ray"),
                  srun_mpi=("pmix", "pmi2", "none"), elastic=True, ray_runner="horovod.ray", options="horovod",
                  full_shard="zero3"),
    # DDP meets rank 0 over TCP (MASTER_ADDR): any launcher that sets ranks, but no MPI for
    # srun to wire up, and horovodrun sets none of the variables it reads
    BackendTraits("ddp", "hvdkit.backends.ddp:DDPBackend", launchers=("mpirun", "srun", "ray"),
                  srun_mpi=("none",), gpu_process_group="nccl", ray_runner="group", options="ddp", full_shard="fsdp2"),
    BackendTraits("local", "hvdkit.backends.local:LocalBackend"),
)}
BACKENDS = tuple(TRAITS)
LAUNCHABLE = tuple(name for name, t in TRAITS.items() if t.multi_process)
# One default for every command: the Horovod path is hvdkit's first path, and a script
# with no --backend then runs unchanged under horovodrun, mpirun and srun (alone it is
# Horovod with one rank).
DEFAULT_BACKEND = "horovod"


def traits(name: str, *, launched: bool = False) -> BackendTraits:
    """The traits of backend ``name``; ``launched``: it must be one a launcher can start."""
    allowed = LAUNCHABLE if launched else BACKENDS
    if name in TRAITS and name not in allowed:
        raise ConfigError(f"--backend {name} runs one plain process, not ranks started by a launcher",
                          f"use one of: {', '.join(allowed)}")
    if name not in allowed:
        raise ConfigError(f"backend {name!r} is not known", f"use one of: {', '.join(allowed)}")
    return TRAITS[name]
