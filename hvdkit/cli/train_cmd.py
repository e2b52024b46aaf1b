"""``hvdkit train``: one training run in this process (start it under a launcher)."""

from __future__ import annotations

import dataclasses
import sys
import traceback
from typing import Any

import click

from ..backends.traits import DEFAULT_BACKEND
from ..config import BACKENDS, MODEL_NAMES, PRECISIONS, BackendConfig, DDPOptions, HorovodOptions, TrainConfig
from ..errors import HvdkitError, first_line
from .common import config_option, translate_errors

_TRAIN = {f.name: f.default for f in dataclasses.fields(TrainConfig)}
_HVD = {f.name: f.default for f in dataclasses.fields(HorovodOptions)}
_DDP = {f.name: f.default for f in dataclasses.fields(DDPOptions)}


def _opt(*decls: str, **kw: Any):  # noqa: ANN202 - click decorator
    kw.setdefault("show_default", True)
    return click.option(*decls, **kw)


def build_train_config(o: dict[str, Any]) -> TrainConfig:
    """Translate parsed ``hvdkit train`` options into a :class:`TrainConfig` (pure)."""
    hvd = HorovodOptions(
        reducer=o["hvd_reducer"], bucket_cap_mb=o["bucket_cap_mb"],
        compression=o["compression"], op=o["hvd_op"],
        gradient_predivide_factor=o["predivide_factor"],
        fusion_threshold_mb=o["fusion_threshold_mb"], cycle_time_ms=o["cycle_time_ms"],
        timeline=o["timeline"], stall_check_s=o["stall_check_s"],
        stall_shutdown_s=o["stall_shutdown_s"],
    )
    ddp = DDPOptions(
        bucket_cap_mb=o["bucket_cap_mb"], gradient_as_bucket_view=o["gradient_as_bucket_view"],
        static_graph=o["static_graph"], broadcast_buffers=o["broadcast_buffers"],
        compression=o["compression"], timeout_s=o["ddp_timeout"], environment=o["environment"],
    )
    backend = BackendConfig(name=o["backend"], accumulation_steps=o["accumulation_steps"],
                            horovod=hvd, ddp=ddp)
    fields = {f.name for f in dataclasses.fields(TrainConfig)} - {"backend"}
    return TrainConfig(backend=backend, **{k: o[k] for k in fields})


@click.command("train")
@config_option
@_opt("--backend", type=click.Choice(BACKENDS), default=DEFAULT_BACKEND, show_default=True,
      help="Data-parallel backend (local: one plain process, no communication).")
@_opt("--model", type=click.Choice(sorted(MODEL_NAMES)), default=_TRAIN["model"], help="Example model.")
@_opt("--epochs", type=click.IntRange(min=1), default=_TRAIN["epochs"])
@_opt("--steps-per-epoch", type=click.IntRange(min=1), default=None, help="Cap on optimizer steps per epoch.")
@_opt("--max-steps", type=click.IntRange(min=1), default=None,
      help="Stop (and checkpoint) after this many optimizer steps in total.")
@_opt("--batch-size", type=click.IntRange(min=1), default=_TRAIN["batch_size"], help="Micro-batch per rank.")
@_opt("--global-batch-size", type=click.IntRange(min=1), default=None,
      help="Global batch per optimizer step; overrides --batch-size.")
@_opt("--exact-batch/--no-exact-batch", default=False, help="Fail if the global batch does not divide.")
@_opt("--lr", type=click.FloatRange(min=0, min_open=True), default=_TRAIN["lr"], help="Base LR for one worker.")
@_opt("--scale-lr/--no-scale-lr", default=True, help="Multiply LR by world size x accumulation.")
@_opt("--warmup-epochs", type=click.FloatRange(min=0), default=0.0, help="Linear LR warm-up length.")
@_opt("--optimizer", type=click.Choice(["sgd", "adam", "adamw"]), default="sgd")
@_opt("--momentum", type=float, default=_TRAIN["momentum"])
@_opt("--weight-decay", type=click.FloatRange(min=0), default=0.0)
@_opt("--num-samples", type=click.IntRange(min=1), default=_TRAIN["num_samples"], help="Synthetic dataset size.")
@_opt("--data", type=click.Path(dir_okay=False), default=None, help="HDF5 dataset (x, y) instead of synthetic data.")
@_opt("--seed", type=int, default=0)
@_opt("--accumulation-steps", "--backward-passes-per-step", "accumulation_steps",
      type=click.IntRange(min=1), default=1, help="Micro-batches per optimizer step.")
@_opt("--compression", type=click.Choice(["none", "fp16"]), default="none", help="Gradient compression.")
@_opt("--hvd-reducer", type=click.Choice(["bucketed", "stock"]), default=_HVD["reducer"],
      help="Horovod gradient reduction: DDP-style buckets through Horovod's allreduce, or "
           "hvd.DistributedOptimizer itself (stock; always used for Adasum).")
@_opt("--hvd-op", type=click.Choice(["average", "sum", "adasum"]), default="average", help="Horovod reduction.")
@_opt("--predivide-factor", type=click.FloatRange(min=0, min_open=True), default=1.0,
      help="Horovod gradient_predivide_factor.")
@_opt("--fusion-threshold-mb", type=click.FloatRange(min=0), default=None,
      help="HOROVOD_FUSION_THRESHOLD in MiB (0 = off; default Horovod's 128).")
