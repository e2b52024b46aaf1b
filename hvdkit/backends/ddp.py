"""Native PyTorch ``DistributedDataParallel``, initialised without torchrun.

Rank, world size and rank 0's address come from :mod:`hvdkit.environments`
(Slurm, Open MPI + mpi4py, torchrun-style variables); gloo on CPU, NCCL when
CUDA is available.
"""

from __future__ import annotations

import atexit
import contextlib
import datetime
import gc
import inspect
import time
import weakref
from collections.abc import Callable, Iterator, Sequence
from typing import Any, TypeVar

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from ..config import BackendConfig
from ..environments import ClusterEnvironment, detect_environment
from ..errors import HvdkitError, first_line
from ..log import debug
from .base import Backend
from .comm import to_cpu
from .powersgd import PowerSGD
from .strategy import Replicated, Strategy, local_step

T = TypeVar("T")

# torch 2.13 renamed the per-forward buffer sync flag; use whichever this torch has.
_BUFFER_SYNC_ARG = (
    "forward_sync_buffers"
    if "forward_sync_buffers" in inspect.signature(DistributedDataParallel.__init__).parameters
    else "broadcast_buffers"
)
_REDUCE_OPS = {"sum": dist.ReduceOp.SUM, "mean": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX}


def _when_done(work: Any, result: Callable[[], T]) -> Callable[[], T]:
    """The wait function of an asynchronous torch.distributed ``work``: wait, then ``result()``."""
    def wait() -> T:
        work.wait()
        return result()

    return wait


