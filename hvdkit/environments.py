"""Launcher environments: who am I, how many are we, and where is rank 0?

One small class per launcher (torchrun-style variables, Open MPI, MPICH/PMI,
Slurm, plain single process), all behind :class:`ClusterEnvironment`, in the
spirit of Lightning Fabric's ``plugins/environments``. Detection reads only
environment variables; ``mpi4py`` is imported lazily, and only when an MPI
launcher gave no ``MASTER_ADDR`` and rank 0 has to pick one and tell the others.
"""

from __future__ import annotations

import itertools
import os
import re
import socket
from abc import ABC, abstractmethod
from collections.abc import Mapping
from typing import ClassVar

from .errors import LauncherEnvError

__all__ = [
    "ClusterEnvironment",
    "TorchrunEnvironment",
    "OpenMPIEnvironment",
    "PMIEnvironment",
    "SlurmEnvironment",
    "LocalEnvironment",
    "ENVIRONMENTS",
    "detect_environment",
    "launcher_rank",
    "expand_nodelist",
    "find_free_port",
    "check_network_interface",
    "usable_cores",
    "slurm_job_memory",
]


def usable_cores() -> int:
    """The CPUs this process may run on (its affinity mask: Slurm's --cpus-per-task, taskset),
    which is what torch's threads should be sized from, not the machine's total."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def slurm_job_memory(environ: Mapping[str, str] | None = None) -> int | None:
    """The memory a Slurm job may use on this node, in bytes (``--mem``: ``SLURM_MEM_PER_NODE``;
    ``--mem-per-cpu``: ``SLURM_MEM_PER_CPU`` times ``SLURM_CPUS_ON_NODE``; both in MiB), shared by
    the job's tasks on the node. None outside a job, or where the job asked for none."""
    env = os.environ if environ is None else environ
    try:
        if env.get("SLURM_MEM_PER_NODE"):
            mib = int(env["SLURM_MEM_PER_NODE"])
        elif env.get("SLURM_MEM_PER_CPU") and env.get("SLURM_CPUS_ON_NODE"):
            mib = int(env["SLURM_MEM_PER_CPU"]) * int(env["SLURM_CPUS_ON_NODE"])
        else:
            return None
    except ValueError:
        return None  # not Slurm's numbers: no limit known, rather than a wrong one
    return mib << 20 if mib > 0 else None  # --mem=0: all of the node's memory


