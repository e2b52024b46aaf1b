"""The training loop, readable in one sitting; the same code runs on every backend.

``train(cfg)`` builds the example model, wraps it with the chosen backend,
resumes from rank 0's newest checkpoint (or broadcasts rank 0's fresh
weights), and trains with a linearly scaled, warmed-up learning rate. Every
side effect (printing, files, requeue) is gated on ``master = backend.is_master``,
which is the *global* rank 0.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import hashlib
import os
import signal
import socket
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader

from .asha import AshaTrial
from .backends import Backend, create_backend
from .checkpoint import CheckpointManager, TrainingState
from .config import TrainConfig
from .data import H5Dataset, ShardSampler, per_rank_batch_size
from .errors import ConfigError, HvdkitError
from .fileio import write_json_atomic
from .models import build_model, synthetic_dataset
from .nonfinite import NonFiniteWatch
from .precision import autocast, make_scaler
from .preemption import PreemptionGuard, catch_early, requeue_slurm_job
from .samplelog import SampleLog
from .log import configure as configure_log
from .log import debug, diag, warn
from .log import result as result_line
from .profiling import step_profiler

__all__ = [
    "TrainResult", "train", "train_step", "make_optimizer", "warmup_factor", "param_digest",
]


@dataclass
class TrainResult:
    """What a run did, identical on every rank."""

    backend: str
    world_size: int
    epoch_losses: list[float] = field(default_factory=list)
    samples_per_sec: list[float] = field(default_factory=list)
    global_step: int = 0
    preempted: bool = False
    requeued: bool = False  # preempted and Slurm accepted the requeue
    requeue: str = ""
    param_digest: str = ""
    ranks: list[str] = field(default_factory=list)
    # one dict per rank, in rank order: rank, local_rank, host, pid, threads
    placement: list[dict] = field(default_factory=list)
    topology: dict = field(default_factory=dict)
    status: str = "completed"  # or "pruned" (ASHA stopped it), "preempted"
    asha: list[dict] = field(default_factory=list)  # the rung decisions, with their numbers

    @property
    def final_loss(self) -> float:
        return self.epoch_losses[-1] if self.epoch_losses else float("nan")


def make_optimizer(cfg: TrainConfig, params: Iterable[nn.Parameter], lr: float) -> torch.optim.Optimizer:
    """SGD (with momentum), Adam or AdamW at learning rate ``lr``."""
    if cfg.optimizer == "sgd":
        return torch.optim.SGD(params, lr=lr, momentum=cfg.momentum, weight_decay=cfg.weight_decay)
    cls = torch.optim.Adam if cfg.optimizer == "adam" else torch.optim.AdamW
    return cls(params, lr=lr, weight_decay=cfg.weight_decay)


def warmup_factor(step: int, warmup_steps: int, scale: float) -> float:
    """LR multiplier: ramps from 1/scale (the unscaled LR) to 1 over ``warmup_steps`` (Goyal et al.)."""
    if warmup_steps <= 0 or step >= warmup_steps:
        return 1.0
    start = 1.0 / scale
    return start + (1.0 - start) * step / warmup_steps


def param_digest(model: nn.Module) -> str:
    """SHA-256 of all parameters and buffers, to compare ranks and runs bit for bit."""
    h = hashlib.sha256()
    for name, tensor in model.state_dict().items():
        h.update(name.encode())
        h.update(tensor.detach().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()[:16]


def train(cfg: TrainConfig, backend: Backend | None = None,
          log: Callable[[str], None] = result_line) -> TrainResult:
    """Run one training job; collective, so every rank must call it."""
    catch_early()  # a USR1 during set-up or after the last step must not kill the rank
    owns_backend = backend is None
    backend = backend or create_backend(cfg.backend)
    configure_log(cfg.log_level, rank=lambda: backend.rank)  # rank 0 speaks; elastic ranks change
    result = TrainResult(backend=backend.name, world_size=backend.size)
    try:
        return _train(cfg, backend, log, result)
    except BaseException as exc:
        # Whatever failed here, the peers may be waiting in a collective this rank will never
        # join: shutdown() must not wait for them (DDP's exit barrier hung until --ddp-timeout).
        # This process exits; its peers then see the connection drop and stop too.
        backend.abort()
        if not (isinstance(exc, RuntimeError) and backend.is_peer_failure(exc)):
            # who failed, for the one-line error 'hvdkit train' prints under the traceback
            exc.hvdkit_rank = f"rank {backend.rank}/{backend.size} ({backend.name}) on {socket.gethostname()}"
            raise
        who = _peers_text(backend.rank, result.placement, backend.size)
        resume = f"rerun the job: it resumes from the last checkpoint in {cfg.checkpoint_dir}" \
            if cfg.checkpoint_dir else "rerun the job (with --checkpoint-dir it would resume)"
        raise HvdkitError(
            f"rank {backend.rank}/{backend.size} ({backend.name}) lost contact with {who}: "
            f"{backend.failure_summary(exc)}", resume) from None
    finally:
        if owns_backend:
            backend.shutdown()


def _peers_text(me: int, placement: list[dict], size: int) -> str:
    """'rank 1 on node2', or the other ranks with their hosts, for a lost-peer message.

    A collective cannot tell which peer vanished, so with several peers all of them
    are named; the hosts are what an operator needs to find the dead node.
    """
    others = [p for p in placement if p["rank"] != me]
    if not others:  # failed before the placement was known
        ids = [r for r in range(size) if r != me]
        return f"rank {ids[0]}" if len(ids) == 1 else f"one of ranks {ids[0]}..{ids[-1]}"
    if len(others) == 1:
        return f"rank {others[0]['rank']} on {others[0]['host']}"
    hosts = sorted({p["host"] for p in others})
    return f"one of ranks {others[0]['rank']}..{others[-1]['rank']} (on {', '.join(hosts)})"


def train_step(backend: Backend, model: nn.Module, optimizer: torch.optim.Optimizer,
               batches: Iterator[tuple[torch.Tensor, torch.Tensor]], accum: int,
               device: torch.device, precision: str = "fp32",
               scaler: torch.amp.GradScaler | None = None, weight: float | None = None) -> torch.Tensor:
    """One optimizer step over ``accum`` micro-batches; returns the step's mean loss (on device).

    Only the last micro-batch communicates (DDP ``no_sync`` / Horovod
    ``backward_passes_per_step``); dividing each loss by ``accum`` makes the
    summed gradient the mean over the whole global batch. With bf16/fp16 the
    forward pass runs under autocast; fp16 scales the loss (``scaler``) and the
    backend applies the step in the order its reduction needs. ``weight`` multiplies
    the loss (uneven shards: see :func:`_one_epoch`).
    """
    total = torch.zeros((), dtype=torch.float64, device=device)
    for micro in range(accum):
        x, y = next(batches)
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        with backend.accumulate(model, sync=micro == accum - 1):
            with autocast(precision, device):
                loss = nn.functional.cross_entropy(model(x), y) / accum
                if weight is not None:
                    loss = loss * weight
            (scaler.scale(loss) if scaler is not None else loss).backward()
        total += loss.detach()
    backend.optimizer_step(optimizer, scaler)
    optimizer.zero_grad()
    return total


@dataclass
class _Geometry:
    """Batch sizes and steps, derived once from the config and the world size."""

    batch: int          # micro-batch per rank
    global_batch: int   # samples per optimizer step, all ranks and micro-batches
    steps_per_epoch: int


def _geometry(cfg: TrainConfig, size: int, num_samples: int) -> _Geometry:
    accum = cfg.backend.accumulation_steps
    if cfg.global_batch_size is not None:
        batch = per_rank_batch_size(cfg.global_batch_size, size, accum, cfg.exact_batch)
    else:
        batch = cfg.batch_size
    global_batch = batch * size * accum
    steps = num_samples // global_batch
    if steps == 0:
        raise ConfigError(
            f"{num_samples} samples are fewer than one global batch of {global_batch}",
            "use more --num-samples or a smaller --batch-size",
        )
    return _Geometry(batch, global_batch, min(steps, cfg.steps_per_epoch or steps))


@dataclass
class _LrPlan:
    """What the LR schedule depends on in the current world; re-derived when the world changes."""

    scale: float = 1.0      # world size x accumulation (with --scale-lr): bigger batch, bigger LR
    warmup_steps: int = 0

    def factor(self, step: int) -> float:
        return warmup_factor(step, self.warmup_steps, self.scale)


@dataclass
class _Run:
    """One training run, built once by :func:`_set_up` without talking to other ranks.

    The loop pieces below change only ``state`` (where the loop is), the loss of the epoch so
    far (``loss_committed``, folded over ranks at every commit, plus this rank's ``loss_sum``
    since then), the record of the last save, and ``result``. The same object is the state
    Horovod Elastic commits, rolls back and syncs (``commit_to_memory``, ``roll_back``,
    ``sync``): elastic training is a mode of this loop, not a second one.
    """

    cfg: TrainConfig
    backend: Backend
    log: Callable[[str], None]
    result: TrainResult
    geo: _Geometry
    plan: _LrPlan
    dataset: torch.utils.data.Dataset
    model: nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    scaler: torch.amp.GradScaler | None
    ckpt: CheckpointManager | None
    watch: NonFiniteWatch
    samples: SampleLog | None
    state: TrainingState = field(default_factory=TrainingState)
    loss_sum: torch.Tensor = field(default_factory=lambda: torch.zeros((), dtype=torch.float64))
    loss_committed: float = 0.0
    steps_in_epoch: int = 0
    saved_step: int | None = None  # at most one checkpoint per step
    saved_name: str | None = None
    asha: AshaTrial | None = None
    memory: dict[str, Any] | None = None  # the last elastic commit, in host memory
    replay: str = ""  # after a roll-back: which steps are recomputed

    @property
    def master(self) -> bool:
        return self.backend.is_master  # global rank 0: the only rank with side effects

    @property
    def epoch_samples(self) -> int:
        """Samples in this epoch at the current world size (the epoch ends before a partial batch)."""
        return self.geo.steps_per_epoch * self.geo.global_batch

    def checkpoint(self) -> None:
        """Collective: checkpoint the current step (once), with every rank's running loss."""
        assert self.ckpt is not None
        if self.saved_step == self.state.global_step:
            return
        self.state.extra = {"loss_sums": self.backend.gather_objects(float(self.loss_sum)),
                            "loss_committed": self.loss_committed, "steps_in_epoch": self.steps_in_epoch,
                            "epoch_losses": self.result.epoch_losses}
        path = self.ckpt.save(self.model, self.optimizer, self.scheduler, self.state, self.scaler,
                              skip_nonfinite=self.watch.mode == "warn")
        self.saved_step = self.state.global_step
        self.saved_name = path.name if path is not None else self.saved_name
        if self.samples is not None:  # a resume continues from here, so what led here is logged
            self.samples.record(self.state.epoch, self.state.global_step)

    def check_nonfinite(self, flagged: bool, before_save: bool) -> None:
        """Collective: stop or warn at a non-finite loss; the per-step flag lags one step, so
        before a save this step is asked about too."""
        if flagged or (before_save and self.watch.check_now()):
            self.watch.handle(self.state.global_step, self.saved_name, self.log)

    # -- commits: every --commit-every steps and at epoch ends ------------------------------
    def commit(self) -> None:
        """Collective: fold the running loss over ranks, log the samples, and (elastic) commit.

        Folding at the same steps in every mode keeps the epoch loss bit-identical between
        elastic and plain runs; a world that changes between commits then loses nothing.
        """
        self.loss_committed += self.backend.allreduce_metric(self.loss_sum)
        self.loss_sum.zero_()
        if self.samples is not None:
            self.samples.record(self.state.epoch, self.state.global_step)
        if self.cfg.elastic:
            if self.master and self.cfg.log_every:
                self.log(f"commit at step {self.state.global_step} (world {self.backend.size})")
            self.backend.elastic_commit()  # calls commit_to_memory; raises if hosts changed

    def _loop_values(self) -> dict[str, Any]:
        """The loop's state besides weights and optimizer: small, picklable, world-independent."""
        return copy.deepcopy({
            "state": dataclasses.asdict(self.state), "loss_committed": self.loss_committed,
            "steps_in_epoch": self.steps_in_epoch, "epoch_losses": self.result.epoch_losses,
            "samples_per_sec": self.result.samples_per_sec, "saved_step": self.saved_step,
            "saved_name": self.saved_name, "scheduler": self.scheduler.state_dict(),
            "scaler": self.scaler.state_dict() if self.scaler is not None else None})

    def _apply_loop_values(self, v: dict[str, Any]) -> None:
        self.state = TrainingState(**v["state"])
        self.loss_committed, self.steps_in_epoch = v["loss_committed"], v["steps_in_epoch"]
        self.result.epoch_losses, self.result.samples_per_sec = v["epoch_losses"], v["samples_per_sec"]
        self.saved_step, self.saved_name = v["saved_step"], v["saved_name"]
        self.scheduler.load_state_dict(v["scheduler"])
        if self.scaler is not None and v["scaler"] is not None:
            self.scaler.load_state_dict(v["scaler"])

    def commit_to_memory(self) -> None:
        """Elastic: copy the state to host memory (what a roll-back returns to)."""
        self.memory = {"model": copy.deepcopy(self.backend.unwrap(self.model).state_dict()),
                       "optimizer": copy.deepcopy(self.optimizer.state_dict()),
                       "loop": self._loop_values(), "loss_sum": float(self.loss_sum)}

    def roll_back(self) -> None:
        """Elastic, after a collective failed: back to the last commit; later steps are redone."""
        if self.memory is None:  # failed before the first commit: the next sync starts afresh
            return
        lost = self.state.global_step
        self.backend.unwrap(self.model).load_state_dict(self.memory["model"])
        self.optimizer.load_state_dict(self.memory["optimizer"])
        self._apply_loop_values(copy.deepcopy(self.memory["loop"]))
        self.loss_sum.fill_(self.memory["loss_sum"])
        if self.samples is not None:
            self.samples.discard()
        if lost > self.state.global_step:
            self.replay = f"; steps {self.state.global_step + 1}..{lost} are done again"

    def sync(self) -> None:
        """Collective: every rank takes the newest state any rank holds.

        At the start of a job no rank holds any: rank 0 restores the newest checkpoint (or its
        fresh weights) for everyone. After an elastic reset the survivors hold their last
        commit and a new worker holds nothing; the state comes from the lowest rank with the
        newest commit (not blindly rank 0, which may be the newcomer).
        """
        backend = self.backend
        have = backend.gather_objects((self.state.global_step if self.memory is not None else -1,
                                       float(self.loss_sum)))
        newest = max(step for step, _ in have)
        if newest < 0:
            self._restore_or_broadcast()
        else:
            src = [step for step, _ in have].index(newest)
            debug(f"sync: state of step {newest} from rank {src} (steps held: {[h for h, _ in have]})")
            backend.broadcast_state(self.model, self.optimizer, root=src)
            self._apply_loop_values(backend.broadcast_object(
                self._loop_values() if backend.rank == src else None, src))
            if any(step != newest for step, _ in have):  # a newcomer: fold what the others ran
                self.loss_committed += sum(p for _, p in have) / sum(step == newest for step, _ in have)
                self.loss_sum.zero_()
        if self.samples is not None:
            self.samples.truncate(self.state.global_step)  # records of rolled-back steps go
        if self.cfg.elastic:
            self.commit_to_memory()

    def _restore_or_broadcast(self) -> None:
        """Collective: the newest valid checkpoint of rank 0, or rank 0's fresh weights."""
        cfg, backend = self.cfg, self.backend
        restored = self.ckpt.restore(self.model, self.optimizer, self.scheduler, self.scaler) \
            if (self.ckpt and cfg.resume) else None
        if restored is None and not (self.ckpt and cfg.resume):  # restore() already broadcast
            backend.broadcast_state(self.model, self.optimizer)
        self.state = restored or TrainingState()
        extra = self.state.extra
        self.result.epoch_losses = list(extra.get("epoch_losses", []))
        self.loss_committed = float(extra.get("loss_committed", 0.0))
        self.steps_in_epoch = int(extra.get("steps_in_epoch", self.state.samples_in_epoch // self.geo.global_batch))
        sums = extra.get("loss_sums") or []
        # this rank's own running loss if the world is unchanged, else their mean
        mine = float(sums[backend.rank]) if len(sums) == backend.size else sum(sums) / max(len(sums), 1)
        self.loss_sum.fill_(mine)
        if self.ckpt and self.state.global_step:
            self.saved_step, self.saved_name = self.state.global_step, f"ckpt-{self.state.global_step:09d}.h5"

    def on_reset(self) -> None:
        """Elastic: the world changed (after the backend re-formed it, before :meth:`sync`)."""
        diag(f"reset: rank {self.backend.rank} of {self.backend.size} (host "
             f"{self.backend.slot_host()}, pid {os.getpid()}), continuing from committed step "
             f"{self.state.global_step} at sample {self.state.samples_in_epoch} of epoch "
             f"{self.state.epoch}'s order{self.replay}", every_rank=True)
        self.replay = ""


def _set_up(cfg: TrainConfig, backend: Backend, log: Callable[[str], None], result: TrainResult) -> _Run:
    """Data, model, optimizer and schedule; local to this rank (no collective: an elastic
    newcomer builds these while the others are already training)."""
    dataset = _open_data(cfg, backend.is_master)
    samples = SampleLog(cfg.sample_log, backend) if cfg.sample_log else None
    if samples is not None:
        dataset = samples.watch(dataset)
    geo = _geometry(cfg, backend.size, len(dataset))  # refuses a bad batch here, before any collective;
    # _enter derives it again for the world the loop actually runs in (elastic: after each reset)
    # Ranks start from *different* weights on purpose: broadcast_state (or
    # restore) must make them rank 0's, and the tests check that it does.
    torch.manual_seed(cfg.seed + backend.rank)
    model = build_model(cfg.model, seed=cfg.seed + backend.rank)
    plan = _LrPlan()
    optimizer = make_optimizer(cfg, model.parameters(), cfg.lr)
    model, optimizer = backend.wrap(model, optimizer)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, plan.factor)
    return _Run(cfg=cfg, backend=backend, log=log, result=result, geo=geo, plan=plan, dataset=dataset,
                model=model, optimizer=optimizer, scheduler=scheduler,
                scaler=make_scaler(cfg.precision, backend.device),  # fp16 only; checkpointed
                ckpt=CheckpointManager(cfg.checkpoint_dir, backend, cfg.keep_checkpoints) if cfg.checkpoint_dir else None,
                watch=NonFiniteWatch(backend, cfg.on_nonfinite), samples=samples,
                loss_sum=torch.zeros((), dtype=torch.float64, device=backend.device))


def _enter(run: _Run) -> None:
    """Collective, at the start and after every elastic reset: where the ranks are, and what
    depends on the world size (batch geometry, LR scale and warm-up)."""
    cfg, backend, result = run.cfg, run.backend, run.result
    size, accum = backend.size, cfg.backend.accumulation_steps
    result.world_size = size
    result.placement = backend.gather_objects(
        {"rank": backend.rank, "local_rank": backend.local_rank, "host": socket.gethostname(),
         "pid": os.getpid(), "threads": torch.get_num_threads()})
    result.ranks = [f"{p['rank']}@{p['host']}:{p['pid']}" for p in result.placement]
    result.topology = backend.topology([p["host"] for p in result.placement])
    debug(f"rank {backend.rank}/{size} on {socket.gethostname()} pid {os.getpid()}: "
          f"{torch.get_num_threads()} threads, {backend.device}")
    run.geo = geo = _geometry(cfg, size, len(run.dataset))
    if run.master and cfg.global_batch_size not in (None, geo.global_batch):
        warn(f"global batch {cfg.global_batch_size} rounded down to {geo.global_batch}")
    run.plan.scale = float(size * accum) if cfg.scale_lr else 1.0
    run.plan.warmup_steps = int(cfg.warmup_epochs * geo.steps_per_epoch)
    # the LR of the *current* world, also after a restore from a checkpoint of another size
    run.scheduler.base_lrs = [cfg.lr * run.plan.scale for _ in run.optimizer.param_groups]
    for group, lr in zip(run.optimizer.param_groups, run.scheduler.base_lrs):
        group["lr"] = lr * run.plan.factor(run.state.global_step)
    run.scheduler._last_lr = [g["lr"] for g in run.optimizer.param_groups]  # noqa: SLF001 - get_last_lr()
    if cfg.asha_dir and run.master and run.asha is None:
        run.asha = AshaTrial(cfg.asha_dir, cfg.asha_trial)
    if run.master:
        run.log(f"{backend.describe()}; {cfg.precision}; world {size}, batch {geo.batch}/rank, global {geo.global_batch}, "
                f"lr {cfg.lr * run.plan.scale:g}, {geo.steps_per_epoch} steps/epoch, "
                f"{result.topology['nodes']} node(s) {' '.join(result.topology['hosts'])}, start step "
                f"{run.state.global_step}, slurm restarts {os.environ.get('SLURM_RESTART_COUNT', '0')}, "
                f"ranks {' '.join(result.ranks)}")


def _train(cfg: TrainConfig, backend: Backend, log: Callable[[str], None],
           result: TrainResult) -> TrainResult:
    run = _set_up(cfg, backend, log, result)
    if cfg.elastic:
        diag(f"elastic worker rank {backend.rank} of {backend.size} host {backend.slot_host()} "
             f"pid {os.getpid()}", every_rank=True)
        # sync, then the loop; after a lost or added worker: roll back or keep, re-sync, re-enter
        try:
            backend.run_elastic(lambda: _loop(run), run)
        except ConfigError as err:  # the same refusal on every rank: one of them says it
            err.echo = backend.is_master
            raise
    else:
        run.sync()
        _loop(run)
    return result


def _loop(run: _Run) -> None:
    """The epochs from wherever ``run.state`` says; re-entered after an elastic reset."""
    cfg, backend = run.cfg, run.backend
    _enter(run)
    state = run.state
    done = cfg.max_steps is not None and state.global_step >= cfg.max_steps
    # --timeline: Horovod writes its own (set at init); other backends take a profiler trace here
    timeline = backend.profiler_trace_path(cfg.backend.horovod.timeline)
    with PreemptionGuard() as guard, step_profiler(timeline, run.master) as profiler:
        while not done and run.state.epoch < cfg.epochs:
            state = run.state
            sampler = ShardSampler(len(run.dataset), backend.size, backend.rank, seed=cfg.seed,
                                   uneven=cfg.uneven)
            sampler.set_epoch(state.epoch, start=state.samples_in_epoch)
            first_sample, t0 = state.samples_in_epoch, time.perf_counter()
            if _one_epoch(run, sampler, guard, profiler):
                return  # preempted or at --max-steps: saved and reported
            if not _end_epoch(run, state.samples_in_epoch - first_sample, time.perf_counter() - t0):
                break  # ASHA pruned this trial
    run.result.global_step = run.state.global_step
    _report_done(cfg, backend, run.model, run.result, run.log)


@dataclass(frozen=True)
class _Step:
    """One optimizer step of an epoch, as every rank can compute it in advance."""

    mine: int   # samples this rank reads (0: its shard is done, it has joined)
    total: int  # samples all ranks read
    full: bool  # every rank reads a full batch: the step may talk beyond its gradients


def _epoch_plan(run: _Run, sampler: ShardSampler) -> list[_Step]:
    """The steps left in this epoch. Even shards: equal full steps until less than a global
    batch is left (dropped). ``--uneven``: every sample; lower ranks may have one sample
    more and the last batch of a rank may be partial."""
    geo, size = run.geo, run.backend.size
    if not run.cfg.uneven:
        n = (run.epoch_samples - run.state.samples_in_epoch) // geo.global_batch
        return [_Step(geo.global_batch // size, geo.global_batch, True)] * n
    lengths = [sampler.shard_length(r) for r in range(size)]
    plan = []
    for k in range(-(-lengths[0] // geo.batch)):  # rank 0's shard is the longest
        counts = [min(geo.batch, max(0, n - k * geo.batch)) for n in lengths]
        plan.append(_Step(counts[run.backend.rank], sum(counts), all(c == geo.batch for c in counts)))
    return plan


def _one_epoch(run: _Run, sampler: ShardSampler, guard: PreemptionGuard,
               profiler) -> bool:  # noqa: ANN001 - torch profiler or a no-op
    """The steps of the epoch from ``state.samples_in_epoch``; True when the run must end here."""
    cfg, backend, state, geo = run.cfg, run.backend, run.state, run.geo
    batches = iter(DataLoader(run.dataset, batch_size=geo.batch, sampler=sampler, drop_last=not cfg.uneven))
    plan = _epoch_plan(run, sampler)
    done = 0
    run.model.train()
    # --uneven: a rank whose shard ends first leaves this block and answers the others'
    # gradient reductions with zeros until all have left (Backend.join)
    with backend.join(run.model) if cfg.uneven else contextlib.nullcontext():
        for k, step in enumerate(plan):
            if step.mine == 0:
                break
            # Agree on preemption and earlier non-finite losses while this step computes; in an
            # uneven tail (some rank has joined) nothing but the gradients may be reduced.
            agreement = backend.start_any_flags([guard.requested, run.watch.flag()]) if step.full else None
            # the reduction divides by the world size: weigh this rank's mean loss so that the
            # step's gradient is the mean over the samples all ranks read (1.0 for even shards)
            weight = step.mine * backend.size / step.total if cfg.uneven else None
            loss = train_step(backend, run.model, run.optimizer, batches, cfg.backend.accumulation_steps,
                              backend.device, cfg.precision, run.scaler, weight)
            run.watch.record(loss, state.global_step + 1)
            run.loss_sum += loss
            run.scheduler.step()
            profiler.step()
            _advance(run, step)
            done = k + 1
            if run.master and cfg.log_every and state.global_step % cfg.log_every == 0:
                run.log(f"step {state.global_step} loss {loss.item():.6f} "
                        f"lr {run.scheduler.get_last_lr()[0]:.5g}")
            if agreement is None:
                continue
            stop, nonfinite = agreement()  # the same answers on every rank
            limit = cfg.max_steps is not None and state.global_step >= cfg.max_steps
            # the epoch's last step is saved and committed at the epoch's end
            more = k + 1 < len(plan)
            periodic = bool(cfg.checkpoint_every and state.global_step % cfg.checkpoint_every == 0 and more)
            wants_save = bool(run.ckpt and (stop or limit or periodic))
            run.check_nonfinite(nonfinite and not run.watch.warned, before_save=wants_save)
            if wants_save:
                run.checkpoint()
            if stop:
                _report_preemption(cfg, backend, guard, state, run.result, bool(run.ckpt), run.log)
                return True
            if limit:
                if run.master:
                    run.log(f"stopped at max_steps={cfg.max_steps}{'; checkpoint saved' if run.ckpt else ''}")
                run.result.global_step = state.global_step
                return True
            if more and state.global_step % cfg.commit_every == 0:
                run.commit()
    if done < len(plan):  # joined early: take the others' steps, then their weights
        for step in plan[done:]:
            run.scheduler.step()
            _advance(run, step)
    if cfg.uneven:
        backend.broadcast_state(run.model, run.optimizer, root=0)  # rank 0 ran every step
    return False


def _advance(run: _Run, step: _Step) -> None:
    state = run.state
    state.global_step += 1
    state.samples_in_epoch += step.total
    state.samples_seen += step.total
    run.steps_in_epoch += 1


def _end_epoch(run: _Run, samples_here: int, seconds: float) -> bool:
    """Epoch loss and throughput, the non-finite check, ASHA's rung, the epoch checkpoint and commit.

    Returns False when ASHA pruned the trial.
    """
    backend, state = run.backend, run.state
    epoch = state.epoch
    # Throughput of the slowest rank is the job's throughput.
    slowest = backend.allreduce_metric(seconds, op="max")
    sps = samples_here / slowest if slowest > 0 else float("nan")
    epoch_loss = (run.loss_committed + backend.allreduce_metric(run.loss_sum)) / max(run.steps_in_epoch, 1)
    if run.samples is not None:  # while the state still says which epoch they belong to
        run.samples.record(epoch, state.global_step)
    run.result.epoch_losses.append(epoch_loss)
    run.result.samples_per_sec.append(sps)
    if run.master:
        run.log(f"epoch {epoch} loss {epoch_loss:.6f} samples/s {sps:.1f} ({backend.size} ranks)")
    run.check_nonfinite(not run.watch.warned and run.watch.check_now(), before_save=False)
    state.epoch, state.samples_in_epoch = epoch + 1, 0
    run.loss_sum.zero_()
    run.loss_committed, run.steps_in_epoch = 0.0, 0
    # ASHA decides before the save: a trial requeued in between meets the same rung
    # again and reuses the recorded decision
    go_on = _asha_rung(run.cfg, run.asha, backend, state.epoch, epoch_loss, run.result, run.log)
    if run.ckpt:
        run.checkpoint()
    run.commit()
    return go_on


def _asha_rung(cfg: TrainConfig, asha: AshaTrial | None, backend: Backend, epoch: int, value: float,
               result: TrainResult, log: Callable[[str], None]) -> bool:
    """Collective at every epoch end of an ASHA trial: rank 0 decides, every rank learns it."""
    if cfg.asha_dir is None:
        return True
    decision = asha.report(epoch, value) if asha is not None and asha.is_rung(epoch) else None
    decision = backend.broadcast_object(decision, 0)  # asha is rank 0's alone
    if decision is None:
        return True
    result.asha.append(decision)
    if backend.is_master:
        verdict = "continues" if decision["go_on"] else "pruned"
        log(f"asha: trial {decision['trial']} at epoch {epoch} loss {value:.6f}: {verdict} "
            f"({decision['rule']}{'; recorded decision reused' if decision['reused'] else ''})")
    if not decision["go_on"]:
        result.status = "pruned"
    return bool(decision["go_on"])


def _report_preemption(cfg: TrainConfig, backend: Backend, guard: PreemptionGuard,
                       state: TrainingState, result: TrainResult, saved: bool,
                       log: Callable[[str], None]) -> None:
    """After a checkpoint on signal: requeue under Slurm (USR1 only) and say what happened."""
    result.preempted, result.global_step, result.status = True, state.global_step, "preempted"
    requeue = backend.any_true(guard.should_requeue) and cfg.requeue
    result.requeued = requeue  # rank 0 corrects it below if scontrol refused
    received = backend.allreduce_metric(guard.received or 0, op="max")
    if backend.is_master:
        result.requeue = requeue_slurm_job() if requeue else "not requeued"
        result.requeued = result.requeue.startswith("requeued")
        log(f"preempted at step {state.global_step} by {signal.Signals(int(received)).name}; "
            f"{'checkpoint saved' if saved else 'no checkpoint dir'}; {result.requeue}")


def _report_done(cfg: TrainConfig, backend: Backend, model: nn.Module, result: TrainResult,
                 log: Callable[[str], None]) -> None:
    """Check that every rank holds the same weights, print the summary, write metrics."""
    digests = backend.gather_objects(param_digest(backend.unwrap(model)))
    result.param_digest = digests[0]
    if backend.is_master:
        same = all(d == digests[0] for d in digests)
        log(f"done: backend={backend.name} world={backend.size} final_loss={result.final_loss!r} "
            f"steps={result.global_step} params_identical_on_all_ranks={same} "
            f"digest={digests[0]} ranks={' '.join(result.ranks)}")
        if cfg.metrics_file:
            _write_json(Path(cfg.metrics_file), {**dataclasses.asdict(result),
                                                 "final_loss": result.final_loss,
                                                 "params_identical": same,
                                                 "config": dataclasses.asdict(cfg)})


def _open_data(cfg: TrainConfig, master: bool) -> torch.utils.data.Dataset:
    """The HDF5 dataset (checked against the model before the first step) or synthetic data."""
    if not cfg.data:
        return synthetic_dataset(cfg.model, cfg.num_samples)
    try:
        return H5Dataset(cfg.data, model=cfg.model)
    except HvdkitError as err:
        err.echo = master  # every rank reads the same file and fails the same way
        raise


def _write_json(path: Path, data: dict) -> None:
    write_json_atomic(path, data)
    diag(f"wrote {path}")
