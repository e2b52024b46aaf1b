"""Which Ray cluster a run uses, what it refuses before starting, and the connection.

No address: an embedded Ray instance on this machine for the run's lifetime (token
authentication with a token of its own, dashboard off, started and stopped by this process).
``--ray-address`` (or ``RAY_ADDRESS``): an existing cluster, probed over TCP within
``CONNECT_TIMEOUT_S`` first, because ``ray.init`` itself waits far longer on an address nobody
answers, then asked how it authenticates (:mod:`hvdkit.rayrun.auth`).
"""

from __future__ import annotations

import contextlib
import math
import os
import re
import socket
import sys
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass

from ..errors import ConfigError
from .auth import join_env, own_cluster_env

__all__ = ["RaySpec", "PLACEMENTS", "require_ray", "probe_address", "connect", "check_fits", "worker_env",
           "wait_for_nodes", "RayStep", "ray_log_cause", "CONNECT_TIMEOUT_S"]

# pack: as few nodes as possible (Ray's PACK); spread: one rank per node (STRICT_SPREAD), the
# layout of one rank per GPU node
PLACEMENTS = {"pack": "PACK", "spread": "STRICT_SPREAD"}
CONNECT_TIMEOUT_S = 30.0
RAY_EXTRA = "pip install 'hvdkit[ray]' (./scripts/setup.sh installs it)"


@dataclass(frozen=True)
class RaySpec:
    """Where and how the ranks of one run go on Ray."""

    np: int = 2
    address: str | None = None      # None: an embedded local instance
    placement: str = "pack"         # pack | spread (PLACEMENTS)
    cpus_per_task: float = 1.0
    gpus_per_task: float = 0.0
    iface: str | None = None        # --iface: the interface Gloo, NCCL and Horovod's rendezvous use
    forward: tuple[str, ...] = ()   # -x NAME: more of this shell's variables for the ranks

    def __post_init__(self) -> None:
        if self.np < 1:
            raise ConfigError(f"-np must be >= 1, got {self.np}", "start at least one rank")
        if self.placement not in PLACEMENTS:
            raise ConfigError(f"--ray-placement {self.placement!r} is not known",
                              f"use one of: {', '.join(PLACEMENTS)}")
        for name, value in (("--cpus-per-task", self.cpus_per_task), ("--gpus-per-task", self.gpus_per_task)):
            if not value >= 0 or value == float("inf"):
                raise ConfigError(f"{name} must be a finite number >= 0, got {value}", f"e.g. {name} 1")

    @property
    def bundle(self) -> dict[str, float]:
        """One rank's resources, as a placement-group bundle."""
        return {"CPU": self.cpus_per_task, **({"GPU": self.gpus_per_task} if self.gpus_per_task else {})}


def require_ray() -> None:
    """Ray installed, or one line naming the extra. Found without importing it: Ray reads its
    authentication mode once, at import, and :func:`connect` sets it first."""
    import importlib.util

    if importlib.util.find_spec("ray") is None:
        raise ConfigError("Ray is not installed in this environment", RAY_EXTRA)


def probe_address(address: str, timeout: float = CONNECT_TIMEOUT_S, source: str = "--ray-address") -> dict[str, str]:
    """A TCP connection to the cluster's GCS at ``address`` (host:port) within ``timeout`` s,
    then how to join it: the ``RAY_AUTH_*`` variables to set before Ray is imported
    (:func:`hvdkit.rayrun.auth.join_env`; a missing or wrong token is one line). ``source``:
    where the address came from (the option, or RAY_ADDRESS), as every message names it."""
    if address.startswith("ray://"):
        raise ConfigError(f"{source} {address}: Ray Client (ray://) is not supported",
                          "give the head's GCS address host:6379, from a machine of the cluster")
    host, _, port = address.rpartition(":")
    if not host or not re.fullmatch(r"[0-9]{1,5}", port) or not 0 < int(port) < 65536:
        example = f"{source}=node1:6379" if source.isupper() else f"{source} node1:6379"  # a variable, or the option
        raise ConfigError(f"{source} {address!r} is not host:port", f"e.g. {example}")
    try:
        socket.create_connection((host, int(port)), timeout=timeout).close()
    except (OSError, UnicodeError) as exc:
        raise ConfigError(f"no Ray cluster answers at {address} ({source}: "
                          f"{getattr(exc, 'strerror', None) or exc})",
                          "check the address 'ray start --head' printed, or leave it out to start a local "
                          "instance") from None
    return join_env(address)


