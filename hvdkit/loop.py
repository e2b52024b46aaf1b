"""The training loop, readable in one sitting; the same code runs on every backend, model and data.

``train(cfg)``, on every rank:

1. set up, locally: data, model (built in or yours), task, optimizer, LR schedule (:func:`_set_up`);
2. check one batch through the model on every rank before anything else (:func:`_check_data`);
3. sync: resume the newest valid checkpoint, or take rank 0's weights (elastic: the newest commit);
4. epochs of steps (:func:`_one_epoch`); at each epoch's end the loss, held-out metrics, ASHA's
   rung and a checkpoint (:func:`_step_tail`, the one tail of every step and epoch);
5. check that every rank holds the same weights; rank 0 writes the metrics file.

Every side effect (printing, files, requeue) is gated on ``run.master``, the *global* rank 0.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import math
import os
import socket
import time
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

from . import state as states_mod
from .advice import WAIT_SHARE, advise
from .asha import AshaTrial
from .backends import Backend, create_backend
from .backends.footprint import ModelSizes, model_sizes
from .checkpoint import CheckpointManager
from .config import TrainConfig
from .data import SampleSeeded, ShardSampler, all_labels, open_datasets, per_rank_batch_size, unwrap_dataset
from .elastic import ElasticMemory, LoopStates
from .errors import ConfigError, HvdkitError
from .faults import hold_point
from .fileio import write_json_atomic
from .log import configure as configure_log
from .log import debug, diag, warn
from .log import result as result_line
from .memory import peak_rss, rank_memory
from .metrics import evaluate
from .models import build_model_lazily
from .nonfinite import NonFiniteWatch
from .observe import Observers
from .optim import make_optimizer
from .position import LoopPosition, RunningLoss
from .precision import autocast, lowp_support, make_scaler
from .preemption import Preempted, Preemption
from .preflight import activation_meter, current_rss, preflight
from .profiling import step_profiler
from .samplelog import SampleLog
from .schedule import LrPlan, warmup_factor
from .sizes import nbytes
from .tasks import Task, check_labels, make_task, to_device

__all__ = ["TrainResult", "train", "train_step", "make_optimizer", "warmup_factor", "param_digest"]


@dataclass
class TrainResult:
    """What a run did, identical on every rank."""

    backend: str
    world_size: int
    shard: str = "none"  # --shard: none, optimizer (ZeRO) or full (FSDP2)
    epoch_losses: list[float] = field(default_factory=list)
    samples_per_sec: list[float] = field(default_factory=list)
    history: list[dict[str, Any]] = field(default_factory=list)  # per epoch: loss, val_*, samples/s
    val: dict[str, float] = field(default_factory=dict)           # the last validation metrics
    best: dict[str, Any] | None = None                            # --keep-best's record
    global_step: int = 0
    start_step: int = 0                 # the step this run (its last sync, if elastic) started at
    resumed_from: str | None = None     # the checkpoint it restored, if any
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
    partial_loss: float | None = None  # stopped mid-epoch (--max-steps): that epoch's loss so far
    memory: list[dict] = field(default_factory=list)  # per rank: bytes held (hvdkit.memory)
    # --shard optimizer, rank 0: gradient buckets, and how many started while backward still ran
    shard_overlap: dict = field(default_factory=dict)
    # --compression powersgd: its settings, the steps it compressed and the elements it sent
    compression: dict = field(default_factory=dict)

    @property
    def final_loss(self) -> float:
        """The loss of the last epoch trained (of its steps so far when the run stopped in it)."""
        if self.partial_loss is not None:
            return self.partial_loss
        return self.epoch_losses[-1] if self.epoch_losses else float("nan")


def param_digest(model: nn.Module | dict[str, Any]) -> str:
    """SHA-256 of all parameters and buffers (a module or its state dict), to compare ranks and
    runs bit for bit. A wrapper's (DDP's, ``DataParallel``'s) ``module.`` prefix, on every key,
    is dropped: the same weights give the same digest whatever holds them. A state dict with
    :class:`~hvdkit.h5tree.Deferred` tensors (a sharded model's) is hashed one tensor at a
    time as each is fetched (collective: call it on every rank); ranks that get no tensor
    (all but rank 0) return a digest of the names only, which nothing compares."""
    from .h5tree import Deferred

    state = model if isinstance(model, dict) else model.state_dict()
    if state and all(name.startswith("module.") for name in state):
        state = {name[len("module."):]: tensor for name, tensor in state.items()}
    h = hashlib.sha256()
    for name, tensor in state.items():
        h.update(name.encode())
        value = tensor.fetch() if isinstance(tensor, Deferred) else tensor
        if value is not None:
            h.update(value.detach().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()[:16]


def train(cfg: TrainConfig, backend: Backend | None = None,
          log: Callable[[str], None] = result_line) -> TrainResult:
    """Run one training job; collective, so every rank must call it."""
    owns_backend = backend is None
    hold_point("setup")  # a fault lands here, before the ranks meet (tests of preemption during start-up)
    backend = backend or create_backend(cfg.backend)
    seen = [backend.rank]

    def rank() -> int:  # rank 0 speaks; elastic ranks change, so it is asked every time
        seen[0] = backend.rank
        return seen[0]

    configure_log(cfg.log_level, rank=rank)
    result = TrainResult(backend=backend.name, world_size=backend.size, shard=cfg.backend.shard)
    try:
        return _train(cfg, backend, log, result)
    except BaseException as exc:
        # Whatever failed here, the peers may be waiting in a collective this rank will never
        # join: shutdown() must not wait for them (DDP's exit barrier hung until --ddp-timeout).
        # This process exits; its peers then see the connection drop and stop too.
        backend.abort()
        # The traceback's frames hold the model, and through it the communicator's connections
        # (FSDP's units hold the process group): let them go, so that shutdown() can close
        # them and the peers hear that this rank failed. What the traceback prints is kept.
        traceback.clear_frames(exc.__traceback__)
        if not (isinstance(exc, RuntimeError) and backend.is_peer_failure(exc)):
            # who failed, for the one-line error 'hvdkit train' prints under the traceback
            exc.hvdkit_rank = f"rank {backend.rank}/{backend.size} ({backend.name}) on {socket.gethostname()}"  # type: ignore[attr-defined]
            raise
        who = _peers_text(backend.rank, result.placement, backend.size)
        resume = f"rerun the job: it resumes from the last checkpoint in {cfg.checkpoint_dir}" \
            if cfg.checkpoint_dir else "rerun the job (with --checkpoint-dir it would resume)"
        raise HvdkitError(
            f"rank {backend.rank}/{backend.size} ({backend.name}) lost contact with {who}: "
            f"{backend.failure_summary(exc)}", resume) from None
    finally:
        # the log must not ask a backend that is gone (Horovod raises once shut down): the
        # last rank it gave stays this process's rank for whatever is logged afterwards
        configure_log(cfg.log_level, rank=lambda: seen[0])
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


def train_step(backend: Backend, model: nn.Module, optimizer: torch.optim.Optimizer, task: Task,
               batches: Iterator[Any], accum: int, precision: str = "fp32",
               scaler: torch.amp.GradScaler | None = None, weight: float | None = None,
               clip: float | None = None) -> torch.Tensor:
    """One optimizer step over ``accum`` micro-batches; returns the step's mean loss (on device).

    Only the last micro-batch communicates (DDP ``no_sync`` / Horovod
    ``backward_passes_per_step``); dividing each loss by ``accum`` makes the summed gradient
    the mean over the whole global batch. With bf16/fp16 the forward pass runs under
    autocast; fp16 scales the loss (``scaler``). The backend applies the step in the order
    its reduction needs, clipping the reduced gradients to ``clip`` (their global norm).
    ``weight`` multiplies the loss (uneven shards: see :func:`_one_epoch`).
    """
    total = torch.zeros((), dtype=torch.float64, device=backend.device)
    for micro in range(accum):
        batch = to_device(next(batches), backend.device)
        with backend.accumulate(model, sync=micro == accum - 1):
            with autocast(precision, backend.device):
                loss = task(model, batch)["loss"] / accum
                if weight is not None:
                    loss = loss * weight
            (scaler.scale(loss) if scaler is not None else loss).backward()
        total += loss.detach()
    backend.optimizer_step(optimizer, scaler, clip_grad_norm=clip)
    optimizer.zero_grad()
    return total


@dataclass
class _Geometry:
    """Batch sizes and steps, derived from the config and the world size."""

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
            f"{num_samples} training samples are fewer than one global batch of {global_batch}",
            "use more data (--num-samples) or a smaller --batch-size",
        )
    return _Geometry(batch, global_batch, min(steps, cfg.steps_per_epoch or steps))


@dataclass
class _Run:
    """One training run, built once by :func:`_set_up` without talking to other ranks.

    The loop's position and measurements live in ``progress`` (saved in checkpoints and
    elastic commits); ``states`` is everything a resume restores. The rest is this process's
    machinery, rebuilt on every start.
    """

    cfg: TrainConfig
    backend: Backend
    log: Callable[[str], None]
    result: TrainResult
    geo: _Geometry
    lr_plan: LrPlan
    train_data: Dataset
    val_data: Dataset | None
    task: Task
    model: nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    scaler: torch.amp.GradScaler | None
    ckpt: CheckpointManager | None
    watch: NonFiniteWatch
    samples: SampleLog | None
    built_rss: int  # peak RSS once the model was built and wrapped (memory.rank_memory)
    sizes: ModelSizes | None  # the model's sizes, whole, where the memory preflight runs (hvdkit.preflight)
    observers: Observers
    progress: LoopPosition = field(default_factory=LoopPosition)
    loss: RunningLoss = field(init=False)  # the epoch's running loss (over self.progress)
    saved_step: int | None = None  # at most one checkpoint per step
    saved_name: str | None = None
    asha: AshaTrial | None = None
    resumable: LoopStates = field(init=False)  # what follows each load of the states
    elastic: ElasticMemory | None = None  # host-memory commits (elastic runs only)
    advised: bool = False  # the network advice (hvdkit.advice) is asked once per run

    def __post_init__(self) -> None:
        self.loss = RunningLoss(self.progress, self.backend.device)
        self.resumable = LoopStates(self.states, self.progress, self.loss, self.samples, self.backend, self.start)

    @property
    def master(self) -> bool:
        return self.backend.is_master  # global rank 0: the only rank with side effects

    @property
    def states(self) -> dict[str, Any]:
        """What a checkpoint or an elastic commit holds."""
        out: dict[str, Any] = {"model": self.model, "optimizer": self.optimizer,
                               "scheduler": self.scheduler, "loop": self.progress}
        if self.scaler is not None:
            out["scaler"] = self.scaler
        return out

    @property
    def step(self) -> int:
        return self.progress.global_step

    @property
    def epoch_samples(self) -> int:
        """Samples in this epoch at the current world size (the epoch ends before a partial batch)."""
        return self.geo.steps_per_epoch * self.geo.global_batch

    def start(self) -> None:
        """Collective: the newest valid checkpoint, or rank 0's fresh weights, on every rank
        (``LoopStates.start_fresh``: an elastic run's first sync finds no commit, too)."""
        restored = self.ckpt.restore(self.states) if (self.ckpt and self.cfg.resume) else None
        if not (self.ckpt and self.cfg.resume):  # restore() broadcasts either way
            states_mod.broadcast(self.states, self.backend, root=0)
        if restored is not None:
            self.saved_step, self.saved_name = restored.step, restored.path.name
            self.result.resumed_from = str(restored.path)

    # -- the loop's collective checkpoints --------------------------------------------------
    def save(self) -> None:
        """Collective: checkpoint the current step (once), with every rank's running loss."""
        if self.ckpt is None or self.saved_step == self.step:
            return
        self.loss.before_save(self.backend)
        path = self.ckpt.save(self.step, self.states, metrics=self._metrics_now(),
                              skip_nonfinite=self.watch.mode == "warn")
        self.saved_step = self.step
        self.saved_name = path.name if path is not None else self.saved_name
        if self.samples is not None:  # a resume continues from here, so what led here is logged
            self.samples.record(self.progress.epoch, self.step)

    def _metrics_now(self) -> dict[str, float]:
        last = self.progress.history[-1] if self.progress.history else {}
        return {**{k: v for k, v in last.items() if isinstance(v, (int, float)) and k not in ("epoch", "step")},
                **{f"val_{k}": v for k, v in self.progress.last_eval.items()}}

    def check_nonfinite(self, flagged: bool, before_save: bool) -> None:
        """Collective: stop or warn at a non-finite loss; the per-step flag lags one step, so
        before a save this step is asked about too."""
        if flagged or (before_save and self.watch.check_now()):
            self.watch.handle(self.step, self.saved_name, self.log)

    def fold(self) -> None:
        """Collective: fold the running loss over ranks, log the samples, and (elastic) commit.

        Folding at the same steps in every mode keeps the epoch loss bit-identical between
        elastic and plain runs; a world that changes between commits then loses nothing.
        """
        self.loss.fold(self.backend)
        if self.samples is not None:
            self.samples.record(self.progress.epoch, self.step)
        if self.cfg.elastic:
            if self.master and self.cfg.log_every:
                self.log(f"commit at step {self.step} (world {self.backend.size})")
            self.backend.elastic_commit()  # calls commit_to_memory; raises if hosts changed


def _set_up(cfg: TrainConfig, backend: Backend, log: Callable[[str], None], result: TrainResult) -> _Run:
    """Data, model, task, optimizer and schedule; local to this rank (no collective: an elastic
    newcomer builds these while the others are already training)."""
    try:
        train_data, val_data = open_datasets(cfg)
    except HvdkitError as err:
        err.echo = backend.is_master  # every rank reads the same data and fails the same way
        raise
    wants_val = [flag for flag, on in (("--eval-every", cfg.eval_every),
                                       ("--keep-best", (cfg.keep_best or "").startswith("val_"))) if on]
    if val_data is None and wants_val:
        missing = ConfigError(f"{wants_val[0]} needs validation data, and --dataset {cfg.dataset} gave none",
                              "return (train, val) from the factory, or add --val-fraction F")
        missing.echo = backend.is_master
        raise missing
    samples = SampleLog(cfg.sample_log, backend) if cfg.sample_log else None
    if samples is not None:
        train_data = samples.watch(train_data)
    if cfg.num_workers:
        train_data = SampleSeeded(train_data, cfg.seed)  # augmentation independent of workers
    geo = _geometry(cfg, backend.size, len(train_data))  # type: ignore[arg-type]  # map-style: sized; refuses a bad batch here, before any collective
    # Ranks start from *different* weights on purpose: the sync (a restore, or rank 0's
    # broadcast) must make them rank 0's, and the tests check that it does.
    torch.manual_seed(cfg.seed + backend.rank)
    built = build_model_lazily(cfg.model, seed=cfg.seed + backend.rank, args=cfg.model_args)
    model = built.model
    params = list(model.parameters())
    if not any(p.requires_grad for p in params):
        frozen = ConfigError(f"--model {cfg.model} has nothing to train: "
                             + (f"all its {len(params)} parameter tensors are frozen (requires_grad=False)"
                                if params else "it has no parameters"),
                             "unfreeze some parameters, or give a model with trainable ones")
        frozen.echo = backend.is_master  # every rank builds the same model
        raise frozen
    task = make_task(cfg.task)
    plan = LrPlan(kind=cfg.lr_schedule, min_ratio=cfg.min_lr_ratio, gamma=cfg.lr_gamma)
    optimizer = make_optimizer(cfg, model, cfg.lr)
    # whole, before a strategy shards them: the memory preflight's sizes (ZeRO's plan at this size)
    sizes = model_sizes(model, [p for g in optimizer.param_groups for p in g["params"]], backend.size,
                        cfg.backend.bucket_cap_mb) if cfg.checks_memory else None
    model, optimizer = backend.wrap(model, optimizer, init=built.init)
    built_rss = peak_rss()
    if backend.is_master and (built.declared or cfg.backend.shard == "full"):  # where the path matters
        diag(f"model: --model {cfg.model} {built.how}")
    if cfg.backend.activation_checkpointing and backend.is_master:
        if backend.checkpointed_blocks:
            diag(f"activation checkpointing: {backend.checkpointed_blocks} block(s) of --model {cfg.model} "
                 "recomputed in backward")
        else:  # said, never silent: the option then changes nothing
            warn(f"--activation-checkpointing: --model {cfg.model} has no block to recompute (an entry of an "
                 "nn.ModuleList/nn.Sequential that holds modules of its own); every activation is kept")
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, plan.factor)
    ckpt = CheckpointManager(cfg.checkpoint_dir, backend, cfg.keep_checkpoints, cfg.keep_best) \
        if cfg.checkpoint_dir else None
    return _Run(cfg=cfg, backend=backend, log=log, result=result, geo=geo, lr_plan=plan, train_data=train_data,
                val_data=val_data, task=task, model=model, optimizer=optimizer, scheduler=scheduler,
                scaler=make_scaler(cfg.precision, backend.device),  # fp16 only; checkpointed
                ckpt=ckpt, watch=NonFiniteWatch(backend, cfg.on_nonfinite), samples=samples,
                observers=Observers(cfg, backend.is_master), built_rss=built_rss, sizes=sizes)


