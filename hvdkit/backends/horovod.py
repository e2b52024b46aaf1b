"""Horovod: ring-allreduce with tensor fusion, via ``hvd.DistributedOptimizer``.

Follows Horovod's ``examples/pytorch``: init, pin the GPU by local rank,
wrap the optimizer with ``named_parameters``, broadcast state from rank 0.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any, TypeVar

import torch
from torch import nn

from ..config import BackendConfig
from ..environments import detect_environment
from ..errors import BackendUnavailableError, ConfigError, HvdkitError, LauncherEnvError
from .base import Backend, ElasticLoop
from .hvd_reducer import bucketed_optimizer
from .powersgd import PowerSGD
from .strategy import Replicated, Strategy, clip_gradients

T = TypeVar("T")

_INITS = 0  # hvd.init() calls in this process

SETUP_HINT = "run ./scripts/setup.sh, which builds Horovod 0.28.1 with PyTorch support (C++17 patch)"


def import_horovod_torch() -> Any:
    """Import ``horovod.torch`` or raise a one-line :class:`BackendUnavailableError`."""
    try:
        import horovod.torch as hvd
    except ImportError as exc:
        detail = str(exc).strip().splitlines()[0] if str(exc).strip() else "import failed"
        raise BackendUnavailableError(
            f"horovod.torch cannot be imported ({detail})", SETUP_HINT
        ) from None
    return hvd


def build_info() -> tuple[str, dict[str, bool]]:
    """Horovod's version and what it was built with (``mpi``, ``gloo``, ``nccl``): for ``hvdkit doctor``.

    Raises :class:`BackendUnavailableError` (an ImportError) when ``horovod.torch`` cannot load.
    """
    hvd = import_horovod_torch()
    import horovod

    return horovod.__version__, {"mpi": bool(hvd.mpi_built()), "gloo": bool(hvd.gloo_built()),
                                 "nccl": bool(hvd.nccl_built())}


class HorovodBackend(Backend):
    """``horovod.torch`` behind the :class:`Backend` interface."""

    name = "horovod"
    PEER_FAILURE_MARKERS = (*Backend.PEER_FAILURE_MARKERS, "Horovod has been shut down")
    PEER_FAILURE_TYPES = ("HorovodInternalError",)
    ADVICE_SUFFIXES = (" This was caused by",)

    def __init__(self, config: BackendConfig) -> None:
        super().__init__(config)
        self.hvd = hvd = import_horovod_torch()
        self._calls = 0
        global _INITS
        env = config.horovod.env_vars()
        merged = {**os.environ, **env}
        if _INITS and "HOROVOD_CYCLE_TIME" in merged and "HOROVOD_FUSION_THRESHOLD" in merged:
            # Measured (2 ranks under mpirun, MPI kept up by mpi4py): Horovod 0.28.1 segfaults
            # when init() runs again in a process with BOTH variables set, even unchanged;
            # either one alone re-initialises fine.
            raise HvdkitError(
                "Horovod 0.28.1 crashes when re-initialised with both HOROVOD_CYCLE_TIME and "
                "HOROVOD_FUSION_THRESHOLD set",
                "set only one of them after the first init in a process (or start a new process)",
            )
        # Fusion threshold, cycle time, timeline and stall checks are read once, by init().
        os.environ.update(env)
        hvd.init()
        _INITS += 1
        self._check_world()
        if torch.cuda.is_available():
            torch.cuda.set_device(hvd.local_rank())
        # horovodrun --min-np/--max-np marks its workers; a newcomer must not start a
        # collective here while the others are busy (run_elastic's sync limits the threads)
        self.elastic = os.environ.get("HOROVOD_ELASTIC") == "1"
        self._elastic_state: Any = None
        if not self.elastic:
            self.limit_cpu_threads()

    def _check_world(self) -> None:
        """Catch the classic 'every rank thinks it is alone' launcher/MPI mismatch."""
        launcher = detect_environment()
        if self.hvd.size() == 1 and launcher.world_size() > 1:
            self.hvd.shutdown()
            raise LauncherEnvError(
                f"{launcher.name} started {launcher.world_size()} processes "
                "but Horovod sees a world of 1",
                "Horovod was built against a different MPI than the launcher, or no controller "
                "ran; launch with 'horovodrun -np N' or mpirun from the MPI Horovod was built with",
            )

    @property
    def rank(self) -> int:
        return int(self.hvd.rank())

    @property
    def size(self) -> int:
        return int(self.hvd.size())

    @property
    def local_rank(self) -> int:
        return int(self.hvd.local_rank())

    def topology(self, hosts: list[str]) -> dict[str, Any]:
        """Adds Horovod's own view: ``cross_size`` (nodes), ``local_size`` (ranks per node)."""
        return {**super().topology(hosts), "reducer": self.reducer, "cross_size": int(self.hvd.cross_size()),
                "local_size": int(self.hvd.local_size()),
                "controller": "mpi" if self.hvd.mpi_enabled() else "gloo"}

    @property
    def reducer(self) -> str:
        """The gradient reducer in use: Adasum reduces tensor by tensor, so it is always stock."""
        return "stock" if self.config.horovod.op == "adasum" else self.config.horovod.reducer

    def replicated(self) -> Strategy:
        return HorovodReplicated(self)

    def slot_host(self) -> str:
        """horovodrun's name for this worker's host (as in -H or the discovery script)."""
        return os.environ.get("HOROVOD_HOSTNAME") or super().slot_host()

    def run_elastic(self, body: Callable[[], T], loop: ElasticLoop) -> T:
        """Horovod Elastic (``hvd.elastic.run``) around ``body``, with ``loop`` as its state.

        Horovod's ``TorchState`` would broadcast the optimizer with a hidden zero-gradient
        step and always from rank 0; the loop's own sync does neither.
        """
        if not self.elastic:
            raise ConfigError("--elastic needs horovodrun's elastic mode (--min-np/--max-np and a "
                              "host discovery script); this process was not started by it",
                              "start it with 'hvdkit run --elastic' or 'hvdkit slurm --elastic'")
        if self.config.horovod.cycle_time_ms is not None:
            raise ConfigError("--cycle-time-ms cannot be combined with --elastic",
                              "Horovod 0.28.1 crashes when re-initialised with HOROVOD_CYCLE_TIME set")
        from horovod.common.elastic import State

        backend = self

        class _State(State):  # type: ignore[misc]
            def save(self) -> None:
                loop.commit_to_memory()

            def restore(self) -> None:
                backend._unsynced = 0  # the interrupted step's micro-batches are rolled back too
                loop.roll_back()

            def sync(self) -> None:
                backend.reset_collective_names()  # every rank counts collectives from here
                backend.limit_cpu_threads()       # the ranks on each node may have changed
                loop.sync()

            def reset(self) -> None:  # the world was re-formed: no handle of the old one survives
                backend.strategy.reset()

        self._elastic_state = _State(bcast_object=self.broadcast_object, get_rank=self.hvd.rank)
        self._elastic_state.register_reset_callbacks([loop.on_reset])
        return self.hvd.elastic.run(lambda _state: body())(self._elastic_state)  # type: ignore[no-any-return]

    def elastic_commit(self) -> None:
        self._elastic_state.commit()

    def profiler_trace_path(self) -> str | None:
        return None  # HOROVOD_TIMELINE, set before hvd.init(), writes Horovod's own timeline

    def reset_collective_names(self) -> None:
        """Restart the name counter; after an elastic reset every rank must agree again."""
        self._calls = 0

    def _name(self, kind: str) -> str:
        # Horovod matches collectives across ranks by name. Its default name for
        # *_object is type(obj).__name__, which differs between the root (a real
        # object) and the receivers (None) and then hangs forever; so every
        # collective gets an explicit name from a counter all ranks advance alike.
        self._calls += 1
        return f"hvdkit.{kind}.{self._calls}"

    def broadcast_object(self, obj: T, root: int = 0) -> T:
        return self.hvd.broadcast_object(obj, root_rank=root, name=self._name("bcast"))  # type: ignore[no-any-return]

    def gather_objects(self, obj: T) -> list[T]:
        return list(self.hvd.allgather_object(obj, name=self._name("gather")))

    def allreduce_tensor(self, tensor: torch.Tensor, op: str = "mean") -> torch.Tensor:
        hvd = self.hvd
        ops = {"mean": hvd.Average, "sum": hvd.Sum, "max": hvd.Max}
        if op not in ops:
            raise ValueError(f"unknown reduce op {op!r}")
        return hvd.allreduce(tensor.detach(), op=ops[op], name=self._name("allreduce"))  # type: ignore[no-any-return]

    def allreduce_(self, tensor: torch.Tensor, name: str | None = None) -> torch.Tensor:
        return self.hvd.allreduce_(tensor, op=self.hvd.Sum, name=name or self._name("allreduce"))  # type: ignore[no-any-return]

    def start_reduce_scatter_mean(self, flat: torch.Tensor, name: str) -> Callable[[], torch.Tensor]:
        handle = self.hvd.reducescatter_async(flat, op=self.hvd.Average, name=f"hvdkit.{name}.rs")
        return lambda: self.hvd.synchronize(handle)  # type: ignore[no-any-return]

    def start_all_gather_flat(self, shard: torch.Tensor, name: str) -> Callable[[], torch.Tensor]:
        handle = self.hvd.allgather_async(shard, name=f"hvdkit.{name}.ag")
        return lambda: self.hvd.synchronize(handle)  # type: ignore[no-any-return]

    def start_allreduce_mean(self, tensor: torch.Tensor, name: str) -> Callable[[], torch.Tensor]:
        handle = self.hvd.allreduce_async(tensor, op=self.hvd.Average, name=f"hvdkit.{name}.ar")
        return lambda: self.hvd.synchronize(handle)  # type: ignore[no-any-return]

    def start_broadcast_(self, tensor: torch.Tensor, root: int, name: str) -> Callable[[], torch.Tensor]:
        handle = self.hvd.broadcast_async_(tensor, root_rank=root, name=f"hvdkit.{name}.bc")
        return lambda: self.hvd.synchronize(handle)  # type: ignore[no-any-return]

    def start_any_flags(self, flags: Sequence[bool | torch.Tensor]) -> Callable[[], list[bool]]:
        handle = self.hvd.allreduce_async(self._flag_tensor(flags), op=self.hvd.Max,
                                          name=self._name("flags"))
        return lambda: [bool(v > 0.5) for v in self.hvd.synchronize(handle).tolist()]

    def barrier(self) -> None:
        self.hvd.barrier()

    def shutdown(self) -> None:
        self.close_strategy()
        if self.hvd.is_initialized():
            self.hvd.shutdown()