def worker_env(extra: Mapping[str, str], environ: Mapping[str, str] | None = None,
               forward: Sequence[str] = ()) -> dict[str, str]:
    """What the ranks inherit from this shell: mpirun's forwarded variables, hvdkit's own, and
    those named by ``forward`` (``-x NAME``, as mpirun's).

    Ray workers start from the raylet's environment, not this shell's, so what a rank needs
    is passed on explicitly, from the same list ``mpirun -x`` uses (launch.vocabulary).
    """
    from ..launch.vocabulary import FORWARDED_VARS

    environ = os.environ if environ is None else environ
    keep = {k: v for k, v in environ.items()
            if k in FORWARDED_VARS or k in forward or k.startswith(("HVDKIT_", "ONEDNN_", "ATEN_", "OMP_", "MKL_"))}
    return {**keep, **dict(extra)}


@contextlib.contextmanager
def connect(spec: RaySpec, extra_cpus: float = 0.0) -> Iterator[None]:
    """ray.init for the run's lifetime: the cluster at ``spec.address``, or an embedded instance
    (with ``extra_cpus`` beyond the ranks': a Tune trial's own share)."""
    require_ray()
    # Ray reads its authentication mode at import: set first. A cluster of this process's own
    # gets a token of its own (never written to ~/.ray); a cluster joined, the way it runs.
    os.environ.update(probe_address(spec.address) if spec.address else own_cluster_env())
    import ray

    kwargs: dict = {"include_dashboard": False, "log_to_driver": False, "logging_level": "ERROR",
                    "configure_logging": True}
    own_dir = None
    if spec.address:
        ray.init(address=spec.address, **kwargs)
    else:
        # an embedded instance: as many CPUs as the ranks ask for where this machine has fewer,
        # as hvdkit run oversubscribes mpirun automatically. Its session files (50-260 of them,
        # /tmp/ray/session_* by default) go to a directory of the run's own, removed at the end
        # unless Ray itself failed (then its logs are the evidence, and the path is said)
        import tempfile

        # where Ray's own default is (/tmp, or RAY_TMPDIR): its socket paths must stay short
        own_dir = tempfile.mkdtemp(prefix="hvdkit-ray-", dir=os.environ.get("RAY_TMPDIR") or "/tmp")
        cpus = max(os.cpu_count() or 1, math.ceil(spec.np * spec.cpus_per_task + extra_cpus))
        try:
            ray.init(address="local", num_cpus=cpus, _temp_dir=own_dir, **kwargs)
        except BaseException:
            _keep_or_remove(own_dir, keep=True)
            raise
    failed = True
    try:
        yield
        failed = False
    except ConfigError:  # a refusal (check_fits, ...): nothing of Ray's to look at
        failed = False
        raise
    finally:
        ray.shutdown()
        if own_dir is not None:
            _keep_or_remove(own_dir, keep=failed)


def _keep_or_remove(path: str, keep: bool) -> None:
    """The embedded instance's session directory: kept (and named on stderr) or removed."""
    import shutil

    if keep:
        sys.stderr.write(f"[hvdkit] Ray's session files of this run are kept in {path}\n")
    else:
        shutil.rmtree(path, ignore_errors=True)


def check_fits(spec: RaySpec, what: str = "the run", extra_cpus: float = 0.0) -> None:
    """Refuse, in one line, ranks the connected cluster can never place (Ray would wait forever)."""
    import ray

    nodes = [n for n in ray.nodes() if n.get("Alive")]
    total: dict[str, float] = {}
    for n in nodes:
        for key, value in n.get("Resources", {}).items():
            total[key] = total.get(key, 0.0) + value
    need = {k: v * spec.np + (extra_cpus if k == "CPU" else 0) for k, v in spec.bundle.items()}
    short = [f"{v:g} {k} (cluster has {total.get(k, 0):g})" for k, v in need.items() if total.get(k, 0) < v]
    if short:
        raise ConfigError(f"{what} needs {', '.join(short)}: Ray would wait for them forever",
                          "lower -np or --cpus-per-task/--gpus-per-task, or add nodes to the cluster")
    if spec.placement == "spread":
        fit = [n for n in nodes if all(n.get("Resources", {}).get(k, 0) >= v for k, v in spec.bundle.items())]
        if len(fit) < spec.np:
            raise ConfigError(f"--ray-placement spread puts one rank per node, and only {len(fit)} of the "
                              f"cluster's {len(nodes)} node(s) can hold one of the {spec.np} ranks",
                              "use --ray-placement pack, or add nodes")


