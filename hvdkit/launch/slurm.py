"""Slurm batch scripts from one pure function of typed options, and their submission.

``render_sbatch(job)`` is pure: the same :class:`SlurmJob` always gives the
same text, every user value is shell-quoted by the template layer, and
anything that cannot be expressed safely (a newline in an ``#SBATCH`` value,
a malformed ``--time``) is rejected with a one-line :class:`ConfigError`
before a single line is written.
"""

from __future__ import annotations

import re
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .. import __version__
from ..backends.traits import DEFAULT_BACKEND, traits
from ..errors import ConfigError, HvdkitError
from .discovery import DEFAULT_ELASTIC_TIMEOUT
from .templates import Raw, check_env_name, render_template, template_dir
from .vocabulary import (
    ELASTIC_LAUNCHER,
    FORWARDED_VARS,
    IFACE_VAR,
    MASTER_PORT_BASE,
    MASTER_PORT_SPAN,
    MPI_DEFAULTS,
    MPIRUN_BASE,
    ROOT_MPI_VARS,
    STOP_FILE_VAR,
    check_iface_name,
    train_env_var,
)

__all__ = ["SlurmJob", "render_sbatch", "submit", "parse_time", "array_indices", "mem_bytes", "SRUN_MPI",
           "SLURM_LAUNCHERS"]

SRUN_MPI = ("pmix", "pmi2", "none")
SLURM_LAUNCHERS = ("srun", "mpirun", "horovodrun")
RAY_ENGINE = "ray"  # hvdkit slurm --engine ray: Ray started inside the allocation (slurm/ray.sbatch)
RAY_JOIN_TIMEOUT_S = 300  # how long the script waits for every node's Ray to join before it fails
_NAME_LIST = re.compile(r"^[A-Za-z0-9_.+-]+(,[A-Za-z0-9_.+-]+)*$")
_MEM = re.compile(r"^\d+(\.\d+)?[KMGT]?$")
_MEM_UNITS = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}  # sbatch --mem: no unit is M
_ARRAY_ITEM = re.compile(r"^(\d+)(?:-(\d+))?(?::(\d+))?$")
_EXTRA = re.compile(r"^--?[A-Za-z][A-Za-z0-9-]*(=\S.*)?$")
_SIGNAL = re.compile(r"^(B:)?(USR1|USR2|TERM|INT|HUP)$")


def mem_bytes(spec: str) -> int | None:
    """sbatch ``--mem`` in bytes (``16G``, ``4000``: MiB when it has no unit); None for ``0``,
    which gives a job all of each node's memory."""
    if not _MEM.match(spec):
        raise ConfigError(f"--mem {spec!r} is not a Slurm memory size", "use e.g. 16G or 4000M")
    unit = _MEM_UNITS.get(spec[-1])
    value = float(spec[:-1] if unit else spec) * (unit or _MEM_UNITS["M"])
    return int(value) or None


def array_indices(spec: str) -> list[int]:
    """The task indices of a Slurm ``--array`` spec (``0-15%4``, ``1,3,5-9:2``); ConfigError if bad."""
    body, _, limit = spec.partition("%")
    if "%" in spec and (not limit.isdigit() or int(limit) < 1):
        raise ConfigError(f"--array {spec!r}: the %limit must be a whole number >= 1",
                          "e.g. 0-15%4 runs at most 4 tasks at once")
    out: list[int] = []
    for item in body.split(","):
        m = _ARRAY_ITEM.match(item)
        if not m:
            raise ConfigError(f"--array {spec!r} is not a Slurm array spec", "use e.g. 0-2 or 0-15%4")
        lo, hi, step = int(m.group(1)), int(m.group(2) or m.group(1)), int(m.group(3) or 1)
        if hi < lo:
            raise ConfigError(f"--array {spec!r}: range {lo}-{hi} runs backwards", f"write {hi}-{lo}")
        if step < 1:
            raise ConfigError(f"--array {spec!r}: a step must be >= 1", "e.g. 0-10:2")
        out.extend(range(lo, hi + 1, step))
    if len(set(out)) != len(out):
        raise ConfigError(f"--array {spec!r} names a task twice", "list each index once")
    return sorted(out)