def _check_data(run: _Run) -> None:
    """Collective: one batch of each dataset through the model on every rank, before any step.

    A sample shape, dtype, label or vocabulary the model does not take fails here in one line
    (the task says what is wrong), not hours later inside a collective. Eval mode and no
    gradients: nothing the check does changes the run.
    """
    plain = run.backend.strategy.eval_module(run.model)
    checked = run.sizes is not None  # TrainConfig.checks_memory
    runtime = current_rss() if checked else 0  # before the first batch: torch, the data, the model as held
    meter = activation_meter(run.cfg, plain)
    problems = []
    for name, data in (("training", unwrap_dataset(run.train_data)), ("validation", run.val_data)):
        if data is None:
            continue
        try:
            batch = next(iter(DataLoader(data, batch_size=min(run.geo.batch, len(data)))))  # type: ignore[arg-type]
            was = plain.training
            plain.eval()
            try:  # the training batch's activations are counted for the memory preflight
                with torch.no_grad(), autocast(run.cfg.precision, run.backend.device), \
                        meter.counting() if name == "training" and checked else contextlib.nullcontext():
                    facts = run.task.check(plain, to_device(batch, run.backend.device))
            finally:
                plain.train(was)
            if "classes" in facts:  # every label where the data can list them, else this batch's
                labels = all_labels(data)
                if labels is None:
                    check_labels(facts["batch_labels"], facts["classes"])
                else:
                    check_labels(labels, facts["classes"], where=" (sample {})")
        except HvdkitError as exc:
            hint = f" HINT: {exc.hint}" if exc.hint else ""
            problems.append(f"{name} data does not fit the model: {exc.message}{hint}")
        except Exception as exc:  # the model's own error: one line
            from .errors import first_line

            problems.append(f"{name} data does not fit --model {run.cfg.model}: the first batch raised "
                            f"{type(exc).__name__}: {first_line(exc)} HINT: check the data's sample "
                            "shape and dtype against what the model takes")
    if run.cfg.elastic:  # a newcomer checks while the others train: no collective, each rank says it
        found = problems[:1]
    else:
        found = run.backend.gather_objects(problems[0] if problems else None)  # type: ignore[arg-type]
    first = next((p for p in found if p), None)
    if first is not None:
        message, _, hint = first.partition(" HINT: ")
        err = HvdkitError(message, hint or None)
        err.echo = run.master or run.cfg.elastic
        raise err
    if run.sizes is not None:
        params, _, _ = run.backend.strategy.held(run.model, run.optimizer)
        preflight(run.cfg, run.backend, run.sizes, nbytes(params), runtime, meter.bytes)