@dataclass(frozen=True)
class RayStep:
    """One node's ``ray start --block`` job step, as the job script started it."""

    node: str
    pid: int   # the srun (or nsenter) process of the step, a child of the job script
    log: str   # where the step's output goes


def _step_ended(pid: int) -> bool:
    """True when ``pid`` is gone, or a zombie its parent (the job script, busy waiting for this
    process) has not reaped yet."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()[0] == "Z"
    except OSError:
        return True


def ray_log_cause(log: str, lines: int = 40) -> str:
    """The line of a Ray log that says why it stopped: the last exception or error line of its
    tail, else its last line."""
    try:
        with open(log, errors="replace") as f:
            tail = [ln.strip() for ln in f.read().splitlines()[-lines:] if ln.strip()]
    except OSError as exc:
        return f"(no log: {exc.strerror or exc})"
    for line in reversed(tail):
        head = line.split(":", 1)[0]
        if head.endswith(("Error", "Exception", "Exit")) or line.startswith(("Error", "error")):
            return line[:300]
    return tail[-1][:300] if tail else "(the log is empty)"


def _check_steps(steps: Sequence[RayStep], address: str) -> None:
    """Exit with one line when a node's Ray step has ended: nothing will join from there."""
    for step in steps:
        if _step_ended(step.pid):
            sys.exit(f"Error: Ray on {step.node} exited before the cluster at {address} formed: "
                     f"{ray_log_cause(step.log)} (its whole log: {step.log})")


def wait_for_nodes(address: str, nodes: int, timeout_s: float, steps: Sequence[RayStep] = ()) -> None:
    """Until ``nodes`` Ray nodes are alive at ``address`` (the cluster's own count, polled), or
    exit with one line after ``timeout_s``, or as soon as one of the ``steps`` that start the
    nodes has ended: what a job script runs instead of ``sleep``."""
    import logging
    import time

    deadline = time.monotonic() + timeout_s
    host, _, port = address.rpartition(":")
    while True:
        _check_steps(steps, address)
        try:
            socket.create_connection((host, int(port)), timeout=2).close()
            break
        except OSError:
            if time.monotonic() > deadline:
                sys.exit(f"Error: no Ray head answered at {address} within {timeout_s:.0f} s")
            time.sleep(0.5)
    try:
        os.environ.update(join_env(address))
    except ConfigError as exc:
        sys.exit(f"Error: {exc}")
    import ray

    ray.init(address=address, logging_level=logging.ERROR, log_to_driver=False, configure_logging=True)
    try:
        while (alive := sum(1 for n in ray.nodes() if n.get("Alive"))) < nodes:
            _check_steps(steps, address)
            if time.monotonic() > deadline:
                sys.exit(f"Error: {alive} of {nodes} Ray nodes joined {address} within {timeout_s:.0f} s")
            time.sleep(0.5)
    finally:
        ray.shutdown()


USAGE = "usage: python -m hvdkit.rayrun.cluster wait ADDRESS NODES TIMEOUT_S [--watch NODE PID LOG]..."


def _main(argv: Sequence[str]) -> None:
    """``wait ADDRESS NODES TIMEOUT_S [--watch NODE PID LOG]...`` (slurm/ray.sbatch,
    scripts/local-cluster.sh ray-up)."""
    if len(argv) < 4 or argv[0] != "wait" or (len(argv) - 4) % 4:
        sys.exit(USAGE)
    rest = argv[4:]
    steps = []
    for i in range(0, len(rest), 4):
        flag, node, pid, log = rest[i:i + 4]
        if flag != "--watch" or not pid.isdigit():
            sys.exit(USAGE)
        steps.append(RayStep(node, int(pid), log))
    wait_for_nodes(argv[1], int(argv[2]), float(argv[3]), steps)


if __name__ == "__main__":
    _main(sys.argv[1:])
