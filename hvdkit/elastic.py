"""Horovod Elastic: keep training when workers are lost or added.

Run under ``horovodrun --min-np A --max-np B --host-discovery-script S`` (``hvdkit run
--elastic`` builds that line). The loop commits its state to host memory every
``commit_every`` steps; when a worker dies, the survivors roll back to the last
commit, Horovod re-forms the ring with the workers that are left, and a reset
callback re-derives what depends on the world size (LR scale, data shard, CPU
threads). When a worker joins, everyone stops at the next commit and the
newcomer receives the committed state from rank 0. Steps after the last commit
are recomputed, never lost twice, and committed steps are never lost.
"""

from __future__ import annotations

import os
import socket
import sys
import time
from collections.abc import Callable
from typing import Any

import torch
from torch.utils.data import DataLoader

from .backends.horovod import HorovodBackend
from .config import TrainConfig
from .data import ShardSampler
from .errors import ConfigError
from .models import build_model, synthetic_dataset
from .train import TrainResult, _geometry, _log, _report_done, make_optimizer, train_step, warmup_factor

__all__ = ["train_elastic", "ElasticTrainState"]


def _hvd_state_base() -> type:
    import horovod.torch as hvd

    return hvd.elastic.TorchState


class ElasticTrainState(_hvd_state_base()):  # type: ignore[misc]
    """``hvd.elastic.TorchState`` whose sync goes through hvdkit's broadcast.

    Horovod's own optimizer sync calls ``broadcast_optimizer_state``, which
    initialises an empty optimizer with a hidden zero-gradient step; hvdkit's
    ``broadcast_state`` does not. Loop counters are plain attributes that
    Horovod saves, restores and broadcasts.
    """

    def __init__(self, backend: HorovodBackend, model: torch.nn.Module,
                 optimizer: torch.optim.Optimizer, **loop: Any) -> None:
        self._hvdkit_backend = backend
        super().__init__(model=model, optimizer=optimizer, **loop)

    def sync(self) -> None:
        from horovod.common.elastic import ObjectState

        self._hvdkit_backend.reset_collective_names()
        self._hvdkit_backend.broadcast_state(self.model, self.optimizer)
        ObjectState.sync(self)  # the loop counters, from rank 0


def _elastic_log(msg: str) -> None:
    print(f"[hvdkit] {msg}", file=sys.stderr, flush=True)


def train_elastic(cfg: TrainConfig, log: Callable[[str], None] = _log) -> TrainResult:
    """The training loop of :func:`hvdkit.train.train`, made elastic. Horovod only."""
    if cfg.backend.name != "horovod":
        raise ConfigError("--elastic needs --backend horovod",
                          "DDP recovers by restarting from the last checkpoint (see README)")
    if cfg.backend.horovod.cycle_time_ms is not None:
        raise ConfigError("--cycle-time-ms cannot be combined with --elastic",
                          "Horovod 0.28.1 crashes when re-initialised with HOROVOD_CYCLE_TIME set")
    if cfg.data:
        raise ConfigError("--elastic trains on synthetic data only for now", "drop --data")
    import horovod.torch as hvd

    backend = HorovodBackend(cfg.backend)
    accum = cfg.backend.accumulation_steps
    dataset = synthetic_dataset(cfg.model, cfg.num_samples)
    torch.manual_seed(cfg.seed + backend.rank)
    model = build_model(cfg.model, seed=cfg.seed + backend.rank)
    optimizer = make_optimizer(cfg, model.parameters(), cfg.lr)
    model, optimizer = backend.wrap(model, optimizer)
    commit_every = cfg.commit_every
    state = ElasticTrainState(backend, model, optimizer, epoch=0, global_step=0, samples_in_epoch=0,
                              samples_seen=0, loss_sum=0.0, steps_in_epoch=0, epoch_losses=[],
                              samples_per_sec=[], commits=0)

    def on_reset() -> None:
        # The world changed: names, threads and everything derived from the size.
        backend.reset_collective_names()
        backend.reset_reducer(optimizer)  # drop allreduces that died with the old ring
        backend.limit_cpu_threads()
        _elastic_log(f"reset: rank {hvd.rank()} of {hvd.size()} (host {os.environ.get('HOROVOD_HOSTNAME')}, "
                     f"pid {os.getpid()}), continuing from committed step {state.global_step}")

    state.register_reset_callbacks([on_reset])
    _elastic_log(f"elastic worker rank {hvd.rank()} of {hvd.size()} host {os.environ.get('HOROVOD_HOSTNAME')} "
                 f"pid {os.getpid()}")

    @hvd.elastic.run
    def loop(state: ElasticTrainState) -> None:
        device = backend.device
        while state.epoch < cfg.epochs:
            size = hvd.size()
            geo = _geometry(cfg, size, len(dataset))
            scale = float(size * accum) if cfg.scale_lr else 1.0
            sampler = ShardSampler(len(dataset), size, hvd.rank(), seed=cfg.seed)
            sampler.set_epoch(state.epoch, start=state.samples_in_epoch)
            batches = iter(DataLoader(dataset, batch_size=geo.batch, sampler=sampler, drop_last=True))
            steps_left = (len(dataset) - state.samples_in_epoch) // geo.global_batch
            pending = torch.zeros((), dtype=torch.float64)  # this rank's loss since the last commit
            t0 = time.perf_counter()
            for _ in range(steps_left):
                warm = warmup_factor(state.global_step, int(cfg.warmup_epochs * geo.steps_per_epoch), scale)
                for group in optimizer.param_groups:  # LR follows the *current* world size
                    group["lr"] = cfg.lr * scale * warm
                pending += train_step(backend, model, optimizer, batches, accum, device).cpu()
                state.global_step += 1
                state.steps_in_epoch += 1
                state.samples_in_epoch += geo.global_batch
                state.samples_seen += geo.global_batch
                if state.global_step % commit_every == 0:
                    state.loss_sum += backend.allreduce_metric(pending)
                    pending.zero_()
                    state.commits += 1
                    if hvd.rank() == 0 and cfg.log_every:
                        log(f"commit at step {state.global_step} (world {size})")
                    state.commit()  # save to host memory; raises if hosts were added/removed
            state.loss_sum += backend.allreduce_metric(pending)
            elapsed = backend.allreduce_metric(time.perf_counter() - t0, op="max")
            epoch_loss = state.loss_sum / max(state.steps_in_epoch, 1)
            state.epoch_losses = [*state.epoch_losses, epoch_loss]
            state.samples_per_sec = [*state.samples_per_sec, steps_left * geo.global_batch / max(elapsed, 1e-9)]
            if hvd.rank() == 0:
                log(f"epoch {state.epoch} loss {epoch_loss:.6f} samples/s {state.samples_per_sec[-1]:.1f} "
                    f"({size} ranks)")
            state.epoch, state.samples_in_epoch, state.loss_sum, state.steps_in_epoch = state.epoch + 1, 0, 0.0, 0
            state.commit()

    loop(state)
    result = TrainResult(backend="horovod", world_size=hvd.size(), epoch_losses=list(state.epoch_losses),
                         samples_per_sec=list(state.samples_per_sec), global_step=state.global_step)
    result.ranks = backend.gather_objects(f"{hvd.rank()}@{socket.gethostname()}:{os.getpid()}")
    _report_done(cfg, backend, model, result, log)
    backend.shutdown()
    return result
