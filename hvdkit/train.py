"""The training loop, readable in one sitting; the same code runs on every backend.

``train(cfg)`` builds the example model, wraps it with the chosen backend,
resumes from rank 0's newest checkpoint (or broadcasts rank 0's fresh
weights), and trains with a linearly scaled, warmed-up learning rate. Every
side effect (printing, files, requeue) is gated on ``master = backend.is_master``,
which is the *global* rank 0.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import signal
import socket
import sys
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

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
from .preemption import PreemptionGuard, requeue_slurm_job
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


def _log(msg: str) -> None:
    print(f"[hvdkit] {msg}", flush=True)


def train(cfg: TrainConfig, backend: Backend | None = None,
          log: Callable[[str], None] = _log) -> TrainResult:
    """Run one training job; collective, so every rank must call it."""
    owns_backend = backend is None
    backend = backend or create_backend(cfg.backend)
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
               scaler: torch.amp.GradScaler | None = None) -> torch.Tensor:
    """One optimizer step over ``accum`` micro-batches; returns the step's mean loss (on device).

    Only the last micro-batch communicates (DDP ``no_sync`` / Horovod
    ``backward_passes_per_step``); dividing each loss by ``accum`` makes the
    summed gradient the mean over the whole global batch. With bf16/fp16 the
    forward pass runs under autocast; fp16 scales the loss (``scaler``) and the
    backend applies the step in the order its reduction needs.
    """
    total = torch.zeros((), dtype=torch.float64, device=device)
    for micro in range(accum):
        x, y = next(batches)
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        with backend.accumulate(model, sync=micro == accum - 1):
            with autocast(precision, device):
                loss = nn.functional.cross_entropy(model(x), y) / accum
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
class _Run:
    """One training run: built once by :func:`_set_up`; the loop pieces below change only
    ``state`` (where the loop is), ``loss_sum`` (this epoch's running loss), the record of
    the last save, and ``result``."""

    cfg: TrainConfig
    backend: Backend
    log: Callable[[str], None]
    result: TrainResult
    geo: _Geometry
    dataset: torch.utils.data.Dataset
    model: nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    scaler: torch.amp.GradScaler | None
    ckpt: CheckpointManager | None
    state: TrainingState
    watch: NonFiniteWatch
    asha: AshaTrial | None
    loss_sum: torch.Tensor
    saved_step: int | None = None  # at most one checkpoint per step
    saved_name: str | None = None

    @property
    def master(self) -> bool:
        return self.backend.is_master  # global rank 0: the only rank with side effects

    def save(self) -> None:
        """Collective: checkpoint the current step (once), with every rank's running loss."""
        assert self.ckpt is not None
        if self.saved_step == self.state.global_step:
            return
        self.state.extra = {"loss_sums": self.backend.gather_objects(float(self.loss_sum)),
                            "epoch_losses": self.result.epoch_losses}
        path = self.ckpt.save(self.model, self.optimizer, self.scheduler, self.state, self.scaler,
                              skip_nonfinite=self.watch.mode == "warn")
        self.saved_step = self.state.global_step
        self.saved_name = path.name if path is not None else self.saved_name

    def check_nonfinite(self, flagged: bool, before_save: bool) -> None:
        """Collective: stop or warn at a non-finite loss; the per-step flag lags one step, so
        before a save this step is asked about too."""
        if flagged or (before_save and self.watch.check_now()):
            self.watch.handle(self.state.global_step, self.saved_name, self.log)


def _set_up(cfg: TrainConfig, backend: Backend, log: Callable[[str], None], result: TrainResult) -> _Run:
    """Placement, data, model, optimizer, schedule, and the state to start from (restored or fresh)."""
    master = backend.is_master
    size, accum = backend.size, cfg.backend.accumulation_steps
    result.placement = backend.gather_objects(
        {"rank": backend.rank, "local_rank": backend.local_rank, "host": socket.gethostname(),
         "pid": os.getpid(), "threads": torch.get_num_threads()})
    result.ranks = [f"{p['rank']}@{p['host']}:{p['pid']}" for p in result.placement]
    result.topology = backend.topology([p["host"] for p in result.placement])

    dataset = _open_data(cfg, master)
    geo = _geometry(cfg, size, len(dataset))
    if master and cfg.global_batch_size not in (None, geo.global_batch):
        log(f"WARNING: global batch {cfg.global_batch_size} rounded down to {geo.global_batch}")

    # Ranks start from *different* weights on purpose: broadcast_state (or
    # restore) must make them rank 0's, and the tests check that it does.
    torch.manual_seed(cfg.seed + backend.rank)
    model = build_model(cfg.model, seed=cfg.seed + backend.rank)
    lr_scale = float(size * accum) if cfg.scale_lr else 1.0  # bigger global batch, bigger LR
    optimizer = make_optimizer(cfg, model.parameters(), cfg.lr * lr_scale)
    model, optimizer = backend.wrap(model, optimizer)
    warmup_steps = int(cfg.warmup_epochs * geo.steps_per_epoch)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: warmup_factor(step, warmup_steps, lr_scale)
    )

    scaler = make_scaler(cfg.precision, backend.device)  # fp16 only; its state is checkpointed
    ckpt = CheckpointManager(cfg.checkpoint_dir, backend, cfg.keep_checkpoints) if cfg.checkpoint_dir else None
    state = ckpt.restore(model, optimizer, scheduler, scaler) if (ckpt and cfg.resume) else None
    if state is None:
        if not (ckpt and cfg.resume):  # restore() already broadcast rank 0's weights
            backend.broadcast_state(model, optimizer)
        state = TrainingState()
    result.epoch_losses = list(state.extra.get("epoch_losses", []))
    if master:
        log(f"{backend.describe()}; {cfg.precision}; world {size}, batch {geo.batch}/rank, global {geo.global_batch}, "
            f"lr {cfg.lr * lr_scale:g}, {geo.steps_per_epoch} steps/epoch, "
            f"{result.topology['nodes']} node(s) {' '.join(result.topology['hosts'])}, start step "
            f"{state.global_step}, slurm restarts {os.environ.get('SLURM_RESTART_COUNT', '0')}")
    return _Run(cfg=cfg, backend=backend, log=log, result=result, geo=geo, dataset=dataset, model=model,
                optimizer=optimizer, scheduler=scheduler, scaler=scaler, ckpt=ckpt, state=state,
                watch=NonFiniteWatch(backend, cfg.on_nonfinite),
                asha=AshaTrial(cfg.asha_dir, cfg.asha_trial) if master and cfg.asha_dir else None,
                loss_sum=torch.zeros((), dtype=torch.float64, device=backend.device),
                saved_name=f"ckpt-{state.global_step:09d}.h5" if ckpt and state.global_step else None)