def _enter(run: _Run) -> None:
    """Collective, at the start and after every elastic reset: where the ranks are, and what
    depends on the world size (batch geometry, LR scale, warm-up and schedule)."""
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
    run.geo = geo = _geometry(cfg, size, len(run.train_data))  # type: ignore[arg-type]
    if run.master and cfg.global_batch_size not in (None, geo.global_batch):
        warn(f"global batch {cfg.global_batch_size} rounded down to {geo.global_batch}")
    plan = run.lr_plan
    plan.scale = float(size * accum) if cfg.scale_lr else 1.0
    plan.warmup_steps = int(cfg.warmup_epochs * geo.steps_per_epoch)
    # cosine's horizon: the run's length (stopping early with --max-steps and resuming later
    # without it changes the schedule; --lr-decay-steps pins it, as nanoGPT's lr_decay_iters)
    plan.total_steps = cfg.lr_decay_steps or min(cfg.max_steps or 1 << 62, cfg.epochs * geo.steps_per_epoch)
    plan.step_every = max(1, round(cfg.lr_step_epochs * geo.steps_per_epoch))
    # the LR of the *current* world, also after a restore from a checkpoint of another size
    run.scheduler.base_lrs = [cfg.lr * plan.scale for _ in run.optimizer.param_groups]
    for group, lr in zip(run.optimizer.param_groups, run.scheduler.base_lrs):
        group["lr"] = lr * plan.factor(run.step)
    spec = cfg.backend.compression
    if run.master and spec.kind == "powersgd" and run.step == result.start_step:
        from .backends.powersgd import idle_reasons  # said before the first step, not found in the report

        shapes = [p.shape for p in run.model.parameters() if p.requires_grad]
        for reason in idle_reasons(spec, shapes, min(cfg.max_steps or 1 << 62, cfg.epochs * geo.steps_per_epoch),
                                   run.step):
            warn(f"--compression powersgd does nothing here: {reason}")
    if cfg.asha_dir and run.master and run.asha is None:
        run.asha = AshaTrial(cfg.asha_dir, cfg.asha_trial or 0)  # the config requires both
    result.start_step = run.step
    if run.master:
        run.log(f"{backend.describe()}; {cfg.precision}; world {size}, batch {geo.batch}/rank, "
                f"global {geo.global_batch}, "
                f"lr {cfg.lr * plan.scale:g}, {geo.steps_per_epoch} steps/epoch, "
                f"{result.topology['nodes']} node(s) {' '.join(result.topology['hosts'])}, start step "
                f"{run.step}, slurm restarts {os.environ.get('SLURM_RESTART_COUNT', '0')}, "
                f"ranks {' '.join(result.ranks)}")