def parse_time(value: str) -> int:
    """Seconds in a Slurm time limit; accepts every form sbatch does.

    ``M``, ``M:S``, ``H:M:S``, ``D-H``, ``D-H:M``, ``D-H:M:S``. Raises ConfigError.
    """
    bad = ConfigError(f"--time {value!r} is not a Slurm time limit",
                      "use MM, MM:SS, HH:MM:SS, D-HH, D-HH:MM or D-HH:MM:SS (e.g. 02:00:00)")
    m = re.fullmatch(r"(?:(\d+)-)?(\d+)(?::(\d+))?(?::(\d+))?", value.strip())
    if not m:
        raise bad
    days, a, b, c = m.groups()
    if days is not None:          # D-H[:M[:S]]
        h, mi, s = int(a), int(b or 0), int(c or 0)
        if h > 23 or mi > 59 or s > 59:
            raise bad
        total = ((int(days) * 24 + h) * 60 + mi) * 60 + s
    elif c is not None:           # H:M:S
        h, mi, s = int(a), int(b), int(c)
        if mi > 59 or s > 59:
            raise bad
        total = (h * 60 + mi) * 60 + s
    elif b is not None:           # M:S
        if int(b) > 59:
            raise bad
        total = int(a) * 60 + int(b)
    else:                         # M
        total = int(a) * 60
    if total <= 0:
        raise bad
    return total