def find_free_port(host: str = "") -> int:
    """Ask the kernel for a free TCP port (there is a small race until it is bound again)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def _int_var(environ: Mapping[str, str], name: str) -> int:
    raw = environ.get(name)
    if raw is None:
        raise LauncherEnvError(f"{name} is not set", f"launch with a launcher that sets {name}")
    try:
        return int(raw.strip().split("(")[0])  # SLURM_TASKS_PER_NODE looks like "2(x3)"
    except ValueError:
        raise LauncherEnvError(
            f"{name}={raw!r} is not an integer", f"unset {name} or set it to a whole number"
        ) from None


_RANGE = re.compile(r"^(\d+)(?:-(\d+))?$")


def _split_top_level(text: str) -> list[str]:
    """Split on commas that are not inside brackets: 'a[1-2],b' -> ['a[1-2]', 'b']."""
    parts: list[str] = []
    depth = 0
    current: list[str] = []
    for ch in text:
        if ch == "[":
            depth += 1
        elif ch == "]":
            depth -= 1
        if ch == "," and depth == 0:
            parts.append("".join(current))
            current = []
        else:
            current.append(ch)
    if depth != 0:
        raise LauncherEnvError(
            f"unbalanced brackets in Slurm node list {text!r}",
            "check SLURM_JOB_NODELIST or set MASTER_ADDR explicitly",
        )
    parts.append("".join(current))
    return [p for p in parts if p]


def _expand_ranges(spec: str, nodelist: str) -> list[str]:
    out: list[str] = []
    for item in spec.split(","):
        m = _RANGE.match(item.strip())
        if not m:
            raise LauncherEnvError(
                f"cannot parse range {item!r} in Slurm node list {nodelist!r}",
                "set MASTER_ADDR explicitly",
            )
        lo, hi = m.group(1), m.group(2) or m.group(1)
        width = len(lo)
        out.extend(str(i).zfill(width) for i in range(int(lo), int(hi) + 1))
    return out


def expand_nodelist(nodelist: str) -> list[str]:
    """Expand a Slurm host list (``node[01-03,07],gpu-a[1-2]``) without ``scontrol``.

    ``scontrol`` is often missing inside containers, so hvdkit never needs it
    to find rank 0's host.
    """
    hosts: list[str] = []
    for part in _split_top_level(nodelist.strip()):
        pieces = re.split(r"(\[[^\]]*\])", part)
        choices = [
            _expand_ranges(p[1:-1], nodelist) if p.startswith("[") else [p] for p in pieces if p
        ]
        hosts.extend("".join(combo) for combo in itertools.product(*choices))
    return hosts


def check_network_interface(environ: Mapping[str, str] | None = None) -> str | None:
    """Check that the interface named by ``--iface`` exists on this host; return it.

    Gloo, NCCL and Open MPI given a name that does not exist fail late and obscurely
    (a rendezvous timeout, or a fallback to another network), so every rank checks
    the name before any communication starts and fails in one line naming the host.
    """
    from .launch.vocabulary import IFACE_VAR

    env = os.environ if environ is None else environ
    iface = env.get(IFACE_VAR)
    if not iface:
        return None
    present = sorted(name for _, name in socket.if_nameindex())
    if iface not in present:
        raise LauncherEnvError(
            f"network interface {iface!r} (--iface) does not exist on {socket.gethostname()}, "
            f"which has: {', '.join(present)}",
            "pass --iface with a name from that list (the same on every node)",
        )
    return iface


class ClusterEnvironment(ABC):
    """Where this process sits in the job. Subclasses read one launcher's variables."""

    name: ClassVar[str]

    def __init__(self, environ: Mapping[str, str] | None = None) -> None:
        self._env: Mapping[str, str] = os.environ if environ is None else environ
        self._address: tuple[str, int] | None = None

    @staticmethod
    @abstractmethod
    def detect(environ: Mapping[str, str]) -> bool:
        """True when this launcher's variables are present."""

    @abstractmethod
    def world_size(self) -> int:
        """Number of processes in the job."""

    @abstractmethod
    def global_rank(self) -> int:
        """Rank of this process among all processes (the one to gate side effects on)."""

    @abstractmethod
    def local_rank(self) -> int:
        """Rank of this process on its node (the one to pick a GPU with)."""

    def _default_address(self) -> tuple[str, int]:
        """(host, port) of rank 0 when MASTER_ADDR/MASTER_PORT are not given."""
        return "127.0.0.1", find_free_port("127.0.0.1")

    def _resolve(self) -> tuple[str, int]:
        if self._address is None:
            addr, port = self._env.get("MASTER_ADDR"), self._env.get("MASTER_PORT")
            if addr and port:
                self._address = (addr, _int_var(self._env, "MASTER_PORT"))
            else:
                default_addr, default_port = self._default_address()
                self._address = (
                    addr or default_addr,
                    _int_var(self._env, "MASTER_PORT") if port else default_port,
                )
        return self._address

    @property
    def main_address(self) -> str:
        """Host of rank 0 (MASTER_ADDR wins when set)."""
        return self._resolve()[0]

    @property
    def main_port(self) -> int:
        """Rendezvous port on rank 0 (MASTER_PORT wins when set)."""
        return self._resolve()[1]

    def validate(self) -> None:
        """Raise :class:`LauncherEnvError` when the variables contradict each other."""
        size, rank, local = self.world_size(), self.global_rank(), self.local_rank()
        if size < 1:
            raise LauncherEnvError(
                f"{self.name}: world size is {size}", "the launcher must start at least 1 process"
            )
        if not 0 <= rank < size:
            raise LauncherEnvError(
                f"{self.name}: rank {rank} is outside world size {size}",
                "the launcher variables are inconsistent; relaunch instead of setting them by hand",
            )
        if not 0 <= local <= rank:
            raise LauncherEnvError(
                f"{self.name}: local rank {local} is impossible for global rank {rank}",
                "the launcher variables are inconsistent; relaunch instead of setting them by hand",
            )

    def describe(self) -> str:
        """One line for logs."""
        return f"{self.name}: rank {self.global_rank()}/{self.world_size()} local {self.local_rank()}"


