"""Launch vocabulary: every flag and variable a launch line or job script needs, in one place.

Local launch lines (:mod:`hvdkit.launch.local`), the sbatch templates in ``slurm/`` and
the rank-side checks (:func:`hvdkit.environments.check_network_interface`) all read these
names from here, so a change is made once. Pure data and small pure functions: importing
this module must stay cheap (no torch, no horovod).
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping

from ..errors import ConfigError

__all__ = [
    "MPIRUN_BASE", "FORWARDED_VARS", "IFACE_VAR", "iface_env", "check_iface_name",
    "root_mpi_env", "ROOT_MPI_VARS", "MPI_DEFAULTS", "mpi_env", "ELASTIC_LAUNCHER", "CONSOLE_TTY_VAR",
]

# Horovod Elastic's driver (--min-np/--max-np, host discovery) exists only in horovodrun.
ELASTIC_LAUNCHER = "horovodrun"

# Open MPI's transports hvdkit leaves out: InfiniBand verbs (openib, as Horovod's docs) and
# libfabric (ofi). Gradients travel over TCP and shared memory (or NCCL/Gloo, not MPI at all);
# ofi only probes for a fabric: on a machine without one it cost 1.0-1.2 s at every start and
# finish of every MPI job (measured here: a 2-rank allgather-and-exit took 1.49 s with it, 0.30
# s without). An exclusion list, because a component named in it need not exist (Open MPI 5
# renamed vader to sm, and an include list naming a missing component fails to start).
MPI_BTL = "^openib,ofi"

# What Horovod's docs pass to mpirun: no binding (torch threads move freely), ranks by
# slot, the transports above.
MPIRUN_BASE = ("-bind-to", "none", "-map-by", "slot", "-mca", "pml", "ob1", "-mca", "btl", MPI_BTL)

# One host as horovodrun reads it, in -H lists and discovery scripts: NAME or NAME:SLOTS.
HOST_SLOTS = re.compile(r"^([A-Za-z0-9_.-]+)(?::(\d+))?$")

# Rank 0's port in a Slurm job when MASTER_PORT is not set: derived from the job id, so every
# task agrees without talking (as Lightning does); the sbatch header and
# hvdkit.environments.SlurmEnvironment both use these.
MASTER_PORT_BASE, MASTER_PORT_SPAN = 15000, 10000

# Elastic jobs: the batch shell touches the file this variable names when Slurm signals it
# (horovodrun's workers are not Slurm's to signal); hvdkit.preemption watches it.
STOP_FILE_VAR = "HVDKIT_STOP_FILE"

# Open MPI refuses to run as root unless both are set (containers, this CI).
ROOT_MPI_VARS = ("OMPI_ALLOW_RUN_AS_ROOT", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM")

# Defaults for every MPI process hvdkit starts; a value already in the environment wins.
# mpi_yield_when_idle: Open MPI spins on the CPU while waiting unless it knows it is
# oversubscribed. With Horovod it always is, in effect: torch's threads take every core
# of a rank and Horovod's background thread waits in MPI every cycle. Measured on 2 cores
# (hvdkit bench --only reducer, same run, bootstrap 95% CI): Horovod bucketed / DDP step
# time went from 1.16 [1.12, 1.24] to 1.00 [0.97, 1.03] (cnn) and from 1.11 [1.02, 1.15]
# to 0.91 [0.86, 0.96] (mlp), and Horovod's CPU seconds per step fell by 15-25%.
# OMPI_MCA_btl: the same transports for ranks that srun starts (no mpirun command line).
MPI_DEFAULTS = {"OMPI_MCA_mpi_yield_when_idle": "1", "OMPI_MCA_btl": MPI_BTL}

# hvdkit's record of --iface, checked on every rank before any communication starts.
IFACE_VAR = "HVDKIT_IFACE"

# The backend 'hvdkit run/slurm --backend' started the ranks for: BackendConfig() takes it as its
# default, so a program of your own follows the launcher, and a program that asks for another
# backend is told so in one line (hvdkit.backends.create_backend).
BACKEND_VAR = "HVDKIT_BACKEND"

# 'hvdkit train' reads any of its options from HVDKIT_TRAIN_<OPTION> (click's auto_envvar_prefix
# under the 'hvdkit' group): how options horovodrun would swallow reach the ranks, and what the
# render-time check of a script's training options reads too (hvdkit.cli.validate).
TRAIN_ENV_PREFIX = "HVDKIT_TRAIN"


def train_env_var(option_name: str) -> str:
    """The variable 'hvdkit train' reads the option of parameter name ``option_name`` from."""
    return f"{TRAIN_ENV_PREFIX}_{option_name.upper()}"


# Variables mpirun must pass on with -x when they are set (srun and horovodrun pass the
# whole environment). OMPI_MCA_* need no -x: mpirun forwards those itself.
FORWARDED_VARS = (
    "PATH", "LD_LIBRARY_PATH", "PYTHONPATH", "OMP_NUM_THREADS", "MASTER_ADDR", "MASTER_PORT",
    "NCCL_DEBUG", "NCCL_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME", "HOROVOD_GLOO_IFACE",
    "HOROVOD_FUSION_THRESHOLD", "HOROVOD_CYCLE_TIME", IFACE_VAR, BACKEND_VAR,
)

# hvdkit run sets this for the ranks when its own console is a terminal: rank 0 then sends
# progress lines for hvdkit run to draw as a bar (hvdkit.observe)
CONSOLE_TTY_VAR = "HVDKIT_CONSOLE_TTY"

_IFACE = re.compile(r"^[A-Za-z0-9_.:-]{1,15}$")


def check_iface_name(iface: str) -> str:
    """``iface`` if it can be a Linux interface name (``ib0``, ``eth1``), else a ConfigError."""
    if not _IFACE.match(iface):
        raise ConfigError(f"--iface {iface!r} is not a network interface name",
                          "name one interface as 'ip -br link' on a compute node shows it, e.g. ib0")
    return iface


def iface_env(iface: str) -> dict[str, str]:
    """Variables that pin every transport to interface ``iface``.

    NCCL and Gloo (DDP), Horovod's Gloo controller, and Open MPI's TCP transport (BTL)
    plus its out-of-band channel (mpirun's daemons) each have their own knob.
    """
    check_iface_name(iface)
    return {
        IFACE_VAR: iface,
        "NCCL_SOCKET_IFNAME": f"={iface}",  # '=': exactly this name, not every name it prefixes
        "GLOO_SOCKET_IFNAME": iface,
        "HOROVOD_GLOO_IFACE": iface,
        "OMPI_MCA_btl_tcp_if_include": iface,
        "OMPI_MCA_oob_tcp_if_include": iface,
    }


def mpi_env(environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """What an MPI launch adds to the environment: the root variables and the MPI defaults
    that ``environ`` (default ``os.environ``) does not already set."""
    env = os.environ if environ is None else environ
    return {**root_mpi_env(), **{k: v for k, v in MPI_DEFAULTS.items() if k not in env}}


def root_mpi_env() -> dict[str, str]:
    """The two Open MPI root variables when this process is root, else nothing."""
    if hasattr(os, "geteuid") and os.geteuid() == 0:
        return {name: "1" for name in ROOT_MPI_VARS}
    return {}