def _train(cfg: TrainConfig, backend: Backend, log: Callable[[str], None],
           result: TrainResult) -> TrainResult:
    run = _set_up(cfg, backend, log, result)
    state = run.state
    sampler = ShardSampler(len(run.dataset), backend.size, backend.rank, seed=cfg.seed)
    done = cfg.max_steps is not None and state.global_step >= cfg.max_steps
    # --timeline: Horovod writes its own (set at init); other backends take a profiler trace here
    timeline = backend.profiler_trace_path(cfg.backend.horovod.timeline)
    with PreemptionGuard() as guard, step_profiler(timeline, run.master) as profiler:
        for epoch in range(state.epoch, cfg.epochs if not done else state.epoch):
            sampler.set_epoch(epoch, start=state.samples_in_epoch)
            first_step = state.samples_in_epoch // run.geo.global_batch
            t0 = time.perf_counter()
            if _one_epoch(run, sampler, first_step, guard, profiler):
                return result  # preempted or at --max-steps: saved and reported
            if not _end_epoch(run, epoch, first_step, time.perf_counter() - t0):
                break  # ASHA pruned this trial

    result.global_step = state.global_step
    _report_done(cfg, backend, run.model, result, log)
    return result


def _one_epoch(run: _Run, sampler: ShardSampler, first_step: int, guard: PreemptionGuard,
               profiler) -> bool:  # noqa: ANN001 - torch profiler or a no-op
    """The steps of one epoch from ``first_step``; True when the run must end here."""
    cfg, backend, state, geo = run.cfg, run.backend, run.state, run.geo
    batches = iter(DataLoader(run.dataset, batch_size=geo.batch, sampler=sampler, drop_last=True))
    # a tensor, so that the loss is never pulled to the host inside the step
    run.loss_sum = torch.tensor(_resumed_loss_sum(state, backend), dtype=torch.float64, device=backend.device)
    run.model.train()
    for step_in_epoch in range(first_step, geo.steps_per_epoch):
        # Agree on preemption and earlier non-finite losses while this step computes.
        agreement = backend.start_any_flags([guard.requested, run.watch.flag()])
        loss = train_step(backend, run.model, run.optimizer, batches, cfg.backend.accumulation_steps,
                          backend.device, cfg.precision, run.scaler)
        run.watch.record(loss, state.global_step + 1)
        run.loss_sum += loss
        run.scheduler.step()
        profiler.step()
        state.global_step += 1
        state.samples_in_epoch += geo.global_batch
        state.samples_seen += geo.global_batch
        if run.master and cfg.log_every and state.global_step % cfg.log_every == 0:
            run.log(f"step {state.global_step} loss {loss.item():.6f} "
                    f"lr {run.scheduler.get_last_lr()[0]:.5g}")

        stop, nonfinite = agreement()  # the same answers on every rank
        limit = cfg.max_steps is not None and state.global_step >= cfg.max_steps
        # the epoch's last step is saved by the epoch-end checkpoint
        periodic = (cfg.checkpoint_every and state.global_step % cfg.checkpoint_every == 0
                    and step_in_epoch + 1 < geo.steps_per_epoch)
        wants_save = bool(run.ckpt and (stop or limit or periodic))
        run.check_nonfinite(nonfinite and not run.watch.warned, before_save=wants_save)
        if wants_save:
            run.save()
        if stop:
            _report_preemption(cfg, backend, guard, state, run.result, bool(run.ckpt), run.log)
            return True
        if limit:
            if run.master:
                run.log(f"stopped at max_steps={cfg.max_steps}{'; checkpoint saved' if run.ckpt else ''}")
            run.result.global_step = state.global_step
            return True
    return False