def _train(cfg: TrainConfig, backend: Backend, log: Callable[[str], None],
           result: TrainResult) -> TrainResult:
    preemption = Preemption(backend, requeue=cfg.requeue, log=log)  # signals are caught from here on
    emulated = lowp_support(cfg.precision, backend.device).warning()
    if emulated and backend.is_master:  # said before the first step, not found in the step times
        warn(emulated)
    run = _set_up(cfg, backend, log, result)
    preemption.on_stop = lambda _step: run.save()
    try:
        _check_data(run)
        if cfg.elastic:
            run.elastic = ElasticMemory(backend, run.resumable)  # commits in host memory: elastic runs only
            diag(f"elastic worker rank {backend.rank} of {backend.size} (local {backend.local_rank}) host "
                 f"{backend.slot_host()} pid {os.getpid()}", every_rank=True)
            # sync, then the loop; after a lost or added worker: roll back or keep, re-sync, re-enter
            try:
                backend.run_elastic(lambda: _loop(run, preemption), run.elastic)
            except ConfigError as err:  # the same refusal on every rank: one of them says it
                err.echo = backend.is_master
                raise
        else:
            run.start()
            run.resumable.loaded()
            _loop(run, preemption)
    except Preempted as stop:
        result.preempted, result.status = True, "preempted"
        result.global_step, result.requeued, result.requeue = stop.step, stop.requeued, stop.outcome
    finally:
        run.observers.close()
        result.history = run.progress.history  # a load replaces the list: the final one
    return result


