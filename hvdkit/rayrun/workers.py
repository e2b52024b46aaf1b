"""One rank per Ray worker: Horovod through ``horovod.ray.RayExecutor``, DDP through a worker
group of the same shape; each worker runs its rank as a child process and relays its lines.

Why a child process, as under horovodrun, mpirun and srun: the rank is the same ``hvdkit
train`` (or the user's own program) with the same signals, exit codes and preemption, and a
Ray worker that dies takes its rank with it (``PR_SET_PDEATHSIG``), never leaving an orphan.

Why not Ray Train's ``TorchTrainer`` for DDP: it creates its own process group inside the
worker and owns checkpointing and restarts. hvdkit's DDP backend meets rank 0 itself from
``RANK``/``WORLD_SIZE``/``MASTER_ADDR`` (hvdkit.environments), as under torchrun, and rank 0's
HDF5 checkpoints already restart a run; a second group and a second checkpoint store would
only disagree with them. The worker group here is Ray's own parts: a placement group
(``PACK`` or ``STRICT_SPREAD``) and one actor per bundle.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from ..backends.traits import traits
from ..errors import ConfigError
from .cluster import PLACEMENTS, RaySpec

__all__ = ["run_rank", "run_job", "ray_backend", "PYTHON"]

PYTHON = "{python}"  # in a program: the worker's own interpreter (the same venv on every node)
RELAYED_SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2, signal.SIGINT)


def _die_with_parent() -> None:
    """In the child, before exec: SIGKILL when the worker that started it dies."""
    import ctypes

    ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def run_rank(program: Sequence[str], env: Mapping[str, str], cwd: str, rank: int | None, relay: Any) -> int:
    """Run one rank's ``program`` in this Ray worker; lines and signals go through ``relay``.

    ``rank`` None: Horovod's runner set ``HOROVOD_RANK`` in this worker. Returns the exit code.
    """
    import tempfile

    import ray

    from ..launch.vocabulary import STOP_FILE_VAR
    from ..preemption import REQUEUE_SIGNALS

    rank = int(os.environ["HOROVOD_RANK"]) if rank is None else rank
    argv = [sys.executable if a == PYTHON else a for a in program]
    # hvdkit train takes a preemption as a file on its node, looked for at each step: a rank
    # still starting up has no handler yet, and a signal would kill it (exit -10, no checkpoint)
    stop = Path(tempfile.gettempdir()) / f"hvdkit-stop-{os.getpid()}-{rank}" if _is_hvdkit_train(program) else None
    extra = {STOP_FILE_VAR: str(stop)} if stop is not None else {}
    proc = subprocess.Popen(argv, env={**os.environ, **env, **extra}, cwd=cwd, text=True, bufsize=1,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, preexec_fn=_die_with_parent)
    lines: list[tuple[int, str, str]] = []
    lock = threading.Lock()

    def pump(stream: Any, name: str) -> None:
        for line in stream:
            with lock:
                lines.append((rank, name, line))

    pumps = [threading.Thread(target=pump, args=(proc.stdout, "stdout"), daemon=True),
             threading.Thread(target=pump, args=(proc.stderr, "stderr"), daemon=True)]
    for t in pumps:
        t.start()
    seen = 0

    def exchange() -> list[int]:
        """One round trip: this rank's new lines out, the driver's new signals in."""
        with lock:
            batch = lines[:]
            lines.clear()
        return ray.get(relay.exchange.remote(batch, seen))

    while proc.poll() is None:
        time.sleep(0.2)
        signals = exchange()
        for sig in signals:
            if stop is not None and sig in REQUEUE_SIGNALS:
                stop.touch()
            else:
                proc.send_signal(sig)
        seen += len(signals)
    for t in pumps:
        t.join()
    exchange()
    if stop is not None:
        stop.unlink(missing_ok=True)
    return int(proc.returncode)


def _is_hvdkit_train(program: Sequence[str]) -> bool:
    """``python -m hvdkit train ...``: the ranks read ``$HVDKIT_STOP_FILE``."""
    return any(list(program[i:i + 3]) == ["-m", "hvdkit", "train"] for i in range(len(program)))


class _Relay:
    """The driver's mailbox: lines from every rank, signals for every rank."""

    def __init__(self) -> None:
        self._lines: list[tuple[int, str, str]] = []
        self._signals: list[int] = []

    def exchange(self, batch: list[tuple[int, str, str]], since: int) -> list[int]:
        """A rank's lines in; the signals it has not seen yet out."""
        self._lines.extend(batch)
        return self._signals[since:]

    def pull(self) -> list[tuple[int, str, str]]:
        out, self._lines = self._lines, []
        return out

    def signal(self, sig: int) -> None:
        self._signals.append(sig)



