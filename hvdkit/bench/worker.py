"""Measurements that run inside one multi-process job: ``python -m hvdkit.bench.worker SPEC OUT``.

The suite launches this under ``mpirun``. MPI is initialised first through
mpi4py, so Horovod can be shut down and initialised again with other
settings (fusion threshold, cycle time) in the same processes, and its
background thread is not running while DDP is being measured. DDP's process
group stays up (its threads sleep when idle). Rank 0 writes OUT (JSON).
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from ..backends import Backend, LocalBackend
from ..config import BackendConfig, DDPOptions, HorovodOptions
from ..fileio import write_json_atomic as write_json
from ..models import MODELS, build_model
from .stats import Timer, environment

_DDP: Backend | None = None


def _ddp(opts: DDPOptions) -> Backend:
    """One DDP process group for the whole job; wrap options vary per measurement."""
    global _DDP
    from ..backends.ddp import DDPBackend

    if _DDP is None:
        _DDP = DDPBackend(BackendConfig(name="ddp", ddp=opts))
    _DDP.config = BackendConfig(name="ddp", ddp=opts)
    return _DDP


def _horovod(fusion_mb: float | None, cycle_ms: float | None, reducer: str = "bucketed",
             bucket_mb: float = 25.0) -> Backend:
    """A fresh Horovod init. ``cycle_ms`` must stay None (Horovod's 1 ms) except in a job's
    first init: Horovod 0.28.1 crashes when re-initialised with HOROVOD_CYCLE_TIME set."""
    from ..backends.horovod import HorovodBackend

    return HorovodBackend(BackendConfig(name="horovod", horovod=HorovodOptions(
        fusion_threshold_mb=fusion_mb, cycle_time_ms=cycle_ms, reducer=reducer,
        bucket_cap_mb=bucket_mb)))


def step_times(backend: Backend, model_name: str, batch: int, warmup: int, steps: int,
               comm: Any, cpu: list[float] | None = None) -> list[float]:
    """Seconds per optimizer step (the slowest rank's, step by step), after ``warmup`` steps.

    ``cpu``, when given, receives this process's CPU seconds per timed step (user + system,
    all its threads: Horovod's background thread and gloo's included).
    """
    timer = Timer()
    model = build_model(model_name, seed=0)
    opt: torch.optim.Optimizer = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)
    model, opt = backend.wrap(model, opt)
    backend.broadcast_state(model, opt)
    gen = torch.Generator().manual_seed(comm.Get_rank())
    x = torch.randn((batch, *MODELS[model_name].input_shape), generator=gen).to(backend.device)
    y = torch.randint(0, MODELS[model_name].classes, (batch,), generator=gen).to(backend.device)
    times = []
    for i in range(warmup + steps):
        if i == warmup:
            c0 = time.process_time()
        t0 = timer.now()
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()
        t1 = timer.now()
        if i >= warmup:
            times.append(t1 - t0)
    if cpu is not None:
        cpu.append((time.process_time() - c0) / steps)
    every = comm.allgather(times)
    return [max(col) for col in zip(*every)]


def share_cores(comm: Any) -> int:
    """Give this rank the threads the backends give it (Backend.limit_cpu_threads's rule), so
    that a compute-only floor is measured like the real step, not with torch's default of
    every core per rank. Returns the thread count."""
    import socket

    from ..backends.base import share_node_cores

    return share_node_cores(comm.allgather(socket.gethostname()))


def _measure(variant: dict[str, Any], model: str, batch: int, warmup: int, steps: int, comm: Any) -> list[float]:
    kind = variant["kind"]
    if kind == "compute":  # same work, no communication: the floor for comm share
        share_cores(comm)
        return step_times(LocalBackend(BackendConfig()), model, batch, warmup, steps, comm)
    if kind == "horovod":
        backend = _horovod(variant.get("fusion_mb", 128.0), variant.get("cycle_ms"))
        try:
            return step_times(backend, model, batch, warmup, steps, comm)
        finally:
            backend.shutdown()
    opts = DDPOptions(bucket_cap_mb=variant.get("bucket_mb", 25.0), broadcast_buffers=False)
    return step_times(_ddp(opts), model, batch, warmup, steps, comm)


def run_steps(spec: dict[str, Any], comm: Any) -> dict[str, Any]:
    """Alternate variants A/B/A/B... ``rounds`` times per model; every block's raw step times."""
    out: dict[str, Any] = {"blocks": []}
    for model in spec["models"]:
        for rnd in range(spec["rounds"]):
            for variant in spec["variants"]:
                times = _measure(variant, model, spec["batch"], spec["warmup"], spec["steps"], comm)
                out["blocks"].append({"model": model, "round": rnd, **variant, "step_s": times})
    return out


def run_allreduce(spec: dict[str, Any], comm: Any) -> dict[str, Any]:
    """Seconds per allreduce of each size, Horovod and torch.distributed, plus local memcpy."""
    timer = Timer()
    ddp = _ddp(DDPOptions())
    device = ddp.device
    import socket

    results: dict[str, Any] = {"sizes": spec["sizes"], "horovod": {}, "torch": {}, "memcpy": {}, "mpi": {},
                               "hosts": comm.allgather(socket.gethostname())}
    hvd_backend = _horovod(spec.get("fusion_mb", 128.0), None)
    for size in spec["sizes"]:
        n = max(1, size // 4)
        reps = spec["reps_small"] if size < (4 << 20) else spec["reps_large"]
        t = torch.ones(n, dtype=torch.float32, device=device)
        dst = torch.zeros_like(t)  # allocated and touched once: no page faults in the timing
        samples: dict[str, list[float]] = {"horovod": [], "torch": [], "memcpy": [], "mpi": []}
        host_buf = t.cpu().numpy()
        host_out = host_buf.copy()
        # Like nccl-tests: each sample times `iters` back-to-back operations, so
        # timer resolution and barrier skew do not dominate small messages.
        iters = spec.get("iters_small", 20) if size < (1 << 20) else 1
        for rep in range(reps + 1):  # first repetition is warm-up
            comm.Barrier()
            t0 = timer.now()
            for _ in range(iters):
                hvd_backend.allreduce_(t, name=f"bw.{size}")
            t1 = timer.now()
            comm.Barrier()
            t2 = timer.now()
            for _ in range(iters):
                ddp.allreduce_(t)
            t3 = timer.now()
            t4 = timer.now()
            for _ in range(iters):
                dst.copy_(t)
            t5 = timer.now()
            comm.Barrier()
            t6 = timer.now()
            for _ in range(iters):  # the floor: the MPI library alone, no framework
                comm.Allreduce(host_buf, host_out)
            t7 = timer.now()
            if rep:
                samples["horovod"].append((t1 - t0) / iters)
                samples["torch"].append((t3 - t2) / iters)
                samples["memcpy"].append((t5 - t4) / iters)
                samples["mpi"].append((t7 - t6) / iters)
        for key, vals in samples.items():
            every = comm.allgather(vals)
            results[key][str(size)] = [max(col) for col in zip(*every)]
    hvd_backend.shutdown()
    return results


def mpi_allreduce_times(numel: int, reps: int, comm: Any) -> list[float]:
    """The floor's communication part: ``MPI_Allreduce`` of ``numel`` float32 via mpi4py."""
    import numpy as np
    from mpi4py import MPI

    buf, out = np.ones(numel, dtype=np.float32), np.empty(numel, dtype=np.float32)
    times = []
    for rep in range(reps + 2):          # two warm-ups
        comm.Barrier()
        t0 = time.perf_counter()
        comm.Allreduce(buf, out, op=MPI.SUM)
        if rep >= 2:
            times.append(time.perf_counter() - t0)
    every = comm.allgather(times)
    return [max(col) for col in zip(*every)]


# name: (reducer or "ddp", HOROVOD_CYCLE_TIME ms or None for Horovod's 1 ms)
REDUCER_VARIANTS = {"bucketed": ("bucketed", None), "bucketed-cycle5": ("bucketed", 5.0),
                    "stock": ("stock", None), "ddp": ("ddp", None)}


def run_reducer(spec: dict[str, Any], comm: Any) -> dict[str, Any]:
    """Horovod bucketed vs Horovod stock vs DDP, blocks alternated, plus the same-run floor.

    Every variant runs ``rounds`` blocks of ``steps`` timed steps per model, in rotating
    order (B S D, S D B, D B S, ...) so that drift in the machine hits all alike. The floor
    is a single process doing the same step with no communication (compute), plus an
    MPI_Allreduce of the model's gradient bytes through mpi4py (the wire, no framework).
    """
    import socket

    out: dict[str, Any] = {"blocks": [], "floor": {}, "hosts": comm.allgather(socket.gethostname())}
    out["threads"] = share_cores(comm)
    for model in spec["models"]:
        numel = sum(p.numel() for p in build_model(model).parameters())
        floor: dict[str, Any] = {"compute_s": [], "allreduce_s": [], "grad_bytes": 4 * numel}
        out["floor"][model] = floor
        # the floor's compute is one more variant in the rotation, so drift hits it alike
        names = ["compute", *(v for v in REDUCER_VARIANTS if v in spec.get("variants", REDUCER_VARIANTS))]
        for rnd in range(spec["rounds"]):
            floor["allreduce_s"] += mpi_allreduce_times(numel, max(5, spec["steps"] // 4), comm)
            k = rnd % len(names)
            for variant in names[k:] + names[:k]:
                if variant == "compute":
                    floor["compute_s"] += step_times(LocalBackend(BackendConfig()), model, spec["batch"],
                                                     spec["warmup"], spec["steps"], comm)
                    continue
                reducer, cycle_ms = REDUCER_VARIANTS[variant]
                cpu: list[float] = []
                if reducer == "ddp":
                    backend = _ddp(DDPOptions(bucket_cap_mb=spec["bucket_mb"], broadcast_buffers=False))
                    times = step_times(backend, model, spec["batch"], spec["warmup"], spec["steps"], comm, cpu)
                else:
                    # fusion threshold left at Horovod's default (128 MB >= every bucket here):
                    # a cycle time plus a fusion threshold cannot be re-initialised (0.28.1 crash)
                    backend = _horovod(None, cycle_ms, reducer=reducer, bucket_mb=spec["bucket_mb"])
                    try:
                        times = step_times(backend, model, spec["batch"], spec["warmup"], spec["steps"],
                                           comm, cpu)
                    finally:
                        backend.shutdown()
                out["blocks"].append({"model": model, "round": rnd, "variant": variant, "step_s": times,
                                      "cpu_s_per_step": comm.allgather(cpu[0])})
    return out


EXPERIMENTS = {"steps": run_steps, "allreduce": run_allreduce, "reducer": run_reducer}


def main(argv: list[str]) -> None:
    from mpi4py import MPI  # first: Horovod then neither initialises nor finalises MPI

    spec = json.loads(Path(argv[0]).read_text())
    comm = MPI.COMM_WORLD
    result = EXPERIMENTS[spec["experiment"]](spec, comm)
    if comm.Get_rank() == 0:
        write_json(Path(argv[1]), {"spec": spec, "env": environment(comm.Get_size()), "result": result})
    if _DDP is not None:
        _DDP.shutdown()


if __name__ == "__main__":
    main(sys.argv[1:])