def _loop(run: _Run, preemption: Preemption) -> None:
    """The epochs from wherever ``run.progress`` says; re-entered after an elastic reset."""
    cfg, backend = run.cfg, run.backend
    _enter(run)
    # --timeline: Horovod writes its own (set at init); other backends take a profiler trace here
    timeline = backend.profiler_trace_path()
    with preemption, step_profiler(timeline, run.master) as profiler:
        while not _at_limit(run) and run.progress.epoch < cfg.epochs:
            p = run.progress
            sampler = ShardSampler(len(run.train_data), backend.size, backend.rank,  # type: ignore[arg-type]
                                   seed=cfg.seed, uneven=cfg.uneven)
            sampler.set_epoch(p.epoch, start=p.samples_in_epoch)
            if isinstance(run.train_data, SampleSeeded):
                run.train_data.epoch = p.epoch
            first_sample, t0, waited = p.samples_in_epoch, time.perf_counter(), backend.comm_wait
            last = _one_epoch(run, sampler, preemption, profiler)
            if last is None:
                # at --max-steps mid-epoch: evaluated and saved; its loss so far is the final one
                run.result.partial_loss = run.loss.mean(backend)
                break
            epoch = _EpochEnd(p.samples_in_epoch - first_sample, time.perf_counter() - t0,
                              backend.comm_wait - waited)
            if _step_tail(run, preemption, *last, epoch=epoch):
                break  # ASHA pruned this trial
    if _at_limit(run) and run.master:
        run.log(f"stopped at max_steps={cfg.max_steps}{'; checkpoint saved' if run.ckpt else ''}")
    run.result.global_step = run.step
    _report_done(run)