def _end_epoch(run: _Run, epoch: int, first_step: int, seconds: float) -> bool:
    """Epoch loss and throughput, the non-finite check, ASHA's rung, the epoch checkpoint.

    Returns False when ASHA pruned the trial.
    """
    backend, geo, state = run.backend, run.geo, run.state
    # Throughput of the slowest rank is the job's throughput.
    slowest = backend.allreduce_metric(seconds, op="max")
    steps_here = geo.steps_per_epoch - first_step
    sps = steps_here * geo.global_batch / slowest if slowest > 0 else float("nan")
    epoch_loss = backend.allreduce_metric(run.loss_sum / geo.steps_per_epoch)
    run.result.epoch_losses.append(epoch_loss)
    run.result.samples_per_sec.append(sps)
    if run.master:
        run.log(f"epoch {epoch} loss {epoch_loss:.6f} samples/s {sps:.1f} ({backend.size} ranks)")
    state.epoch, state.samples_in_epoch = epoch + 1, 0
    run.check_nonfinite(not run.watch.warned and run.watch.check_now(), before_save=False)
    run.loss_sum.zero_()
    # ASHA decides before the save: a trial requeued in between meets the same rung
    # again and reuses the recorded decision
    go_on = _asha_rung(run.cfg, run.asha, backend, state.epoch, epoch_loss, run.result, run.log)
    if run.ckpt:
        run.save()
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


def _resumed_loss_sum(state: TrainingState, backend: Backend) -> float:
    """This rank's running loss sum for the epoch being resumed (its own if the world is unchanged)."""
    sums = state.extra.get("loss_sums")
    if not sums:
        return 0.0
    return float(sums[backend.rank]) if len(sums) == backend.size else sum(sums) / len(sums)


def _write_json(path: Path, data: dict) -> None:
    write_json_atomic(path, data)
    print(f"[hvdkit] wrote {path}", file=sys.stderr, flush=True)
