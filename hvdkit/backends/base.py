"""The communicator every backend is, so the training loop never branches on backend.

A :class:`Backend` is identity (rank, size, device), the collectives, what its failures look
like, and elastic training. How the model is spread is its :attr:`Backend.strategy`
(:mod:`hvdkit.backends.strategy`), chosen once in :meth:`Backend.wrap` from ``--shard``
(:mod:`hvdkit.backends.modes`); a backend supplies only its replicated strategy, which owns
its reducer. The strategies reach the backend only as a ``Communicator``.
"""

from __future__ import annotations

import contextlib
import os
import re
import socket
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Protocol, TypeVar

import torch
from torch import nn

from ..blocks import checkpoint_activations
from ..config import BackendConfig
from ..environments import usable_cores
from ..errors import ConfigError, HvdkitError
from ..materialise import MetaInit, has_meta
from .comm import Wait
from .modes import make_strategy
from .strategy import Replicated, Strategy

__all__ = ["Backend", "ElasticLoop", "share_node_cores"]

T = TypeVar("T")


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
    strategy that ``wrap`` chooses (:mod:`hvdkit.backends.strategy`).

    Lifecycle: construct (initialises the communication library), ``wrap`` the model and
    optimizer once, ``broadcast_state`` from rank 0, train, ``shutdown``. A subclass implements
    the collectives and, where its library has a reducer of its own, :meth:`replicated`.
    """

    name: str = "base"

    def __init__(self, config: BackendConfig) -> None:
        self.config = config
        self._aborted = False
        # Seconds this process's training thread has waited for reduced gradients: the part of
        # communication that compute did not hide (the loop reports it per epoch as a share).
        self.comm_wait = 0.0
        self._unsynced = 0  # micro-batches since the last sync=True (see accumulate)
        self._strategy: Strategy | None = None  # wrap() chooses it
        self.checkpointed_blocks = 0  # blocks whose activations wrap() made recomputed

    @property
    def strategy(self) -> Strategy:
        """How the model is spread: what :meth:`wrap` chose (before it, this backend's replicated
        strategy, for a program that broadcasts or saves a model it never wrapped)."""
        if self._strategy is None:
            self._strategy = self.replicated()
        return self._strategy

    def replicated(self) -> Strategy:
        """``--shard none``: this backend's own replicated strategy (its reducer)."""
        return Replicated(self)

    # -- identity ---------------------------------------------------------------------------
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

    # -- the model: one-line forwards to the strategy -----------------------------------------
    def wrap(
        self, model: nn.Module, optimizer: torch.optim.Optimizer, init: MetaInit | None = None
    ) -> tuple[nn.Module, torch.optim.Optimizer]:
        """Move ``model`` to :attr:`device`, choose the strategy from ``config.shard`` (once)
        and let it make the gradients data-parallel. With ``config.activation_checkpointing``
        each block's activations are recomputed in backward (set before any sharding, which
        then gathers a block's weights again for the recomputation).

        A model built on the meta device (``hvdkit.build_model_lazily``) is made here, by its
        ``init``: whole on every rank where each holds it whole anyway, one module at a time
        into each rank's shards under ``--shard full``. The optimizer may be built over the
        meta parameters: it comes back over the made ones."""
        meta = has_meta(model)
        if meta and init is None:
            raise HvdkitError("wrap(): the model has tensors on the meta device and no init= to make them",
                              "build it with hvdkit.build_model_lazily(...) and pass init=built.init, "
                              "or build it on a real device")
        if self.config.activation_checkpointing:
            self.checkpointed_blocks = checkpoint_activations(model)
        self._strategy = make_strategy(self.config, self, self.replicated)
        if meta:
            assert init is not None
            return self._strategy.wrap_meta(model, optimizer, init)
        return self._strategy.wrap(model.to(self.device), optimizer)

    def unwrap(self, model: nn.Module) -> nn.Module:
        """The plain module inside whatever ``wrap`` returned (for ``state_dict``)."""
        return self.strategy.unwrap(model)

    def sync_buffers(self, model: nn.Module, root: int = 0) -> None:
        """Every rank takes ``root``'s buffers (BatchNorm running statistics).

        Training never syncs them (Horovod) or syncs them only at the start of each forward
        pass (DDP's ``broadcast_buffers``), so after a step they differ by rank. They matter
        only in eval mode: evaluation and the checkpoint use rank 0's, as DDP would.
        """
        self.strategy.sync_buffers(model, root)

    def broadcast_state(
        self, model: nn.Module, optimizer: torch.optim.Optimizer | None = None, root: int = 0
    ) -> None:
        """Overwrite every rank's parameters, buffers and optimizer state with ``root``'s (where
        sharded, each rank's part of them)."""
        self.strategy.broadcast_state(model, optimizer, root)

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
        with self.strategy.accumulate(model, sync):
            yield

    def optimizer_step(self, optimizer: torch.optim.Optimizer,
                       scaler: torch.amp.GradScaler | None = None,
                       clip_grad_norm: float | None = None) -> None:
        """Apply the reduced gradients: unscale (fp16 ``scaler``), clip their global norm to
        ``clip_grad_norm``, step, in the order the strategy's reduction needs (Horovod reduces
        inside ``optimizer.step()``, so unscaling and clipping wait for its ``synchronize()``;
        ZeRO reduce-scatters, clips the owned gradients by the global norm, steps, gathers)."""
        self.comm_wait += self.strategy.optimizer_step(optimizer, scaler, clip_grad_norm)

    def join(self, model: nn.Module) -> contextlib.AbstractContextManager[None]:
        """Around a loop in which ranks take different numbers of steps.

        A rank that leaves the loop early keeps answering the others' gradient reductions
        with zeros until every rank has left, so nobody stalls. The reduction still divides
        by the whole world size (Horovod's ``Average`` and DDP's default both do), which the
        training loop's loss weights account for. Inside, only gradient reductions may run.
        """
        return self.strategy.join(model)

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

    def profiler_trace_path(self) -> str | None:
        """Where rank 0 records a torch profiler trace for ``--timeline`` (None: the backend
        writes its own timeline, as Horovod does)."""
        return self.config.timeline

    # -- collectives --------------------------------------------------------------
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
    def start_reduce_scatter_mean(self, flat: torch.Tensor, name: str) -> Wait:
        """Average ``flat`` (a length divisible by the world size) across ranks; the result is
        this rank's contiguous 1/N of it."""
        n = flat.numel() // self.size
        out = self.allreduce_tensor(flat, "mean")[self.rank * n:(self.rank + 1) * n].clone()
        return lambda: out

    def start_all_gather_flat(self, shard: torch.Tensor, name: str) -> Wait:
        """Every rank's equal-length 1D ``shard``, concatenated in rank order, on every rank."""
        out = torch.cat([t.to(shard.device) for t in self.gather_objects(shard.detach().cpu())])
        return lambda: out

    def start_allreduce_mean(self, tensor: torch.Tensor, name: str) -> Wait:
        """``tensor`` averaged across ranks (a new tensor)."""
        out = self.allreduce_tensor(tensor, "mean")
        return lambda: out

    def start_broadcast_(self, tensor: torch.Tensor, root: int, name: str) -> Wait:
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

    def close_strategy(self) -> None:
        """First in a backend's :meth:`shutdown`: the strategy lets go of the model (see
        :meth:`Strategy.close`) and this backend of the strategy."""
        if self._strategy is not None:
            self._strategy.close()
            self._strategy = None

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