@dataclass(frozen=True)
class SlurmJob:
    """Everything an hvdkit sbatch script can hold. ``program`` is the command run on every task."""

    program: tuple[str, ...]
    backend: str = DEFAULT_BACKEND
    job_name: str = "hvdkit"
    nodes: int = 1
    tasks_per_node: int = 1
    gpus_per_node: int = 0
    gpus_per_task: int | None = None
    cpus_per_task: int = 1
    mem: str | None = None
    time: str = "01:00:00"
    partition: str | None = None
    account: str | None = None
    qos: str | None = None
    constraint: str | None = None
    output: str | None = None
    error: str | None = None
    modules: tuple[str, ...] = ()
    venv: str | None = None
    conda_env: str | None = None
    workdir: str | None = None
    extra_sbatch: tuple[str, ...] = ()
    env: tuple[tuple[str, str], ...] = ()
    launcher: str = "srun"
    srun_mpi: str | None = None   # None: the backend's default (pmix for Horovod, none for DDP)
    signal: str = "USR1"
    signal_seconds: int | None = 90
    requeue: bool = True
    array: str | None = None
    array_params: str | None = None
    results_dir: str | None = None
    checkpoint_dir: str | None = None
    process_group: str | None = None
    elastic_min_nodes: int | None = None  # Horovod Elastic over the allocation, down to this many nodes
    blacklist_cooldown: tuple[int, int] = (60, 300)  # elastic: s before a failed node may rejoin
    elastic_timeout: int = DEFAULT_ELASTIC_TIMEOUT  # elastic: s horovodrun waits for the fewest nodes
    ray_sweep_dir: str | None = None  # --engine ray: program is the Tune driver of the sweep in this --out

    def __post_init__(self) -> None:
        if not self.program:
            raise ConfigError("no program to run", "pass training options or '-- python train.py'")
        backend = traits(self.backend, launched=True)
        for name in ("nodes", "tasks_per_node", "cpus_per_task"):
            if getattr(self, name) < 1:
                raise ConfigError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}",
                                  "ask for at least 1")
        if self.gpus_per_node < 0:
            raise ConfigError("--gpus-per-node must be >= 0", "use 0 for CPU jobs")
        if self.gpus_per_node and self.gpus_per_node != self.tasks_per_node and self.gpus_per_task is None:
            raise ConfigError(
                f"--tasks-per-node {self.tasks_per_node} differs from --gpus-per-node {self.gpus_per_node}",
                "data-parallel training runs one rank per GPU: set them equal")
        gpu_pg = backend.gpu_process_group
        if self.process_group is not None and gpu_pg is None:
            raise ConfigError(f"--process-group is DDP's; --backend {self.backend} would ignore it",
                              "drop --process-group")
        if self.process_group == gpu_pg and gpu_pg and not self.gpus_per_node and self.gpus_per_task is None:
            raise ConfigError(f"--process-group {gpu_pg} needs GPUs, and this job asks for none",
                              "add --gpus-per-node N, or drop --process-group (gloo is chosen on CPUs)")
        if self.gpus_per_node and gpu_pg and self.process_group not in (None, gpu_pg):
            raise ConfigError(f"--gpus-per-node with --process-group {self.process_group} leaves the GPUs' "
                              f"{gpu_pg.upper()} path unused",
                              f"drop --process-group {self.process_group} ({gpu_pg} is chosen automatically on GPUs)")
        parse_time(self.time)
        for name in ("partition", "account", "qos"):
            value = getattr(self, name)
            if value is not None and not _NAME_LIST.match(value):
                raise ConfigError(f"--{name} {value!r} is not a valid Slurm name",
                                  "use letters, digits, '_', '-', '.' (comma-separated for several)")
        if self.mem is not None:
            mem_bytes(self.mem)  # a ConfigError unless Slurm reads it
        if self.launcher not in (*SLURM_LAUNCHERS, RAY_ENGINE):
            raise ConfigError(f"--launcher {self.launcher!r} is not known", f"use {', '.join(SLURM_LAUNCHERS)}")
        if self.ray_sweep_dir is not None and self.launcher != RAY_ENGINE:
            raise ConfigError("a Ray sweep's job needs Ray in the allocation", "use the ray engine")
        if self.launcher == RAY_ENGINE:
            for flag, on in (("--elastic", self.elastic_min_nodes is not None), ("--array", bool(self.array)),
                             ("--gpus-per-task", self.gpus_per_task is not None),
                             ("--srun-mpi", self.srun_mpi is not None)):
                if on:
                    raise ConfigError(f"{flag} cannot be combined with --engine ray",
                                      "Ray places the ranks inside the allocation: drop it (GPUs: --gpus-per-node)")
        if self.srun_mpi is not None and self.srun_mpi not in SRUN_MPI:
            raise ConfigError(f"--srun-mpi {self.srun_mpi!r} is not known", f"use {', '.join(SRUN_MPI)}")
        if self.srun_mpi is not None and self.srun_mpi not in backend.srun_mpi:
            raise ConfigError(f"--srun-mpi {self.srun_mpi} with --backend {self.backend}: it meets its peers "
                              f"with no MPI for srun to set up", f"drop --srun-mpi (it takes {backend.srun_mpi[0]})")
        if self.launcher not in backend.launchers:
            raise ConfigError(f"{self.launcher} cannot launch the {self.backend} backend",
                              f"use --launcher {' or '.join(x for x in backend.launchers if x in SLURM_LAUNCHERS)}")
        if self.elastic_min_nodes is not None:
            if not backend.elastic or self.launcher != ELASTIC_LAUNCHER:
                raise ConfigError(f"--elastic runs Horovod Elastic, which {ELASTIC_LAUNCHER} launches",
                                  f"use --backend horovod --launcher {ELASTIC_LAUNCHER} (the default with --elastic)")
            if not 1 <= self.elastic_min_nodes <= self.nodes:
                raise ConfigError(f"--min-nodes {self.elastic_min_nodes} is not within 1..--nodes ({self.nodes})",
                                  "the job asks for --nodes; elastic training goes on down to --min-nodes")
            if self.array:
                raise ConfigError("--elastic with --array is not supported", "submit one elastic job per run")
            if self.elastic_timeout < 1:
                raise ConfigError("--elastic-timeout must be >= 1 second", "e.g. --elastic-timeout 120")
            lo, hi = self.blacklist_cooldown
            if not 0 < lo <= hi:
                raise ConfigError(f"--blacklist-cooldown-range {lo} {hi} is not 0 < MIN <= MAX",
                                  "e.g. --blacklist-cooldown-range 60 300")
        if not _SIGNAL.match(self.signal):
            raise ConfigError(f"--signal {self.signal!r} is not supported", "use USR1 (or B:USR1, USR2, TERM)")
        if self.signal_seconds is not None and not 1 <= self.signal_seconds <= 65535:
            raise ConfigError("--signal-seconds must be in 1..65535", "Slurm sends the signal this early")
        if self.array is not None:
            array_indices(self.array)
        if self.array_params and not self.array:
            raise ConfigError("--array-params needs --array", "add --array 0-(lines-1)")
        for key, _ in self.env:
            check_env_name(key)
        for line in self.extra_sbatch:
            if not _EXTRA.match(line) or "\n" in line:
                raise ConfigError(f"extra #SBATCH line {line!r} is not an option",
                                  "pass one option per --sbatch, e.g. --sbatch=--exclusive")
        for name in ("job_name", "output", "error", "constraint", "mem", "time", "partition",
                     "account", "qos", "array"):
            value = getattr(self, name)
            if value is not None and ("\n" in value or "\r" in value):
                raise ConfigError(f"--{name.replace('_', '-')} contains a newline",
                                  "#SBATCH lines cannot hold one: remove it")

    @property
    def log_path(self) -> str:
        """``--output``, defaulting to ``%x-%j.out`` (``%x-%A_%a.out`` for arrays)."""
        return self.output or ("%x-%A_%a.out" if self.array else "%x-%j.out")

    @property
    def ntasks(self) -> int:
        return self.nodes * self.tasks_per_node