class _RankWorker:
    """A DDP rank's Ray worker (Horovod's are horovod.ray's BaseHorovodWorker)."""

    def where(self) -> tuple[str, str, int]:
        import ray

        from ..environments import find_free_port

        return ray.get_runtime_context().get_node_id(), ray.util.get_node_ip_address(), find_free_port()

    def run(self, program: Sequence[str], env: Mapping[str, str], cwd: str, rank: int, relay: Any) -> int:
        return run_rank(program, env, cwd, rank, relay)


def _outside_placement_group() -> dict[str, Any]:
    """Options that keep a helper actor out of an enclosing (Tune trial's) placement group."""
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    return {"num_cpus": 0,
            "scheduling_strategy": PlacementGroupSchedulingStrategy(placement_group=None)}  # type: ignore[arg-type]


class _HorovodGroup:
    """Horovod's own Ray runner: rendezvous, host ranks and NIC detection are Horovod's."""

    def __init__(self, spec: RaySpec, env: Mapping[str, str]) -> None:
        from horovod.ray import RayExecutor

        # nics: Horovod otherwise probes every interface between the nodes to pick one
        settings = RayExecutor.create_settings(timeout_s=60, placement_group_timeout_s=60,
                                               nics={spec.iface} if spec.iface else None)
        shape = ({"num_hosts": spec.np, "num_workers_per_host": 1} if spec.placement == "spread"
                 else {"num_workers": spec.np})
        self.executor = RayExecutor(settings, cpus_per_worker=max(1, int(spec.cpus_per_task)),
                                    use_gpu=spec.gpus_per_task > 0, gpus_per_worker=int(spec.gpus_per_task) or None,
                                    **shape)
        self.executor.start(extra_env_vars=dict(env))

    def launch(self, program: Sequence[str], cwd: str, relay: Any) -> list[Any]:
        return self.executor.run_remote(run_rank, args=[list(program), {}, cwd, None, relay])

    def stop(self) -> None:
        import ray

        for worker in self.executor.adapter.workers:
            ray.kill(worker)
        self.executor.shutdown()


class _DDPGroup:
    """A placement group and one actor per rank; rank 0's node and a free port are MASTER_*."""

    def __init__(self, spec: RaySpec, env: Mapping[str, str]) -> None:
        import ray
        from ray.util.placement_group import get_current_placement_group, placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        self.spec, self.env = spec, dict(env)
        current: Any = get_current_placement_group()  # a Tune trial's, which reserved the ranks
        self.own = current is None
        self.pg: Any = placement_group([spec.bundle] * spec.np, strategy=PLACEMENTS[spec.placement]) \
            if self.own else current
        if self.own:
            ray.get(self.pg.ready(), timeout=60)
        remote = ray.remote(_RankWorker)
        self.actors: list[Any] = [
            remote.options(num_cpus=spec.cpus_per_task, num_gpus=spec.gpus_per_task,
                           scheduling_strategy=PlacementGroupSchedulingStrategy(
                               self.pg, placement_group_bundle_index=i if self.own else -1)).remote()
            for i in range(spec.np)]
        self.where = ray.get([a.where.remote() for a in self.actors])

    def launch(self, program: Sequence[str], cwd: str, relay: Any) -> list[Any]:
        nodes = [node for node, _, _ in self.where]
        _, master, port = self.where[0]
        refs = []
        for rank, actor in enumerate(self.actors):
            env = {**self.env, "RANK": str(rank), "WORLD_SIZE": str(self.spec.np),
                   "LOCAL_RANK": str(nodes[:rank].count(nodes[rank])), "MASTER_ADDR": master,
                   "MASTER_PORT": str(port)}
            refs.append(actor.run.remote(list(program), env, cwd, rank, relay))
        return refs

    def stop(self) -> None:
        import ray
        from ray.util.placement_group import remove_placement_group

        for actor in self.actors:
            ray.kill(actor)
        if self.own:
            remove_placement_group(self.pg)


