"""The one interface every backend implements, so the training loop never branches on backend."""

from __future__ import annotations

import contextlib
import os
import re
import socket
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Iterator, Sequence, Sized
from typing import Any, Protocol, TypeVar

import torch
from torch import nn

from ..config import BackendConfig
from ..environments import usable_cores
from ..errors import ConfigError, HvdkitError
from .fsdp import FullyShardedParallelism
from .parallelism import Parallelism, Replicated, to_cpu
from .powersgd import PowerSGD
from .zero import ZeroParallelism

__all__ = ["Backend", "ElasticLoop", "share_node_cores", "to_cpu", "clip_gradients"]

T = TypeVar("T")


def clip_gradients(optimizer: torch.optim.Optimizer, max_norm: float) -> torch.Tensor:
    """``clip_grad_norm_`` over every parameter the optimizer updates; returns the norm before."""
    params = [p for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
    return torch.nn.utils.clip_grad_norm_(params, max_norm)


# --shard's values and the strategy each chooses (hvdkit.backends.parallelism)
PARALLELISMS: dict[str, type[Parallelism]] = {cls.shard: cls for cls in (Replicated, ZeroParallelism,
                                                                          FullyShardedParallelism)}


def share_node_cores(hosts: list[str]) -> int:
    """Set torch's threads to this node's cores over its ranks, unless ``OMP_NUM_THREADS`` is set.

    ``hosts`` is every rank's hostname (gathered by the caller); the ranks on this host share
    its cores. Returns the thread count in use.
    """
    if "OMP_NUM_THREADS" not in os.environ:
        per_node = max(1, hosts.count(socket.gethostname()))
        torch.set_num_threads(max(1, usable_cores() // per_node))
    return torch.get_num_threads()


class ElasticLoop(Protocol):
    """What an elastic backend needs from the training loop's state."""

    def commit_to_memory(self) -> None:
        """Copy the state to host memory."""

    def roll_back(self) -> None:
        """Return to the last copy (a collective failed: a worker was lost)."""

    def sync(self) -> None:
        """Collective: every rank takes the newest state (after a start or a reset)."""

    def on_reset(self) -> None:
        """The world changed; called after the backend re-formed it, before :meth:`sync`."""


class Backend(ABC):
    """Data-parallel backend: a communicator (process identity and collectives) holding the
    parallelism that ``wrap`` chooses (:mod:`hvdkit.backends.parallelism`).

    Lifecycle: construct (initialises the communication library), ``wrap`` the
    model and optimizer once, ``broadcast_state`` from rank 0, train, ``shutdown``.
    A subclass implements the collectives and the replicated primitives (``wrap_replicated``,
    and where its library differs ``accumulate_replicated``, ``step_replicated``,
    ``broadcast_replicated_optimizer``, ``broadcast_parameters``).
    """

    name: str = "base"

    def __init__(self, config: BackendConfig) -> None:
        self.config = config
        self._aborted = False
        # Seconds this process's training thread has waited for reduced gradients: the part of
        # communication that compute did not hide (the loop reports it per epoch as a share).
        self.comm_wait = 0.0
        self._unsynced = 0  # micro-batches since the last sync=True (see accumulate)
        self.parallelism: Parallelism = Replicated(self)  # chosen again, from config.shard, in wrap()
        self.powersgd: PowerSGD | None = None  # set by wrap_replicated with --compression powersgd

    @property
    def comm_wait_measured(self) -> bool:
        """False where the wait cannot be told apart from compute (FSDP2 waits inside
        backward): the epoch line then says "not measured" instead of a 0% that would be a guess."""
        return self.parallelism.comm_wait_measured

    @property
    def bucket_cap_mb(self) -> float:
        """``--bucket-cap-mb`` from this backend's own options (ZeRO's buckets use it too)."""
        return self.config.bucket_cap_mb

    # -- identity ---------------------------------------------------------------
    @property
    @abstractmethod
    def rank(self) -> int:
        """Global rank: gate every side effect (printing, files) on ``rank == 0``."""

    @property
    @abstractmethod
    def size(self) -> int:
        """World size."""

    @property
    @abstractmethod
    def local_rank(self) -> int:
        """Rank on this node; used only to pick the GPU."""

    @property
    def is_master(self) -> bool:
        """True on global rank 0."""
        return self.rank == 0

    @property
    def device(self) -> torch.device:
        """``cuda:<local_rank>`` when CUDA is available, else CPU."""
        if torch.cuda.is_available():
            return torch.device("cuda", self.local_rank % torch.cuda.device_count())
        return torch.device("cpu")

    def limit_cpu_threads(self) -> int:
        """Share this node's cores among its ranks (unless ``OMP_NUM_THREADS`` is set).

        torch defaults every process to all cores; with N ranks per node plus
        Horovod's polling thread that oversubscribes the CPU and was measured
        to slow a 2-rank CPU run down 50x. Returns the thread count in use.
        """
        hosts = self.gather_objects(socket.gethostname())
        if self.device.type == "cpu":
            share_node_cores(hosts)
        return torch.get_num_threads()

    # -- model ------------------------------------------------------------------
    def wrap(
        self, model: nn.Module, optimizer: torch.optim.Optimizer
    ) -> tuple[nn.Module, torch.optim.Optimizer]:
        """Move ``model`` to :attr:`device`, choose the parallelism from ``config.shard`` (once)
        and let it make the gradients data-parallel."""
        self.parallelism = PARALLELISMS[self.config.shard](self)
        return self.parallelism.wrap(model.to(self.device), optimizer)

    def wrap_replicated(
        self, model: nn.Module, optimizer: torch.optim.Optimizer
    ) -> tuple[nn.Module, torch.optim.Optimizer]:
        """Replicated: this backend's own reducer (DDP's wrapper, Horovod's optimizer)."""
        return model, optimizer

    def unwrap(self, model: nn.Module) -> nn.Module:
        """The plain module inside whatever ``wrap`` returned (for ``state_dict``)."""
        return model

    def sync_buffers(self, model: nn.Module, root: int = 0) -> None:
        """Every rank takes ``root``'s buffers (BatchNorm running statistics).

        Training never syncs them (Horovod) or syncs them only at the start of each forward
        pass (DDP's ``broadcast_buffers``), so after a step they differ by rank. They matter
        only in eval mode: evaluation and the checkpoint use rank 0's, as DDP would.
        """
        for buffer in self.unwrap(model).buffers():
            theirs: torch.Tensor = self.broadcast_object(buffer.detach().cpu() if self.rank == root else None, root)  # type: ignore[assignment]
            buffer.copy_(theirs)

    def eval_module(self, model: nn.Module) -> nn.Module:
        """What held-out evaluation runs: the plain module (no gradient hooks, no collective)."""
        return self.unwrap(model)

    def eval_batches(self, loader: Iterable[Any], shard: Sized) -> Iterator[tuple[Any, int]]:
        """This rank's evaluation batches with their weight (1 each; FSDP, whose forward pass
        is collective, pads so that every rank runs as many)."""
        return self.parallelism.eval_batches(loader, shard)

    # -- state, as checkpoints and elastic commits see it (hvdkit.state) --------------------
    def module_state_dict(self, model: nn.Module) -> dict[str, Any]:
        """The whole model's ``state_dict`` (unwrapped; gathered where sharded)."""
        return self.parallelism.module_state_dict(model)

    def replica_state_dict(self, model: nn.Module) -> dict[str, Any]:
        """Collective where sharded: the whole model's state as this rank's replica holds it
        (compared across ranks at the end of a run). Where no rank holds a replica
        (:meth:`replicates_parameters` false) only rank 0 gets the gathered whole."""
        return self.parallelism.replica_state_dict(model)

    def replicates_parameters(self, model: nn.Module) -> bool:
        """False when each rank holds only part of the parameters (FSDP): then "identical on
        every rank" holds by construction and only rank 0's gathered digest is reported."""
        return self.parallelism.replicates_parameters

    def load_module_state_dict(self, model: nn.Module, state: dict[str, Any]) -> None:
        """Inverse of :meth:`module_state_dict` on this rank (where sharded, rank 0 holds it
        until :meth:`broadcast_state` scatters it)."""
        self.parallelism.load_module_state_dict(model, state)

    def optimizer_state_dict(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        """The whole optimizer's ``state_dict`` (gathered where sharded)."""
        return self.parallelism.optimizer_state_dict(optimizer)

    def load_optimizer_state_dict(self, optimizer: torch.optim.Optimizer, state: dict[str, Any]) -> None:
        """Inverse of :meth:`optimizer_state_dict` on this rank."""
        self.parallelism.load_optimizer_state_dict(optimizer, state)

    def broadcast_optimizer(self, optimizer: torch.optim.Optimizer, root: int = 0) -> None:
        """Collective: every rank takes ``root``'s optimizer state (where sharded, its part)."""
        self.parallelism.broadcast_optimizer(optimizer, root)

    def broadcast_replicated_optimizer(self, optimizer: torch.optim.Optimizer, root: int = 0) -> None:
        """Replicated: every rank takes ``root``'s whole optimizer state (as one object)."""
        state = self.broadcast_object(to_cpu(optimizer.state_dict()) if self.rank == root else None, root)
        if self.rank != root and state is not None:
            optimizer.load_state_dict(state)

    @contextlib.contextmanager
    def accumulate(self, model: nn.Module, sync: bool) -> Iterator[None]:
        """Context for one micro-batch's backward; ``sync=False`` skips communication.

        Each optimizer step is exactly ``accumulation_steps`` micro-batches, the last with
        ``sync=True``. Anything else is refused here, in one line: a micro-batch left over at
        an epoch's end would otherwise carry into the next step (Horovod's reducer, which
        counts backward passes itself, then fails on an assertion; DDP silently sums it in).
        """
        k = self.config.accumulation_steps
        micro = self._unsynced + 1
        if micro > k or (sync and micro != k):
            self._unsynced = 0
            raise HvdkitError(
                f"micro-batch {micro} since the last optimizer step {'syncs' if sync else 'does not sync'}, but "
                f"BackendConfig(accumulation_steps={k}) makes every step exactly {k} micro-batches, the last "
                f"with sync=True (a micro-batch left over at an epoch's end carries into the next step)",
                f"run whole groups of {k} per epoch: len(loader) // {k} * {k} micro-batches, as hvdkit train does")
        self._unsynced = 0 if sync else micro
        with self.parallelism.accumulate(model, sync):
            yield

    @contextlib.contextmanager
    def accumulate_replicated(self, model: nn.Module, sync: bool) -> Iterator[None]:
        """Replicated: the backend's part of :meth:`accumulate` (DDP: ``no_sync`` unless ``sync``)."""
        yield

    def optimizer_step(self, optimizer: torch.optim.Optimizer,
                       scaler: torch.amp.GradScaler | None = None,
                       clip_grad_norm: float | None = None) -> None:
        """Apply the reduced gradients: unscale (fp16 ``scaler``), clip their global norm to
        ``clip_grad_norm``, step.

        DDP has reduced the (scaled) gradients during backward, so the usual order is right:
        ``scaler.unscale_``, ``clip_grad_norm_``, ``scaler.step``/``update``. Horovod
        overrides :meth:`step_replicated`: it reduces inside ``optimizer.step()``, so unscaling
        and clipping must wait for ``synchronize()``. ``--shard optimizer`` (either backend):
        reduce-scatter, clip the owned reduced gradients by the global norm, step, all-gather
        (no scaler: the config refuses fp16 with sharding).
        """
        self.parallelism.optimizer_step(optimizer, scaler, clip_grad_norm)

    def step_replicated(self, optimizer: torch.optim.Optimizer, scaler: torch.amp.GradScaler | None = None,
                        clip_grad_norm: float | None = None) -> None:
        """Replicated (and FSDP): unscale, clip, step, as the gradients are already reduced."""
        if clip_grad_norm:
            if scaler is not None:
                scaler.unscale_(optimizer)
            clip_gradients(optimizer, clip_grad_norm)
        if scaler is None:
            optimizer.step()
            return
        scaler.step(optimizer)
        scaler.update()

    @contextlib.contextmanager
    def join(self, model: nn.Module) -> Iterator[None]:
        """Around a loop in which ranks take different numbers of steps.

        A rank that leaves the loop early keeps answering the others' gradient reductions
        with zeros until every rank has left, so nobody stalls. The reduction still divides
        by the whole world size (Horovod's ``Average`` and DDP's default both do), which the
        training loop's loss weights account for. Inside, only gradient reductions may run.
        """
        yield

    # -- elastic training ------------------------------------------------------------------
    def run_elastic(self, body: Callable[[], T], loop: ElasticLoop) -> T:
        """Run ``body`` so that it survives lost and added workers: ``loop.sync()`` first; after
        a failure ``loop.roll_back()``, re-form the world, ``loop.on_reset()``, sync, run again."""
        raise ConfigError(f"--elastic is not available with --backend {self.name}",
                          "use --backend horovod under 'hvdkit run --elastic'; other backends "
                          "recover by rerunning the job, which resumes from its last checkpoint")

    def elastic_commit(self) -> None:
        """Inside :meth:`run_elastic`: ``loop.commit_to_memory()``, then raise the backend's
        interrupt on every rank if workers are waiting to join or leave."""
        raise NotImplementedError

    # -- what this backend's failures look like ------------------------------------------
    # Substrings of the errors a collective raises when a peer died or stalled; each
    # backend adds its own (Horovod's shutdown text, gloo/NCCL messages).
    PEER_FAILURE_MARKERS: tuple[str, ...] = ("Connection reset by peer", "Connection closed by peer",
                                             "Broken pipe", "timed out", "Timed out", "Socket Timeout")
    PEER_FAILURE_TYPES: tuple[str, ...] = ()
    ADVICE_SUFFIXES: tuple[str, ...] = ()  # generic advice the library appends to its messages

    def is_peer_failure(self, exc: BaseException) -> bool:
        """True for the errors a collective raises when another rank died or stalled."""
        text = f"{type(exc).__name__}: {exc}"
        return type(exc).__name__ in self.PEER_FAILURE_TYPES \
            or any(marker in text for marker in self.PEER_FAILURE_MARKERS)

    def failure_summary(self, exc: BaseException) -> str:
        """The first line of ``exc``, less a leading ``[source.cc:123]`` and generic advice."""
        lines = [ln.strip() for ln in str(exc).splitlines() if ln.strip()]
        if not lines:
            return type(exc).__name__
        line = re.sub(r"^\[[^\]]*\]\s*", "", lines[0])  # gloo/c10d prefix their source location
        for advice in self.ADVICE_SUFFIXES:
            line = line.split(advice)[0]
        return line[:300]

    def profiler_trace_path(self, timeline: str | None) -> str | None:
        """Where rank 0 records a torch profiler trace for ``--timeline`` (None: the backend
        writes its own timeline, as Horovod does)."""
        return timeline

    # -- collectives --------------------------------------------------------------
    def broadcast_state(
        self, model: nn.Module, optimizer: torch.optim.Optimizer | None = None, root: int = 0
    ) -> None:
        """Overwrite every rank's parameters, buffers and optimizer state with ``root``'s (where
        sharded, each rank's part of them)."""
        self.parallelism.broadcast_state(model, optimizer, root)

    @abstractmethod
    def broadcast_parameters(self, model: nn.Module, root: int = 0) -> None:
        """Overwrite every rank's whole ``state_dict`` (parameters and buffers) with ``root``'s."""

    @abstractmethod
    def broadcast_object(self, obj: T, root: int = 0) -> T:
        """Return ``root``'s (picklable) ``obj`` on every rank."""

    @abstractmethod
    def gather_objects(self, obj: T) -> list[T]:
        """Every rank's (picklable) ``obj``, in rank order, on every rank."""

    @abstractmethod
    def allreduce_tensor(self, tensor: torch.Tensor, op: str = "mean") -> torch.Tensor:
        """Reduce a tensor across ranks (``mean``, ``sum`` or ``max``); returns a new tensor."""

    def allreduce_(self, tensor: torch.Tensor, name: str | None = None) -> torch.Tensor:
        """Sum ``tensor`` across ranks in place: the bare collective (the bandwidth bench times it)."""
        return tensor.copy_(self.allreduce_tensor(tensor, "sum"))

    # Asynchronous collectives of --shard optimizer (hvdkit.backends.zero): each starts now and
    # returns the function that waits for its result; ``name`` tells concurrent ones apart
    # (Horovod matches operations across ranks by name). These fallbacks finish at once.
    def start_reduce_scatter_mean(self, flat: torch.Tensor, name: str) -> Callable[[], torch.Tensor]:
        """Average ``flat`` (a length divisible by the world size) across ranks; the result is
        this rank's contiguous 1/N of it."""
        n = flat.numel() // self.size
        out = self.allreduce_tensor(flat, "mean")[self.rank * n:(self.rank + 1) * n].clone()
        return lambda: out

    def start_all_gather_flat(self, shard: torch.Tensor, name: str) -> Callable[[], torch.Tensor]:
        """Every rank's equal-length 1D ``shard``, concatenated in rank order, on every rank."""
        out = torch.cat([t.to(shard.device) for t in self.gather_objects(shard.detach().cpu())])
        return lambda: out

    def start_allreduce_mean(self, tensor: torch.Tensor, name: str) -> Callable[[], torch.Tensor]:
        """``tensor`` averaged across ranks (a new tensor)."""
        out = self.allreduce_tensor(tensor, "mean")
        return lambda: out

    def start_broadcast_(self, tensor: torch.Tensor, root: int, name: str) -> Callable[[], torch.Tensor]:
        """Overwrite ``tensor`` in place with ``root``'s."""
        theirs: torch.Tensor = self.broadcast_object(tensor.detach().cpu() if self.rank == root else None, root)  # type: ignore[assignment]
        tensor.copy_(theirs)
        return lambda: tensor

    def allreduce_metric(self, value: float | torch.Tensor, op: str = "mean") -> float:
        """Reduce one scalar across ranks and return it as a Python float."""
        t = torch.as_tensor(value, dtype=torch.float64).detach().reshape(1).cpu()
        return float(self.allreduce_tensor(t, op)[0])

    def any_true(self, flag: bool) -> bool:
        """True on every rank if ``flag`` is true on any rank (agree on stopping)."""
        return self.allreduce_metric(1.0 if flag else 0.0, op="max") > 0.5

    def start_any_flags(self, flags: Sequence[bool | torch.Tensor]) -> Callable[[], list[bool]]:
        """Like :meth:`any_true` for several flags at once, asynchronous: start now, read later.

        The training loop starts it before the forward pass and reads it after
        ``optimizer.step()``, so agreeing on preemption and on a non-finite loss
        overlaps with compute instead of costing a blocking round trip every
        step. A flag may be a 0-d tensor on :attr:`device` (no host sync to build it).
        """
        answers = [self.any_true(bool(f)) for f in flags]
        return lambda: answers

    def _flag_tensor(self, flags: Sequence[bool | torch.Tensor]) -> torch.Tensor:
        """The flags as one float tensor on :attr:`device`, for a MAX allreduce."""
        return torch.stack([torch.as_tensor(f, device=self.device).to(torch.float32).reshape(())
                            for f in flags])

    @abstractmethod
    def barrier(self) -> None:
        """Wait for every rank."""

    @abstractmethod
    def shutdown(self) -> None:
        """Tear down the communication library (idempotent)."""

    def abort(self) -> None:
        """After a peer failed: make :meth:`shutdown` skip anything that talks to the others."""
        self._aborted = True

    def topology(self, hosts: list[str]) -> dict[str, Any]:
        """How the ranks are spread over nodes, as this backend sees it (same on every rank).

        ``hosts`` is every rank's hostname, already gathered by the caller; ``nodes`` counts
        the distinct ones; backends add what their library reports (Horovod's ``cross_size``,
        DDP's rendezvous address).
        """
        return {"nodes": len(set(hosts)), "hosts": sorted(set(hosts)),
                "master_addr": os.environ.get("MASTER_ADDR")}

    def slot_host(self) -> str:
        """The host name the launcher placed this rank on (for messages about workers)."""
        return socket.gethostname()

    def describe(self) -> str:
        """One line for logs."""
        return f"{self.name} rank {self.rank}/{self.size} on {self.device}"

    def __enter__(self) -> Backend:
        return self

    def __exit__(self, exc_type: Any, *exc: Any) -> None:
        if exc_type is not None:  # leaving on an error: do not wait for peers that may be stuck
            self.abort()
        self.shutdown()