def _context(job: SlurmJob, template: str) -> dict[str, Any]:
    ray = job.launcher == RAY_ENGINE  # one 'ray start' task per node, holding its ranks' CPUs
    iface = Raw(check_iface_name(dict(job.env)[IFACE_VAR])) if IFACE_VAR in dict(job.env) else None
    directives: list[tuple[str, Any]] = [
        ("job-name", job.job_name), ("nodes", job.nodes), ("ntasks-per-node", 1 if ray else job.tasks_per_node),
        ("cpus-per-task", job.cpus_per_task * (job.tasks_per_node if ray else 1)), ("time", job.time),
        ("output", job.log_path),
        ("error", job.error or job.log_path), ("open-mode", "append"),
    ]
    optional = [("gpus-per-node", job.gpus_per_node or None), ("gpus-per-task", job.gpus_per_task),
                ("mem", job.mem), ("partition", job.partition), ("account", job.account),
                ("qos", job.qos), ("constraint", job.constraint), ("array", job.array)]
    directives += [(k, v) for k, v in optional if v is not None]
    if job.signal_seconds:
        # elastic workers are not Slurm steps, and Ray's steps are 'ray start' (which a USR1 would
        # end): only the batch shell (B:) is told, and it passes the signal on
        shell_only = job.elastic_min_nodes or job.launcher == RAY_ENGINE
        sig = f"B:{job.signal}" if shell_only and not job.signal.startswith("B:") else job.signal
        directives.append(("signal", Raw(f"{sig}@{job.signal_seconds}")))
    # explicit both ways: a site's JobRequeue=1 default would requeue a job that has neither
    flags = (["--requeue"] if job.requeue else ["--no-requeue"]) + [Raw(x) for x in job.extra_sbatch]
    env = list(job.env)
    if job.elastic_min_nodes is not None:
        flags.append("--no-kill")  # a failed node must not end the job: the survivors go on
        if job.program[1:4] == ("-m", "hvdkit", "train"):
            env.append((train_env_var("elastic"), "1"))  # not '--elastic': horovodrun would take it
    return {
        "job": job, "version": __version__, "template": template,
        "directives": [(Raw(k), v) for k, v in directives],
        "flags": [Raw(f) if not isinstance(f, Raw) else f for f in flags],
        "exports": [(Raw(k), v) for k, v in env],
        "activate": f"{job.venv.rstrip('/')}/bin/activate" if job.venv else None,
        "gpus": job.gpus_per_node > 0 or bool(job.gpus_per_task),
        "srun_mpi": Raw(job.srun_mpi or traits(job.backend).srun_mpi[0]),
        "launcher": job.launcher,
        "forwarded": [Raw(v) for v in FORWARDED_VARS],
        "master_port_base": MASTER_PORT_BASE, "master_port_span": MASTER_PORT_SPAN,
        "root_mpi_exports": Raw(" ".join(f"{v}=1" for v in ROOT_MPI_VARS)), "stop_file_var": Raw(STOP_FILE_VAR),
        "mpi_defaults": [(Raw(k), _double_quotable(v)) for k, v in MPI_DEFAULTS.items()],
        "mpirun_base": list(MPIRUN_BASE),
        "slots": job.tasks_per_node,  # for the elastic host discovery
        # --engine ray (slurm/ray.sbatch)
        "np": job.ntasks, "node_cpus": job.cpus_per_task * job.tasks_per_node, "node_gpus": job.gpus_per_node,
        "rank_gpus": job.gpus_per_node // job.tasks_per_node if job.gpus_per_node else 0,
        "placement": Raw("spread" if job.tasks_per_node == 1 and job.nodes > 1 else "pack"),
        "iface": iface, "node_ip": Raw(f'ip -4 -o addr show dev {iface} | awk "{{print \\$4}}" | cut -d/ -f1'
                                       if iface else 'getent ahostsv4 "$(hostname)" | awk "NR==1{print \\$1}"'),
        "join_timeout": RAY_JOIN_TIMEOUT_S,
        "sweep_state": _tune_state_pattern(job.ray_sweep_dir) if job.ray_sweep_dir else None,
    }