class DDPBackend(Backend):
    """``torch.distributed`` + ``DistributedDataParallel``."""

    name = "ddp"
    PEER_FAILURE_MARKERS = (*Backend.PEER_FAILURE_MARKERS, "NCCL communicator was aborted",
                            "ProcessGroupGloo::allreduce")
    PEER_FAILURE_TYPES = ("DistBackendError", "DistNetworkError")
    ADVICE_SUFFIXES = (" This is typically caused",)

    def __init__(self, config: BackendConfig, environment: ClusterEnvironment | None = None) -> None:
        super().__init__(config)
        opts = config.ddp
        self.env = environment or detect_environment(opts.environment)
        self._rank, self._size = self.env.global_rank(), self.env.world_size()
        self._local_rank = self.env.local_rank()
        cuda = torch.cuda.is_available()
        self.pg_backend = opts.process_group_backend or ("nccl" if cuda else "gloo")
        if self.pg_backend == "nccl" and not cuda:
            raise HvdkitError(
                "process group backend 'nccl' needs CUDA, and no GPU is visible",
                "use gloo on CPU (the default when no GPU is present)",
            )
        if cuda:
            torch.cuda.set_device(self.device)
        if not dist.is_initialized():
            url = f"tcp://{self.env.main_address}:{self.env.main_port}"
            try:
                dist.init_process_group(
                    self.pg_backend,
                    init_method=url,
                    rank=self._rank,
                    world_size=self._size,
                    timeout=datetime.timedelta(seconds=opts.timeout_s),
                )
            except (RuntimeError, ValueError) as exc:
                first = first_line(exc, limit=None)
                raise HvdkitError(
                    f"DDP rendezvous at {url} failed for rank {self._rank}/{self._size}: {first}",
                    "check that every rank can reach MASTER_ADDR:MASTER_PORT and that all "
                    "ranks were started (raise --ddp-timeout to wait longer)",
                ) from None
        self._owns_group = True
        atexit.register(self.shutdown)  # a script that forgets shutdown() must not abort at exit
        self.limit_cpu_threads()

    @property
    def rank(self) -> int:
        return self._rank

    @property
    def size(self) -> int:
        return self._size

    @property
    def local_rank(self) -> int:
        return self._local_rank

    def topology(self, hosts: list[str]) -> dict[str, Any]:
        """Adds where the ranks met: the launcher environment and rank 0's address."""
        return {**super().topology(hosts), "environment": self.env.name,
                "master_addr": self.env.main_address, "master_port": self.env.main_port,
                "process_group": self.pg_backend}

    def replicated(self) -> Strategy:
        return DDPReplicated(self)

    def broadcast_object(self, obj: T, root: int = 0) -> T:
        box = [obj if self.rank == root else None]
        dev = self.device if self.pg_backend == "nccl" else None
        dist.broadcast_object_list(box, src=root, device=dev)
        return box[0]  # type: ignore[return-value]

    def gather_objects(self, obj: T) -> list[T]:
        out: list[Any] = [None] * self._size
        dist.all_gather_object(out, to_cpu(obj))
        return out

    def allreduce_(self, tensor: torch.Tensor, name: str | None = None) -> torch.Tensor:
        dist.all_reduce(tensor)
        return tensor

    def start_reduce_scatter_mean(self, flat: torch.Tensor, name: str) -> Callable[[], torch.Tensor]:
        out = torch.empty(flat.numel() // self._size, dtype=flat.dtype, device=flat.device)
        # torch 2.13's names (the *_tensor ones warn FutureWarning on every call)
        work = dist.reduce_scatter_single(out, flat, op=dist.ReduceOp.SUM, async_op=True)
        return _when_done(work, lambda: out.div_(self._size))  # gloo has no AVG

    def start_all_gather_flat(self, shard: torch.Tensor, name: str) -> Callable[[], torch.Tensor]:
        out = torch.empty(shard.numel() * self._size, dtype=shard.dtype, device=shard.device)
        work = dist.all_gather_single(out, shard.contiguous(), async_op=True)
        return _when_done(work, lambda: out)

    def start_allreduce_mean(self, tensor: torch.Tensor, name: str) -> Callable[[], torch.Tensor]:
        work = dist.all_reduce(tensor, op=dist.ReduceOp.SUM, async_op=True)
        return _when_done(work, lambda: tensor.div_(self._size))

    def start_broadcast_(self, tensor: torch.Tensor, root: int, name: str) -> Callable[[], torch.Tensor]:
        work = dist.broadcast(tensor, src=root, async_op=True)
        return _when_done(work, lambda: tensor)

    def allreduce_tensor(self, tensor: torch.Tensor, op: str = "mean") -> torch.Tensor:
        if op not in _REDUCE_OPS:
            raise ValueError(f"unknown reduce op {op!r}")
        out = tensor.detach().clone().to(self.device)
        dist.all_reduce(out, op=_REDUCE_OPS[op])
        if op == "mean":
            out /= self._size
        return out.to(tensor.device)

    def start_any_flags(self, flags: Sequence[bool | torch.Tensor]) -> Callable[[], list[bool]]:
        t = self._flag_tensor(flags)
        work = dist.all_reduce(t, op=dist.ReduceOp.MAX, async_op=True)
        return _when_done(work, lambda: [bool(v > 0.5) for v in t.tolist()])

    def barrier(self) -> None:
        if self.pg_backend == "nccl":
            dist.barrier(device_ids=[self.device.index])
        else:
            dist.barrier()

    def _exit_barrier(self) -> None:
        """The last collective. A peer may already be gone without anything lost: Slurm ends a
        requeued job's step as soon as rank 0 has saved and requeued it, so the other ranks can
        be killed before they reach this barrier. That is no error of this run."""
        try:
            self.barrier()
        except RuntimeError as exc:
            if not self.is_peer_failure(exc):
                raise
            debug(f"exit barrier: a peer had gone already ({self.failure_summary(exc)})")

    def shutdown(self) -> None:
        # The strategy holds DDP, whose reducer holds the group's connections. Kept alive (by
        # atexit's reference to this backend, or by the hooks' cycle through C++), they stay
        # open while a rank that failed waits in MPI_Finalize (mpi4py's, at exit), and a peer
        # blocked in a collective with it never hears that it failed: both wait for ever.
        self.close_strategy()
        atexit.unregister(self.shutdown)
        if self._owns_group and dist.is_initialized():
            # DDP's reducer keeps the process group alive; if it is only freed at
            # interpreter exit, gloo's worker thread releases tensors while Python
            # finalises and the process aborts (seen as exit 134 after a clean
            # run). Collect the wrapped model now, let in-flight work drain, and
            # destroy the group while Python is fully alive.
            gc.collect()
            try:
                if not self._aborted:  # a barrier with a dead peer would hang
                    self._exit_barrier()
            finally:
                dist.destroy_process_group()
                gc.collect()
        self._owns_group = False


class DDPReplicated(Replicated):
    """``--shard none`` on DDP: torch's ``DistributedDataParallel`` reducer, its ``no_sync`` and
    ``Join``, fp16 compression as torch's ``fp16_compress_hook``, and PowerSGD as a comm hook on
    DDP's own buckets (:meth:`_powersgd_hook`)."""

    def __init__(self, backend: DDPBackend) -> None:
        super().__init__(backend)
        self.config = backend.config
        self.ddp: DistributedDataParallel | None = None  # the wrapper this strategy made
        self._last_gradient: float | None = None
        self._waited = 0.0  # exposed communication since the last optimizer step
        self._hooks: list[Any] = []
        self._in_flight: list[tuple[Any, torch.futures.Future[torch.Tensor]]] = []  # PowerSGD buckets

    def wrap(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> tuple[nn.Module, torch.optim.Optimizer]:
        opts, device = self.config.ddp, self.comm.device
        self.ddp = ddp = DistributedDataParallel(
            model,
            device_ids=[device.index] if device.type == "cuda" else None,
            bucket_cap_mb=opts.bucket_cap_mb,
            gradient_as_bucket_view=opts.gradient_as_bucket_view,
            static_graph=opts.static_graph,
            find_unused_parameters=opts.find_unused_parameters,
            **{_BUFFER_SYNC_ARG: opts.broadcast_buffers},  # type: ignore[arg-type]
            # no broadcast from rank 0 here: broadcast_state (every backend's one start, from
            # the root it is given, a checkpoint's reader included) follows the wrap; DDP's own
            # would send the whole model once more, and from rank 0 whatever the root
            init_sync=False,
        )
        spec = self.config.compression
        if spec.kind == "fp16":
            from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

            ddp.register_comm_hook(None, default_hooks.fp16_compress_hook)
        elif spec.kind == "powersgd":  # torch's powerSGD_hook's algorithm, issued in one order on every rank
            self.powersgd = PowerSGD(spec, {id(p): name for name, p in model.named_parameters()})
            hook = weakref.WeakMethod(self._powersgd_hook)  # DDP's reducer must not hold this strategy: see close
            ddp.register_comm_hook(None, lambda state, bucket: hook()(state, bucket))  # type: ignore[misc]
        # The time of the last local gradient: DDP's reducer waits for its buckets at the end
        # of backward, so the exposed communication is from then until backward returns.
        self._hooks = [p.register_post_accumulate_grad_hook(self._gradient_ready)
                       for p in model.parameters() if p.requires_grad]
        return ddp, optimizer

    def _gradient_ready(self, _param: torch.Tensor) -> None:
        self._last_gradient = time.perf_counter()

    def close(self) -> None:
        for handle in self._hooks:
            handle.remove()
        self._hooks, self._in_flight = [], []

    def _powersgd_hook(self, state: Any, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        """``register_comm_hook``: one bucket of PowerSGD, every collective started and every
        computation done here, on the autograd thread, in DDP's bucket order.

        Not torch's ``powerSGD_hook`` itself: it starts each bucket's second and third allreduce
        from completion callbacks, so on gloo two buckets' collectives can start in different
        orders on different ranks (seen: ResNet-18 over two nodes died with "Received data size
        doesn't match expected size"). Here the uncompressed part and P start, P (small: n x r
        per matrix) is waited for, and Q starts; the uncompressed parts and the Qs overlap the
        rest of backward. Each bucket is decompressed when the last one has started (DDP starts
        them in order), on this thread: decompressed in a completion callback, on a thread of
        its own next to backward's, the same run gave other bits each time (3 runs, 3 digests;
        the math libraries split work by the threads they find free).
        """
        assert self.powersgd is not None
        if bucket.index() == 0:
            self._in_flight.clear()  # a backward that raised left its buckets behind

        def allreduce_sum(tensor: torch.Tensor, _name: str) -> Any:
            work = dist.all_reduce(tensor, async_op=True)
            return lambda: (work.wait(), tensor)[1]

        step = self.powersgd.start(bucket.index(), bucket.is_last(), bucket.buffer(), bucket.gradients(),
                                   bucket.parameters(), allreduce_sum, self.comm.size)
        step.send_q()  # waits for P, starts Q
        future: torch.futures.Future[torch.Tensor] = torch.futures.Future()
        self._in_flight.append((step, future))
        if bucket.is_last():
            in_flight, self._in_flight = self._in_flight, []
            for started, done in in_flight:
                done.set_result(started.finish())
        return future

    def unwrap(self, model: nn.Module) -> nn.Module:
        return model.module if model is self.ddp else model  # type: ignore[return-value]

    @contextlib.contextmanager
    def accumulate(self, model: nn.Module, sync: bool) -> Iterator[None]:  # type: ignore[override]
        if model is not self.ddp:  # a module this strategy did not wrap: nothing to reduce
            yield
        elif sync:
            self._last_gradient = None
            yield
            if self._last_gradient is not None:  # backward ran: it returned once reduced
                self._waited += time.perf_counter() - self._last_gradient
        else:
            with model.no_sync():  # type: ignore[operator]
                yield

    def optimizer_step(self, optimizer: torch.optim.Optimizer, scaler: torch.amp.GradScaler | None,
                       clip_grad_norm: float | None) -> float:
        """DDP reduced the (scaled) gradients during backward, so the usual order is right:
        ``scaler.unscale_``, ``clip_grad_norm_``, ``scaler.step``/``update``."""
        local_step(optimizer, scaler, clip_grad_norm)
        waited, self._waited = self._waited, 0.0
        return waited

    @contextlib.contextmanager
    def join(self, model: nn.Module) -> Iterator[None]:  # type: ignore[override]
        """``torch.distributed.algorithms.Join``: DDP's join hook shadows the forward buffer
        broadcast and the gradient allreduce of ranks still training; dividing by the initial
        world size (the default) matches Horovod."""
        if model is not self.ddp:
            yield
            return
        from torch.distributed.algorithms.join import Join

        with Join([model], divide_by_initial_world_size=True):
            yield


# DDP checks a comm hook's annotations against the real classes; this module's are strings
DDPReplicated._powersgd_hook.__annotations__.update(bucket=dist.GradBucket,
                                                    **{"return": torch.futures.Future[torch.Tensor]})