@_opt("--cycle-time-ms", type=click.FloatRange(min=0, min_open=True), default=None, help="HOROVOD_CYCLE_TIME.")
@_opt("--timeline", type=click.Path(dir_okay=False), default=None, help="Horovod timeline (HOROVOD_TIMELINE) or, for DDP, a torch profiler trace; rank 0 writes it.")
@_opt("--stall-check-s", type=click.IntRange(min=0), default=None, help="HOROVOD_STALL_CHECK_TIME_SECONDS.")
@_opt("--stall-shutdown-s", type=click.IntRange(min=0), default=None,
      help="HOROVOD_STALL_SHUTDOWN_TIME_SECONDS.")
@_opt("--bucket-cap-mb", type=click.FloatRange(min=0, min_open=True), default=_DDP["bucket_cap_mb"],
      help="Gradient bucket size in MiB, for DDP and the bucketed Horovod reducer.")
@_opt("--gradient-as-bucket-view/--no-gradient-as-bucket-view", default=False)
@_opt("--static-graph/--no-static-graph", default=False)
@_opt("--broadcast-buffers/--no-broadcast-buffers", default=True, help="DDP buffer sync every forward.")
@_opt("--ddp-timeout", type=click.FloatRange(min=0, min_open=True), default=_DDP["timeout_s"],
      help="Process-group timeout in seconds.")
@_opt("--environment", type=click.Choice(["auto", "torchrun", "openmpi", "pmi", "slurm", "local"]),
      default="auto", help="Launcher environment for DDP rendezvous.")
@_opt("--checkpoint-dir", type=click.Path(file_okay=False), default=None, help="Rank-0 HDF5 checkpoints here.")
@_opt("--checkpoint-every", type=click.IntRange(min=0), default=0, help="Also every N steps (0 = epoch ends only).")
@_opt("--keep-checkpoints", type=click.IntRange(min=1), default=_TRAIN["keep_checkpoints"])
@_opt("--resume/--no-resume", default=True, help="Resume from the newest valid checkpoint.")
@_opt("--requeue/--no-requeue", default=True, help="On SIGUSR1 under Slurm: checkpoint and requeue.")
@_opt("--precision", type=click.Choice(PRECISIONS), default=_TRAIN["precision"],
      help="Autocast the forward pass to bf16 or fp16 (fp16 with a dynamic gradient scaler, "
           "checkpointed); parameters and optimizer stay fp32. bf16 works on CPUs too.")
@_opt("--asha-dir", type=click.Path(file_okay=False), default=None,
      help="Sweep directory of 'hvdkit sweep --scheduler asha': report at each rung, stop if pruned.")
@_opt("--asha-trial", type=click.IntRange(min=0), default=None, help="This trial's number in that sweep.")
@_opt("--on-nonfinite", type=click.Choice(["stop", "warn"]), default=_TRAIN["on_nonfinite"],
      help="At the first NaN/inf loss on any rank: stop with an error (no checkpoint of it), "
           "or warn and go on (checkpoints with NaN/inf weights are skipped).")
@_opt("--log-every", type=click.IntRange(min=0), default=0, help="Print the loss every N steps.")
@_opt("--log-level", type=click.Choice(["DEBUG", "INFO", "WARNING"], case_sensitive=False),
      default=_TRAIN["log_level"], callback=lambda _c, _p, v: v.upper(),
      help="INFO: rank 0's lines (results on stdout, diagnostics on stderr); DEBUG: every rank's, "
           "tagged [hvdkit rN]; WARNING: warnings and results only.")
@_opt("--elastic/--no-elastic", default=False, help="Horovod Elastic (run under horovodrun --min-np/--max-np).")
@_opt("--commit-every", type=click.IntRange(min=1), default=10,
      help="Every N steps: fold the epoch loss over ranks and, with --elastic, commit the state "
           "to host memory (a lost worker costs at most N steps).")
@_opt("--sample-log", type=click.Path(dir_okay=False), default=None,
      help="Rank 0 appends the sample ids every committed step read (JSON lines), for audits.")
@_opt("--uneven/--no-uneven", default=False,
      help="Train on every sample: shards may differ by one sample and a rank's last batch may "
           "be partial; a rank that runs out joins (hvd.join / DDP Join) until the others finish. "
           "Default: the tail that does not fill a global batch is dropped.")
@_opt("--metrics-file", type=click.Path(dir_okay=False), default=None, help="Rank 0 writes a JSON summary.")
@translate_errors
def train_command(**options: Any) -> None:
    """Train an example model; run it under horovodrun, mpirun or srun for N ranks."""
    cfg = build_train_config(options)
    try:
        from ..train import train

        result = train(cfg)
    except HvdkitError:
        raise
    except Exception as exc:  # noqa: BLE001 - a bug or bad data: traceback, then one line
        traceback.print_exc()
        where = getattr(exc, "hvdkit_rank", "this rank")
        raise click.ClickException(
            f"{where} failed: {type(exc).__name__}: {first_line(exc, limit=300, default='')}") from None
    if result is not None and result.preempted and not result.requeued:
        from ..preemption import EXIT_PREEMPTED

        # Unfinished work must not look COMPLETED to Slurm; the checkpoint is saved.
        sys.exit(EXIT_PREEMPTED)