def _tune_state_pattern(sweep_dir: str) -> str:
    """The glob that matches once the sweep's Tune experiment has a saved state."""
    from ..rayrun.layout import EXPERIMENT, STATE_GLOB, TUNE_DIR

    return f"{sweep_dir.rstrip('/')}/{TUNE_DIR}/{EXPERIMENT}/{STATE_GLOB}"


def render_sbatch(job: SlurmJob, templates: Path | None = None) -> str:
    """The sbatch script for ``job`` (pure: no files written, nothing submitted)."""
    name = "ray.sbatch" if job.launcher == RAY_ENGINE else traits(job.backend).sbatch_template
    return render_template(name, _context(job, name), templates or template_dir())


def submit(script: str, cwd: str | Path | None = None) -> str:
    """Submit ``script`` with ``sbatch --parsable``; return the job id."""
    try:
        proc = subprocess.run(["sbatch", "--parsable"], input=script, text=True, capture_output=True,
                              cwd=cwd, timeout=120, check=False)
    except FileNotFoundError:
        raise HvdkitError("sbatch not found", "run on a Slurm login node, or scripts/local-cluster.sh up") from None
    if proc.returncode != 0:
        detail = (proc.stderr or proc.stdout).strip().splitlines()
        raise HvdkitError(f"sbatch refused the script: {detail[-1] if detail else proc.returncode}",
                          "check partition/account/limits with 'sinfo' and 'sacctmgr show assoc'")
    return proc.stdout.strip().split(";")[0]


def _double_quotable(value: str) -> Raw:
    """A constant of hvdkit's own, written inside double quotes as it is (``"${VAR:-value}"``):
    a value with a character special there would be a defect in hvdkit, not in the input."""
    assert not set(value) & set('"$`\\!'), value
    return Raw(value)