def _at_limit(run: _Run) -> bool:
    return run.cfg.max_steps is not None and run.step >= run.cfg.max_steps


@dataclass(frozen=True)
class _StepShare:
    """What one optimizer step of an epoch reads, as every rank can compute it in advance."""

    mine: int   # samples this rank reads (0: its shard is done, it has joined)
    total: int  # samples all ranks read
    full: bool  # every rank reads a full batch: the step may talk beyond its gradients


def _epoch_steps(run: _Run, sampler: ShardSampler) -> list[_StepShare]:
    """The steps left in this epoch. Even shards: equal full steps until less than a global
    batch is left (dropped). ``--uneven``: every sample; lower ranks may have one sample
    more and the last batch of a rank may be partial."""
    geo, size = run.geo, run.backend.size
    if not run.cfg.uneven:
        n = (run.epoch_samples - run.progress.samples_in_epoch) // geo.global_batch
        return [_StepShare(geo.global_batch // size, geo.global_batch, True)] * n
    lengths = [sampler.shard_length(r) for r in range(size)]
    steps = []
    for k in range(-(-lengths[0] // geo.batch)):  # rank 0's shard is the longest
        counts = [min(geo.batch, max(0, n - k * geo.batch)) for n in lengths]
        steps.append(_StepShare(counts[run.backend.rank], sum(counts), all(c == geo.batch for c in counts)))
    return steps


def _one_epoch(run: _Run, sampler: ShardSampler, preemption: Preemption,
               profiler: Any) -> tuple[bool, bool] | None:
    """The steps of the epoch from ``progress.samples_in_epoch``. Returns what the ranks agreed
    on during its last step (stop, non-finite), for the epoch's end to act on; None when the run
    ends before the epoch does (``--max-steps``). A preemption raises :class:`Preempted` after
    its checkpoint."""
    cfg, backend, geo = run.cfg, run.backend, run.geo
    loader = DataLoader(run.train_data, batch_size=geo.batch, sampler=sampler, drop_last=not cfg.uneven,
                        num_workers=cfg.num_workers, pin_memory=backend.device.type == "cuda")
    batches = iter(loader)
    steps = _epoch_steps(run, sampler)
    done, last = 0, (False, False)
    run.model.train()
    # --uneven: a rank whose shard ends first leaves this block and answers the others'
    # gradient reductions with zeros until all have left (Backend.join)
    with backend.join(run.model) if cfg.uneven else contextlib.nullcontext():
        for k, step in enumerate(steps):
            if step.mine == 0:
                break
            hold_point("step", at=run.step + 1)  # HVDKIT_HOLD=step:N: a fault lands here (hvdkit.faults)
            # Agree on preemption and earlier non-finite losses while this step computes; in an
            # uneven tail (some rank has joined) nothing but the gradients may be reduced.
            agreement = preemption.begin(run.watch.flag()) if step.full else None
            # the reduction divides by the world size: weigh this rank's mean loss so that the
            # step's gradient is the mean over the samples all ranks read (1.0 for even shards)
            weight = step.mine * backend.size / step.total if cfg.uneven else None
            loss = train_step(backend, run.model, run.optimizer, run.task, batches,
                              cfg.backend.accumulation_steps, cfg.precision, run.scaler, weight,
                              cfg.clip_grad_norm)
            run.watch.record(loss, run.step + 1)
            run.loss.add(loss)
            run.scheduler.step()
            profiler.step()
            _advance(run, step)
            done = k + 1
            if run.master and cfg.log_every and run.step % cfg.log_every == 0:
                run.log(f"step {run.step} loss {loss.item():.6f} lr {run.optimizer.param_groups[0]['lr']:.5g}")
            run.observers.step(run, loss)
            if agreement is None:
                continue
            stop, nonfinite = agreement()  # the same answers on every rank
            if k + 1 == len(steps):
                last = (stop, nonfinite)  # the epoch's last step: its end acts on them
            elif _step_tail(run, preemption, stop, nonfinite):
                return None
    if done < len(steps):  # joined early: take the others' steps, then their weights
        for step in steps[done:]:
            run.scheduler.step()
            _advance(run, step)
    if cfg.uneven:
        backend.broadcast_state(run.model, run.optimizer, root=0)  # rank 0 ran every step
    return last


@dataclass(frozen=True)
class _EpochEnd:
    """What an epoch measured on this rank: the samples it covered, its seconds, and the
    seconds this rank waited for reduced gradients (their share is what compute did not hide)."""

    samples: int
    seconds: float
    waited: float


def _step_tail(run: _Run, preemption: Preemption, stop: bool, nonfinite: bool,
               epoch: _EpochEnd | None = None) -> bool:
    """Collective: what follows a step every rank read a full batch of, and every epoch's end
    (``epoch``), in this one order. ``stop``/``nonfinite``: what the ranks agreed on during the
    step. True when the run stops here (``--max-steps`` mid-epoch, or ASHA pruned the trial).

    1. the non-finite check (the agreed flag lags a step: before a save and at an epoch's end,
       this step is asked too);
    2. evaluate: every ``--eval-every`` steps, at the limit and at every epoch's end (not before a
       preemption's save, which must come fast);
    3. at an epoch's end: its record (loss, throughput, held-out metrics) and ASHA's rung, decided
       before the save so that a trial requeued in between meets the same rung again and reuses
       the recorded decision;
    4. save: at the epoch's end, a preemption, the limit, every ``--checkpoint-every`` steps;
    5. preemption: requeues and raises if the ranks agreed to stop (saved above);
    6. fold the running loss (and, elastic, commit to host memory).
    """
    cfg = run.cfg
    limit = epoch is None and _at_limit(run)  # at an epoch's end the epoch loop stops by itself
    periodic = bool(epoch is None and cfg.checkpoint_every and run.step % cfg.checkpoint_every == 0)
    wants_save = bool(run.ckpt and (stop or limit or periodic or epoch is not None))
    run.check_nonfinite(nonfinite and not run.watch.warned, before_save=wants_save or epoch is not None)
    go_on = True
    if not stop:
        if epoch is not None:
            go_on = _end_epoch(run, epoch)
        elif limit or (cfg.eval_every and run.step % cfg.eval_every == 0):
            _evaluate(run, say=True)
    if wants_save:
        run.save()
    preemption.check(run.step, agreed=stop)
    if epoch is not None:
        run.observers.saved(run, run.progress.history[-1], str(run.ckpt.directory / run.saved_name)
                            if run.ckpt is not None and run.saved_name else None)
    elif limit:
        return True
    if epoch is not None or run.step % cfg.commit_every == 0:
        run.fold()
    return not go_on


def _advance(run: _Run, step: _StepShare) -> None:
    p = run.progress
    p.global_step += 1
    p.samples_in_epoch += step.total
    p.samples_seen += step.total
    p.steps_in_epoch += 1


def _evaluate(run: _Run, say: bool = False) -> dict[str, float]:
    """Collective: held-out metrics over the whole validation set, each sample once."""
    if run.val_data is None:
        return {}
    cfg = run.cfg
    metrics = evaluate(run.backend, run.model, run.val_data, run.task, cfg.eval_batch_size or run.geo.batch,
                       cfg.precision, cfg.num_workers)
    bad = sorted(k for k, v in metrics.items() if not math.isfinite(v))
    if bad:
        # training is finite (the watch stops it otherwise): the held-out data is what holds
        # NaN/inf, and every metric of it (and --keep-best on it) would be nan without a word
        what = f"validation {', '.join(bad)} = {metrics[bad[0]]} at step {run.step} while training is finite"
        source = cfg.val_data or ("--val-fraction of " + (cfg.data or cfg.dataset or "the data"))
        if cfg.on_nonfinite == "stop":
            err = HvdkitError(f"{what}: the validation data ({source}) likely holds NaN/inf values",
                              "check it with 'hvdkit data check FILE'; --on-nonfinite warn goes on")
            err.echo = run.master  # the metrics are the same on every rank: all stop, one says it
            raise err
        if run.master and not run.watch.warned_eval:
            run.watch.warned_eval = True
            warn(f"{what}; the validation data ({source}) likely holds NaN/inf values")
    run.progress.last_eval = metrics
    if run.master and say:
        shown = " ".join(f"val_{k} {v:.6g}" for k, v in metrics.items() if k != "count")
        run.log(f"step {run.step} {shown}")
    run.observers.evaluated(run, metrics)
    return metrics


def _end_epoch(run: _Run, epoch: _EpochEnd) -> bool:
    """The epoch's record (loss, throughput, held-out metrics), its line, and ASHA's rung (part
    of :func:`_step_tail`). Returns False when ASHA pruned the trial."""
    backend, p = run.backend, run.progress
    index = p.epoch
    # Throughput of the slowest rank is the job's throughput.
    slowest = backend.allreduce_metric(epoch.seconds, op="max")
    sps = epoch.samples / slowest if slowest > 0 else float("nan")
    comm = backend.allreduce_metric(epoch.waited / epoch.seconds if epoch.seconds > 0 else 0.0) \
        if backend.size > 1 else 0.0
    if not backend.strategy.comm_wait_measured:
        comm = float("nan")  # not measured (FSDP2): said so, not shown as 0%
    epoch_loss = run.loss.mean(backend)
    if run.samples is not None:  # while the state still says which epoch they belong to
        run.samples.record(index, run.step)
    val = _evaluate(run)
    record: dict[str, Any] = {"epoch": index, "step": run.step, "loss": epoch_loss, "samples_per_sec": sps,
                              "comm_wait": comm, **{f"val_{k}": v for k, v in val.items()}}
    p.history.append(record)
    if run.master:
        shown = "".join(f" val_{k} {v:.6g}" for k, v in val.items() if k != "count")
        waits = f"{comm:.0%}" if comm == comm else "not measured"  # nan: FSDP2's waits are in backward
        run.log(f"epoch {index} loss {epoch_loss:.6f}{shown} samples/s {sps:.1f} comm wait {waits} "
                f"({backend.size} ranks)")
        if not run.advised and comm == comm and comm >= WAIT_SHARE:  # once, and only what was measured
            run.advised = True
            try:  # advice never fails a run (a bench file it cannot use is a warning already)
                tip = advise(run.cfg, comm)
            except Exception as exc:  # a defect here must not cost the user the run
                tip = f"no network advice: {type(exc).__name__}: {exc}".splitlines()[0]
            if tip:
                warn(tip)
    run.observers.epoch(run, record)
    p.epoch, p.samples_in_epoch = index + 1, 0
    run.loss.end_epoch()
    p.steps_in_epoch = 0
    return _asha_rung(run, record)


def _asha_rung(run: _Run, record: dict[str, Any]) -> bool:
    """Collective at every epoch end of an ASHA trial: rank 0 decides, every rank learns it."""
    if run.cfg.asha_dir is None:
        return True
    epoch = run.progress.epoch  # epochs done
    decision = None
    if run.asha is not None and run.asha.is_rung(epoch):
        metric = run.asha.config.metric
        value = record.get("loss" if metric == "final_loss" else metric, float("nan"))
        decision = run.asha.report(epoch, float(value))
    decision = run.backend.broadcast_object(decision, 0)  # asha is rank 0's alone
    if decision is None:
        return True
    run.result.asha.append(decision)
    if run.master:
        verdict = "continues" if decision["go_on"] else "pruned"
        run.log(f"asha: trial {decision['trial']} at epoch {epoch} {decision.get('metric', 'loss')} "
                f"{decision['value']:.6f}: {verdict} "
                f"({decision['rule']}{'; recorded decision reused' if decision['reused'] else ''})")
    if not decision["go_on"]:
        run.result.status = "pruned"
    return bool(decision["go_on"])


def _report_done(run: _Run) -> None:
    """Check that every rank holds the same weights, print the summary, write metrics."""
    backend, result, cfg = run.backend, run.result, run.cfg
    backend.sync_buffers(run.model)  # rank 0's BatchNorm statistics, as the checkpoint holds
    result.memory = backend.gather_objects(rank_memory(backend, run.model, run.optimizer, run.built_rss))
    for field_name, value in backend.strategy.report().items():  # shard_overlap, compression
        setattr(result, field_name, value)
    digests = backend.gather_objects(param_digest(backend.strategy.replica_state_dict(run.model)))
    result.param_digest = digests[0]
    result.history = run.progress.history
    result.epoch_losses = run.progress.epoch_losses
    result.samples_per_sec = [float(r.get("samples_per_sec", float("nan"))) for r in result.history]
    result.val = {f"val_{k}": v for k, v in run.progress.last_eval.items()}
    if run.ckpt is not None and run.master:
        result.best = run.ckpt.best()
    if backend.is_master:
        # sharded parameters (FSDP) exist once: the same on every rank by construction
        same = all(d == digests[0] for d in digests) or not backend.strategy.replicates_parameters
        val = "".join(f" {k}={v!r}" for k, v in result.val.items() if k != "val_count")
        run.log(f"done: backend={backend.name} world={backend.size} final_loss={result.final_loss!r}{val} "
                f"steps={result.global_step} params_identical_on_all_ranks={same} "
                f"digest={digests[0]} ranks={' '.join(result.ranks)}")
        if cfg.metrics_file:
            write_json_atomic(Path(cfg.metrics_file), {**dataclasses.asdict(result),
                                                       "final_loss": result.final_loss, **result.val,
                                                       "params_identical": same,
                                                       "config": dataclasses.asdict(cfg)})
            diag(f"wrote {cfg.metrics_file}")