class TorchrunEnvironment(ClusterEnvironment):
    """``RANK``/``WORLD_SIZE``/``LOCAL_RANK``/``MASTER_ADDR`` as torchrun (or a user) sets them."""

    name = "torchrun"

    @staticmethod
    def detect(environ: Mapping[str, str]) -> bool:
        return all(k in environ for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR"))

    def world_size(self) -> int:
        return _int_var(self._env, "WORLD_SIZE")

    def global_rank(self) -> int:
        return _int_var(self._env, "RANK")

    def local_rank(self) -> int:
        return _int_var(self._env, "LOCAL_RANK") if "LOCAL_RANK" in self._env else 0

    def _default_address(self) -> tuple[str, int]:
        return self._env["MASTER_ADDR"], 29500


class _MPIEnvironment(ClusterEnvironment):
    """Shared rendezvous for MPI launchers: rank 0 picks a port, mpi4py broadcasts it."""

    def _default_address(self) -> tuple[str, int]:
        try:
            from mpi4py import MPI  # lazy: importing it initialises MPI
        except ImportError as exc:
            raise LauncherEnvError(
                f"launched by {self.name} without MASTER_ADDR, and mpi4py is not importable ({exc})",
                "pip install mpi4py (built against the same MPI as mpirun), "
                "or export MASTER_ADDR and MASTER_PORT",
            ) from None
        comm = MPI.COMM_WORLD
        if comm.Get_size() != self.world_size():
            raise LauncherEnvError(
                f"mpi4py sees {comm.Get_size()} processes but {self.name} says {self.world_size()}",
                "mpi4py was built against a different MPI than the launcher; rebuild it with "
                "MPICC=$(which mpicc) pip install --no-binary mpi4py mpi4py",
            )
        hosts = comm.allgather(socket.gethostname())
        if comm.Get_rank() == 0:
            # All on one node: loopback avoids depending on how the hostname resolves.
            host = "127.0.0.1" if len(set(hosts)) == 1 else socket.getfqdn()
            payload: tuple[str, int] | None = (host, find_free_port())
        else:
            payload = None
        host, port = comm.bcast(payload, root=0)
        return host, int(port)


class OpenMPIEnvironment(_MPIEnvironment):
    """Processes started by Open MPI's ``mpirun`` (``OMPI_COMM_WORLD_*``)."""

    name = "openmpi"

    @staticmethod
    def detect(environ: Mapping[str, str]) -> bool:
        return "OMPI_COMM_WORLD_SIZE" in environ and "OMPI_COMM_WORLD_RANK" in environ

    def world_size(self) -> int:
        return _int_var(self._env, "OMPI_COMM_WORLD_SIZE")

    def global_rank(self) -> int:
        return _int_var(self._env, "OMPI_COMM_WORLD_RANK")

    def local_rank(self) -> int:
        return _int_var(self._env, "OMPI_COMM_WORLD_LOCAL_RANK")


class PMIEnvironment(_MPIEnvironment):
    """MPICH / Intel MPI (Hydra) and ``srun --mpi=pmi2``: ``PMI_RANK``/``PMI_SIZE``."""

    name = "pmi"

    @staticmethod
    def detect(environ: Mapping[str, str]) -> bool:
        return "PMI_SIZE" in environ and "PMI_RANK" in environ

    def world_size(self) -> int:
        return _int_var(self._env, "PMI_SIZE")

    def global_rank(self) -> int:
        return _int_var(self._env, "PMI_RANK")

    def local_rank(self) -> int:
        for key in ("MPI_LOCALRANKID", "SLURM_LOCALID"):
            if key in self._env:
                return _int_var(self._env, key)
        return 0


class SlurmEnvironment(ClusterEnvironment):
    """Tasks started by ``srun`` (``SLURM_PROCID``, ``SLURM_NTASKS``, ``SLURM_LOCALID``).

    Rank 0's host is the first host of ``SLURM_JOB_NODELIST`` and the port is
    derived from the job id (``launch.vocabulary``'s ``MASTER_PORT_BASE + job id % MASTER_PORT_SPAN``,
    as the sbatch header computes it), so every task agrees without talking to the others.
    """

    name = "slurm"

    @staticmethod
    def detect(environ: Mapping[str, str]) -> bool:
        # SLURM_STEP_ID is set by srun for every task; the batch shell itself
        # also has SLURM_PROCID=0, so without it a lone `python train.py` in an
        # sbatch script would wait forever for the other tasks.
        return "SLURM_PROCID" in environ and "SLURM_STEP_ID" in environ and "SLURM_NTASKS" in environ

    def world_size(self) -> int:
        key = "SLURM_STEP_NUM_TASKS" if "SLURM_STEP_NUM_TASKS" in self._env else "SLURM_NTASKS"
        return _int_var(self._env, key)

    def global_rank(self) -> int:
        return _int_var(self._env, "SLURM_PROCID")

    def local_rank(self) -> int:
        return _int_var(self._env, "SLURM_LOCALID") if "SLURM_LOCALID" in self._env else 0

    def _default_address(self) -> tuple[str, int]:
        nodelist = self._env.get("SLURM_STEP_NODELIST") or self._env.get("SLURM_JOB_NODELIST")
        if not nodelist:
            raise LauncherEnvError(
                "Slurm task without SLURM_JOB_NODELIST", "export MASTER_ADDR to rank 0's host"
            )
        job_id = self._env.get("SLURM_JOB_ID", "0")
        digits = re.sub(r"\D", "", job_id) or "0"
        from .launch.vocabulary import MASTER_PORT_BASE, MASTER_PORT_SPAN

        return expand_nodelist(nodelist)[0], MASTER_PORT_BASE + int(digits) % MASTER_PORT_SPAN


class LocalEnvironment(ClusterEnvironment):
    """No launcher: one process, rank 0 of 1."""

    name = "local"

    @staticmethod
    def detect(environ: Mapping[str, str]) -> bool:
        return True

    def world_size(self) -> int:
        return 1

    def global_rank(self) -> int:
        return 0

    def local_rank(self) -> int:
        return 0


# Order matters: explicit torchrun-style variables win, then the MPI launcher
# that actually started us (mpirun inside an allocation also sets SLURM_*).
ENVIRONMENTS: dict[str, type[ClusterEnvironment]] = {
    cls.name: cls
    for cls in (
        TorchrunEnvironment,
        OpenMPIEnvironment,
        PMIEnvironment,
        SlurmEnvironment,
        LocalEnvironment,
    )
}


def detect_environment(
    name: str | None = None, environ: Mapping[str, str] | None = None
) -> ClusterEnvironment:
    """Return the launcher environment of this process, validated.

    ``name`` forces one (``torchrun``, ``openmpi``, ``pmi``, ``slurm``, ``local``);
    otherwise the first whose variables are present wins.
    """
    env = os.environ if environ is None else environ
    if name is not None and name != "auto":
        if name not in ENVIRONMENTS:
            raise LauncherEnvError(
                f"unknown launcher environment {name!r}",
                f"use one of: auto, {', '.join(ENVIRONMENTS)}",
            )
        chosen = ENVIRONMENTS[name](env)
    else:
        chosen = next(cls(env) for cls in ENVIRONMENTS.values() if cls.detect(env))
    chosen.validate()
    return chosen


def launcher_rank(environ: Mapping[str, str] | None = None) -> int:
    """This process's rank as its launcher set it, before any backend starts (0 alone): which
    rank reports a refusal that every rank finds. The same detection as :func:`detect_environment`
    (not validated: a broken environment is reported later, by the backend), and first
    ``HOROVOD_RANK``, all that horovodrun's Gloo mode sets."""
    env = os.environ if environ is None else environ
    if env.get("HOROVOD_RANK", "").isdigit():
        return int(env["HOROVOD_RANK"])
    found = next(cls(env) for cls in ENVIRONMENTS.values() if cls.detect(env))
    try:
        return found.global_rank()
    except LauncherEnvError:
        return 0