def ray_backend(backend: str) -> str:
    """``backend`` if Ray can start its ranks, else a one-line ConfigError."""
    if traits(backend, launched=True).ray_runner is None:
        raise ConfigError(f"the {backend} backend cannot run on Ray", "use --backend horovod or ddp")
    return backend


def _group(backend: str, spec: RaySpec, env: Mapping[str, str]) -> Any:
    """Horovod's runner where the backend meets over Horovod, a DDP worker group otherwise."""
    runner = traits(ray_backend(backend)).ray_runner
    return _HorovodGroup(spec, env) if runner == "horovod.ray" else _DDPGroup(spec, env)


def run_job(spec: RaySpec, backend: str, program: Sequence[str], env: Mapping[str, str], console: Any,
            grace_s: float = 20.0, poll: Callable[[], list[int]] | None = None, cwd: str | None = None) -> int:
    """Run ``program`` on ``spec.np`` ranks of the connected cluster; lines go to ``console``
    (a :class:`hvdkit.launch.output.ConsoleLog`). Signals this process gets (TERM, USR1, USR2,
    INT) reach every rank, and so do those ``poll`` returns (asked every 0.2 s: a Tune trial,
    which runs outside the main thread, learns of a preemption that way). When a rank fails,
    the others have ``grace_s`` to end on their own (hvdkit's ranks notice a lost peer), then
    their workers are killed. The ranks start in ``cwd`` (default: this process's). Returns the
    exit code: the first rank's that failed, else 0."""
    import ray

    from ..faults import hold_point
    from ..preemption import EXIT_PREEMPTED, pending_stop

    caught: list[int] = []
    previous = {}
    if threading.current_thread() is threading.main_thread():
        for sig in RELAYED_SIGNALS:
            previous[sig] = signal.signal(sig, lambda s, _f: caught.append(s))
    hold_point("launch")  # a fault lands here: the handlers are in place, no rank started
    if pending_stop() is not None or caught:  # a preemption before any rank started: start none
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        console.not_started()
        return EXIT_PREEMPTED
    relay: Any = ray.remote(_Relay).options(**_outside_placement_group()).remote()
    group = _group(backend, spec, env)
    refs = group.launch(program, cwd or os.getcwd(), relay)
    rank_of = {ref: i for i, ref in enumerate(refs)}
    codes: dict[int, int] = {}
    failed_at: float | None = None
    pending = list(refs)

    def drain() -> None:
        for rank, stream, line in ray.get(relay.pull.remote()):
            console.feed(f"[{rank}]<{stream}>:{line}")

    try:
        while pending:
            done, pending = ray.wait(pending, num_returns=len(pending), timeout=0.2)
            drain()
            caught.extend(poll() if poll is not None else ())
            while caught:
                relay.signal.remote(caught.pop(0))
            for ref in done:
                try:
                    codes[rank_of[ref]] = int(ray.get(ref))
                except ray.exceptions.RayError as exc:  # the worker itself died (node lost, OOM, killed)
                    first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
                    console.feed(f"Error: rank {rank_of[ref]}'s Ray worker died: {first}\n")
                    codes[rank_of[ref]] = 1
                if codes[rank_of[ref]] != 0 and failed_at is None:
                    failed_at = time.monotonic()
            if pending and failed_at is not None and time.monotonic() - failed_at > grace_s:
                break  # the rest are stuck with a dead peer: group.stop() ends them
        drain()
    finally:
        group.stop()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        ray.kill(relay)
    bad = [codes[r] for r in sorted(codes) if codes[r] != 0]
    return bad[0] if bad else (0 if len(codes) == spec.np else 1)