class HorovodReplicated(Replicated):
    """``--shard none`` on Horovod: hvdkit's bucketed reducer on Horovod's allreduce (or Horovod's
    own ``DistributedOptimizer``, ``--hvd-reducer stock``, and always for Adasum), fp16
    compression as Horovod's ``Compression.fp16``, PowerSGD as one more collective of the
    bucket engine, Horovod's documented synchronize order, its optimizer broadcast, ``hvd.join``
    and the buckets rebuilt after an elastic reset."""

    def __init__(self, backend: HorovodBackend) -> None:
        super().__init__(backend)
        self.hvd, self.config = backend.hvd, backend.config
        self.reducer = backend.reducer
        self.optimizer: Any = None  # the wrapped optimizer this strategy made

    def wrap(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> tuple[nn.Module, torch.optim.Optimizer]:
        hvd, opts, spec = self.hvd, self.config.horovod, self.config.compression
        compression = hvd.Compression.fp16 if spec.kind == "fp16" else hvd.Compression.none
        op = {"average": hvd.Average, "sum": hvd.Sum, "adasum": hvd.Adasum}[opts.op]
        common = dict(named_parameters=list(model.named_parameters()), compression=compression,
                      backward_passes_per_step=self.config.accumulation_steps, op=op,
                      gradient_predivide_factor=opts.gradient_predivide_factor)
        if spec.kind == "powersgd":  # the config allows it on the bucketed reducer only
            self.powersgd = PowerSGD(spec, {id(p): name for name, p in model.named_parameters()})
        try:
            if self.reducer == "bucketed":
                self.optimizer = bucketed_optimizer(hvd, optimizer, bucket_cap_mb=opts.bucket_cap_mb,
                                                    powersgd=self.powersgd, **common)
            else:
                self.optimizer = hvd.DistributedOptimizer(optimizer, **common)
        except ValueError as exc:
            raise HvdkitError(f"Horovod rejected the optimizer options: {exc}", "see hvdkit train --help") from None
        if optimizer.state:  # Horovod's optimizer is a new instance that starts with no state:
            # carry what the caller's had (a restore before the wrap), as DDP's wrap does
            self.optimizer.load_state_dict(optimizer.state_dict())
        return model, self.optimizer

    def optimizer_step(self, optimizer: torch.optim.Optimizer, scaler: torch.amp.GradScaler | None,
                       clip_grad_norm: float | None) -> float:
        """Horovod's documented order: reduce, then unscale and clip, then step without
        reducing again.

        ``scaler.step()`` or ``clip_grad_norm_`` alone would act on the *local* gradients
        before ``optimizer.step()`` reduces them, and the reduction would then overwrite
        them: with fp16 a step ``scale`` times too large and an inf/NaN check that saw only
        this rank's gradients; with clipping, each rank clipping a different norm and the
        reduced gradient not clipped at all.
        """
        if self.config.horovod.op == "adasum":
            # Adasum reduces the update inside step() (no scaler and no clipping: the config
            # refuses both); its wait cannot be told apart from the local step, so it is not
            # counted in comm_wait
            optimizer.step()
            return 0.0
        # synchronize() explicitly (what step() does first anyway): its wait is the exposed
        # communication, measured for the epoch line
        started = time.perf_counter()
        optimizer.synchronize()  # type: ignore[attr-defined]  # hvd.DistributedOptimizer's
        waited = time.perf_counter() - started
        if scaler is not None:
            scaler.unscale_(optimizer)
        if clip_grad_norm:
            clip_gradients(optimizer, clip_grad_norm)
        with optimizer.skip_synchronize():  # type: ignore[attr-defined]
            if scaler is not None:
                scaler.step(optimizer)
            else:
                optimizer.step()
        if scaler is not None:
            scaler.update()
        return waited

    def broadcast_replicated_optimizer(self, optimizer: torch.optim.Optimizer, root: int) -> None:
        """``hvd.broadcast_optimizer_state``, tensor by tensor, when ``root`` has state.

        It initialises an *empty* state with a zero-gradient step, which moves weights under
        weight decay and creates momentum/step entries a single-process run would not have:
        so it runs only when root really has state (a resume), and the parameters must be
        broadcast after it (``Strategy.broadcast_state`` orders them so).
        """
        root_has_state = self.comm.broadcast_object(
            bool(optimizer.state_dict()["state"]) if self.comm.rank == root else None, root)
        if root_has_state:
            # A rank whose state is empty (a worker that just joined an elastic job)
            # initialises it inside broadcast_optimizer_state with optimizer.step().
            # Horovod skips the gradient allreduce there only for its own optimizer
            # class; without skip_synchronize the bucketed reducer would start bucket
            # allreduces on that rank alone and deadlock the job (seen on a grow). An
            # optimizer this strategy did not wrap reduces nothing in step().
            ours = optimizer is self.optimizer
            with self.optimizer.skip_synchronize() if ours else contextlib.nullcontext():
                self.hvd.broadcast_optimizer_state(optimizer, root_rank=root)

    @contextlib.contextmanager
    def join(self, model: nn.Module) -> Iterator[None]:
        """``hvd.join()`` after the loop: a joined rank sends zeros to every allreduce until the
        last rank joins; ``Average`` still divides by the whole size (measured, 2 ranks)."""
        yield
        self.hvd.join(self.comm.device.index if self.comm.device.type == "cuda" else -1)

    def close(self) -> None:
        """The bucketed reducer's gradient hooks go (Horovod's own optimizer keeps its hooks on
        the gradient accumulators, which it offers no way to remove)."""
        if self.reducer == "bucketed" and self.optimizer is not None:
            self.optimizer.remove_hooks()

    def reset(self) -> None:
        """After an elastic reset: rebuild the buckets (no handle of the old ring survives)."""
        if self.reducer == "bucketed" and self.optimizer is not None:
            self.optimizer.rebuild_buckets()
