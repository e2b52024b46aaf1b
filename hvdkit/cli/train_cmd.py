"""``hvdkit train``: one training run in this process (start it under a launcher).

Every default and choice list comes from :mod:`hvdkit.config` (the dataclass defaults and its
constants), so the command and the library cannot drift apart;
``tests/test_config.py::test_click_defaults_and_choices_are_the_configs_own`` checks it.
"""

from __future__ import annotations

import dataclasses
import sys
import traceback
from typing import Any

import click

from ..backends.traits import BACKENDS, DEFAULT_BACKEND
from ..config import (
    COMPRESSIONS,
    HOROVOD_OPS,
    HOROVOD_REDUCERS,
    LOG_LEVELS,
    LR_SCHEDULES,
    NONFINITE_MODES,
    POWERSGD_DEFAULTS,
    PRECISIONS,
    PROGRESS_MODES,
    SHARD_MODES,
    BackendConfig,
    DDPOptions,
    HorovodOptions,
    TrainConfig,
)
from ..environments import ENVIRONMENTS
from ..errors import ConfigError, HvdkitError, first_line
from .common import FiniteFloat, config_option, given_options, translate_errors

TRAIN = {f.name: f.default for f in dataclasses.fields(TrainConfig) if f.default is not dataclasses.MISSING}
HVD = {f.name: f.default for f in dataclasses.fields(HorovodOptions)}
DDP = {f.name: f.default for f in dataclasses.fields(DDPOptions)}
BACKEND = {f.name: f.default for f in dataclasses.fields(BackendConfig) if f.default is not dataclasses.MISSING}
ENVIRONMENT_NAMES = ("auto", *ENVIRONMENTS)
# options whose values are KEY=VALUE lists, read into the config's *_args mappings
ARG_LISTS = {"model_args": "--model-arg", "dataset_args": "--dataset-arg", "optimizer_args": "--optimizer-arg"}
# options that only one backend's section reads (build_train_config): given for another
# backend they would do nothing, so they are refused
BACKEND_ONLY = {
    "horovod": ("hvd_reducer", "hvd_op", "predivide_factor", "fusion_threshold_mb", "cycle_time_ms",
                "stall_check_s", "stall_shutdown_s"),
    "ddp": ("gradient_as_bucket_view", "static_graph", "broadcast_buffers", "ddp_timeout", "environment"),
}


def check_given_options(ctx: click.Context) -> None:
    """Refuse an option given on the command line (or in --config) that the chosen backend
    would ignore: Horovod's knobs on DDP and the other way round, compression without
    communication. One ConfigError naming the option and the backend that reads it."""
    given = given_options(ctx)
    backend = ctx.params["backend"]
    for owner, names in BACKEND_ONLY.items():
        for name in names:
            if owner != backend and name in given:
                flag = given[name].opts[0]
                raise ConfigError(f"{flag} is an option of --backend {owner}; --backend {backend} would ignore it",
                                  f"drop {flag}, or use --backend {owner}")
    if "momentum" in given and ctx.params["optimizer"] != "sgd":
        what = ("takes no momentum (its betas are --optimizer-arg betas=[B1,B2])"
                if ctx.params["optimizer"] in ("adam", "adamw")
                else "is given only --optimizer-arg values (its momentum: --optimizer-arg momentum=M)")
        raise ConfigError(f"--momentum is --optimizer sgd's; --optimizer {ctx.params['optimizer']} {what}",
                          "drop --momentum")
    if backend == "local" and "compression" in given and ctx.params["compression"] != "none":
        raise ConfigError("--compression with --backend local: one plain process sends no gradients to compress",
                          "drop --compression, or launch ranks with --backend horovod or ddp")




def _opt(*decls: str, **kw: Any):  # click decorator
    """Every option of 'hvdkit train'; a float one (plain or a range) is a :class:`FiniteFloat`."""
    kw.setdefault("show_default", True)
    kind = kw.get("type")
    if kind is float:
        kw["type"] = FiniteFloat()
    elif isinstance(kind, click.FloatRange) and not isinstance(kind, FiniteFloat):
        kw["type"] = FiniteFloat(kind.min, kind.max, kind.min_open, kind.max_open, kind.clamp)
    return click.option(*decls, **kw)


def _arg_list(ctx: click.Context, param: click.Parameter, value: Any) -> tuple[str, ...]:
    """``--model-arg k=v`` (repeatable), or a mapping from ``--config`` (``model_args: {k: v}``)."""
    from ..factories import format_args

    if isinstance(value, dict):
        return tuple(format_args(value))
    return tuple(value or ())


def build_train_config(o: dict[str, Any]) -> TrainConfig:
    """Translate parsed ``hvdkit train`` options into a :class:`TrainConfig` (pure; ConfigError)."""
    from ..factories import parse_args

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
                            shard=o["shard"], activation_checkpointing=o["activation_checkpointing"],
                            horovod=hvd, ddp=ddp)
    args = {name: parse_args(o[name], flag) for name, flag in ARG_LISTS.items()}
    fields = {f.name for f in dataclasses.fields(TrainConfig)} - {"backend", *ARG_LISTS}
    return TrainConfig(backend=backend, **args, **{k: o[k] for k in fields})  # type: ignore[arg-type]


@click.command("train")
@config_option
@_opt("--backend", type=click.Choice(BACKENDS), default=DEFAULT_BACKEND,
      help="Data-parallel backend (local: one plain process, no communication).")
# -- what to train -------------------------------------------------------------------------
@_opt("--model", default=TRAIN["model"],
      help="A built-in model (cnn, mlp, tiny) or yours: pkg.module:fn or path/to/file.py:fn, "
           "a function or class returning a torch.nn.Module.")
@_opt("--model-arg", "model_args", multiple=True, callback=_arg_list, metavar="KEY=VALUE",
      help="Keyword argument for the model factory (repeatable; values are YAML scalars).")
@_opt("--task", default=TRAIN["task"],
      help="classification, language-model, or pkg.module:fn(model, batch) returning the loss "
           "(or a dict of loss, count and metrics).")
@_opt("--data", default=None,
      help="HDF5 training data: x (samples of any shape and dtype) and, for classification, y. One file, "
           "a list a.h5,b.h5, a glob 'shard-*.h5' or a directory of *.h5, read in that order as one dataset.")
@_opt("--dataset", default=None,
      help="Your own data: pkg.module:fn returning a map-style Dataset, or (train, val).")
@_opt("--dataset-arg", "dataset_args", multiple=True, callback=_arg_list, metavar="KEY=VALUE",
      help="Keyword argument for the dataset factory (repeatable).")
@_opt("--num-samples", type=click.IntRange(min=1), default=TRAIN["num_samples"],
      help="Synthetic dataset size (built-in models without --data).")
@_opt("--val-data", default=None, help="HDF5 validation data (one file, a list, a glob or a directory).")
@_opt("--val-fraction", type=float, default=TRAIN["val_fraction"],
      help="Hold out this fraction of the training data for validation (a fixed, seeded split).")
@_opt("--eval-every", type=click.IntRange(min=0), default=TRAIN["eval_every"],
      help="Also evaluate every N steps (always at epoch ends when there is validation data).")
@_opt("--eval-batch-size", type=click.IntRange(min=1), default=None,
      help="Batch per rank for evaluation [default: --batch-size].")
@_opt("--num-workers", type=click.IntRange(min=0), default=TRAIN["num_workers"],
      help="DataLoader worker processes per rank (resume stays exact).")
# -- how long, how big --------------------------------------------------------------------
@_opt("--epochs", type=click.IntRange(min=1), default=TRAIN["epochs"])
@_opt("--steps-per-epoch", type=click.IntRange(min=1), default=None, help="Cap on optimizer steps per epoch.")
@_opt("--max-steps", type=click.IntRange(min=1), default=None,
      help="Stop (and checkpoint) after this many optimizer steps in total.")
@_opt("--batch-size", type=click.IntRange(min=1), default=TRAIN["batch_size"], help="Micro-batch per rank.")
@_opt("--global-batch-size", type=click.IntRange(min=1), default=None,
      help="Global batch per optimizer step; overrides --batch-size.")
@_opt("--exact-batch/--no-exact-batch", default=TRAIN["exact_batch"], help="Fail if the global batch does not divide.")
@_opt("--accumulation-steps", "--backward-passes-per-step", "accumulation_steps",
      type=click.IntRange(min=1), default=BACKEND["accumulation_steps"], help="Micro-batches per optimizer step.")
@_opt("--shard", type=click.Choice(SHARD_MODES), default=BACKEND["shard"],
      help="none; optimizer: each rank keeps 1/N of the optimizer state and gradients (ZeRO-1/2, "
           "both backends); full: parameters too (ZeRO-3 on Horovod's collectives, FSDP2 on DDP).")
@_opt("--activation-checkpointing/--no-activation-checkpointing", default=BACKEND["activation_checkpointing"],
      help="Recompute each block's activations in backward instead of keeping them (less memory, about one "
           "more forward); the same bits. A block: an entry of a ModuleList/Sequential that holds modules.")
# -- optimizer and schedule --------------------------------------------------------------------
@_opt("--optimizer", default=TRAIN["optimizer"],
      help="sgd, adam, adamw, or a class by import path (e.g. torch.optim:RMSprop).")
@_opt("--optimizer-arg", "optimizer_args", multiple=True, callback=_arg_list, metavar="KEY=VALUE",
      help="Keyword argument for the optimizer (repeatable), e.g. betas=[0.9,0.95].")
@_opt("--lr", type=click.FloatRange(min=0, min_open=True), default=TRAIN["lr"], help="Base LR for one worker.")
@_opt("--scale-lr/--no-scale-lr", default=TRAIN["scale_lr"], help="Multiply LR by world size x accumulation.")
@_opt("--warmup-epochs", type=click.FloatRange(min=0), default=TRAIN["warmup_epochs"],
      help="Linear LR warm-up from the unscaled LR.")
@_opt("--lr-schedule", type=click.Choice(LR_SCHEDULES), default=TRAIN["lr_schedule"],
      help="After the warm-up: constant, cosine (to --min-lr-ratio), or step (x --lr-gamma every "
           "--lr-step-epochs).")
@_opt("--min-lr-ratio", type=click.FloatRange(min=0, max=1), default=TRAIN["min_lr_ratio"],
      help="Cosine: the final LR as a fraction of the LR.")
@_opt("--lr-decay-steps", type=click.IntRange(min=1), default=None,
      help="Cosine: decay over this many steps [default: the run's length, --max-steps if given].")
@_opt("--lr-step-epochs", type=click.FloatRange(min=0, min_open=True), default=TRAIN["lr_step_epochs"])
@_opt("--lr-gamma", type=click.FloatRange(min=0, min_open=True), default=TRAIN["lr_gamma"])
@_opt("--momentum", type=float, default=TRAIN["momentum"], help="SGD momentum.")
@_opt("--weight-decay", type=click.FloatRange(min=0), default=TRAIN["weight_decay"],
      help="On weights of 2+ dimensions; biases and norm scales get none.")
@_opt("--clip-grad-norm", type=float, default=None,
      help="Clip the global norm of the reduced (and unscaled) gradients.")
@_opt("--precision", type=click.Choice(PRECISIONS), default=TRAIN["precision"],
      help="Autocast the forward pass to bf16 or fp16 (fp16 with a dynamic gradient scaler, "
           "checkpointed); parameters and optimizer stay fp32. bf16 works on CPUs too.")
@_opt("--seed", type=int, default=TRAIN["seed"])
# -- the backends ---------------------------------------------------------------------------
@_opt("--compression", metavar="|".join(COMPRESSIONS[:-1]) + f"|{COMPRESSIONS[-1]}[:rank=R,start=N]",
      default=HVD["compression"],
      help="Gradient compression on both backends: fp16 halves the bytes; powersgd sends each gradient matrix "
           f"as two rank-R factors with error feedback (torch's powerSGD_hook; defaults "
           f"{', '.join(f'{k}={v}' for k, v in POWERSGD_DEFAULTS.items())}: plain averaging for the first N steps).")
@_opt("--hvd-reducer", type=click.Choice(HOROVOD_REDUCERS), default=HVD["reducer"],
      help="Horovod gradient reduction: DDP-style buckets through Horovod's allreduce, or "
           "hvd.DistributedOptimizer itself (stock; always used for Adasum).")
@_opt("--hvd-op", type=click.Choice(HOROVOD_OPS), default=HVD["op"], help="Horovod reduction.")
@_opt("--predivide-factor", type=click.FloatRange(min=0, min_open=True), default=HVD["gradient_predivide_factor"],
      help="Horovod gradient_predivide_factor.")
@_opt("--fusion-threshold-mb", type=click.FloatRange(min=0), default=None,
      help="HOROVOD_FUSION_THRESHOLD in MiB (0 = off; default Horovod's 128).")
@_opt("--cycle-time-ms", type=click.FloatRange(min=0, min_open=True), default=None, help="HOROVOD_CYCLE_TIME.")
@_opt("--timeline", type=click.Path(dir_okay=False), default=None,
      help="Horovod timeline (HOROVOD_TIMELINE) or, for DDP, a torch profiler trace; rank 0 writes it.")
@_opt("--stall-check-s", type=click.IntRange(min=0), default=None, help="HOROVOD_STALL_CHECK_TIME_SECONDS.")
@_opt("--stall-shutdown-s", type=click.IntRange(min=0), default=None,
      help="HOROVOD_STALL_SHUTDOWN_TIME_SECONDS.")
@_opt("--bucket-cap-mb", type=click.FloatRange(min=0, min_open=True), default=DDP["bucket_cap_mb"],
      help="Gradient bucket size in MiB, for DDP and the bucketed Horovod reducer; the largest "
           "--shard optimizer bucket (a quarter of the model if less, at least 1 MiB).")
@_opt("--gradient-as-bucket-view/--no-gradient-as-bucket-view", default=DDP["gradient_as_bucket_view"])
@_opt("--static-graph/--no-static-graph", default=DDP["static_graph"])
@_opt("--broadcast-buffers/--no-broadcast-buffers", default=DDP["broadcast_buffers"],
      help="DDP buffer sync every forward.")
@_opt("--ddp-timeout", type=click.FloatRange(min=1), default=DDP["timeout_s"],
      help="Process-group timeout in seconds.")
@_opt("--environment", type=click.Choice(ENVIRONMENT_NAMES), default=DDP["environment"],
      help="Launcher environment for DDP rendezvous.")
# -- checkpoints, preemption, sweeps ------------------------------------------------------------
@_opt("--checkpoint-dir", type=click.Path(file_okay=False), default=None, help="Rank-0 HDF5 checkpoints here.")
@_opt("--checkpoint-every", type=click.IntRange(min=0), default=TRAIN["checkpoint_every"],
      help="Also every N steps (0 = epoch ends only).")
@_opt("--keep-checkpoints", type=click.IntRange(min=1), default=TRAIN["keep_checkpoints"])
@_opt("--keep-best", default=None, metavar="METRIC[:min|max]",
      help="Also keep the checkpoint with the best METRIC (e.g. val_loss, val_accuracy:max); "
           "never rotated away.")
@_opt("--resume/--no-resume", default=TRAIN["resume"], help="Resume from the newest valid checkpoint.")
@_opt("--requeue/--no-requeue", default=TRAIN["requeue"], help="On SIGUSR1/USR2 under Slurm: checkpoint and requeue.")
@_opt("--asha-dir", type=click.Path(file_okay=False), default=None,
      help="Sweep directory of 'hvdkit sweep --scheduler asha': report at each rung, stop if pruned.")
@_opt("--asha-trial", type=click.IntRange(min=0), default=None, help="This trial's number in that sweep.")
@_opt("--on-nonfinite", type=click.Choice(NONFINITE_MODES), default=TRAIN["on_nonfinite"],
      help="At the first NaN/inf loss on any rank: stop with an error (no checkpoint of it), "
           "or warn and go on (checkpoints with NaN/inf weights are skipped).")
@_opt("--memory-check/--no-memory-check", default=TRAIN["memory_check"],
      help="Before step 1, estimate each rank's peak memory (state by --shard mode, activations measured on the "
           "first batch) and refuse a run that cannot fit the node, its cgroup or the Slurm job's --mem, naming a "
           "mode that would.")
# -- what you see ----------------------------------------------------------------------------
@_opt("--log-every", type=click.IntRange(min=0), default=TRAIN["log_every"], help="Print the loss every N steps.")
@_opt("--log-level", type=click.Choice(LOG_LEVELS, case_sensitive=False),
      default=TRAIN["log_level"], callback=lambda _c, _p, v: v.upper(),
      help="INFO: rank 0's lines (results on stdout, diagnostics on stderr); DEBUG: every rank's, "
           "tagged [hvdkit rN]; WARNING: warnings and results only.")
@_opt("--progress", type=click.Choice(PROGRESS_MODES), default=TRAIN["progress"],
      help="auto: a progress bar when the console is a terminal, plain lines in batch logs.")
@_opt("--tensorboard", type=click.Path(file_okay=False), default=None,
      help="Rank 0 writes TensorBoard event files here (pip install 'hvdkit[tensorboard]').")
@_opt("--metrics-file", type=click.Path(dir_okay=False), default=None, help="Rank 0 writes a JSON summary.")
# -- elastic and uneven data -------------------------------------------------------------------------
@_opt("--elastic/--no-elastic", default=TRAIN["elastic"],
      help="Horovod Elastic (run under horovodrun --min-np/--max-np).")
@_opt("--commit-every", type=click.IntRange(min=1), default=TRAIN["commit_every"],
      help="Every N steps: fold the epoch loss over ranks and, with --elastic, commit the state "
           "to host memory (a lost worker costs at most N steps).")
@_opt("--sample-log", type=click.Path(dir_okay=False), default=None,
      help="Rank 0 appends the sample ids every committed step read (JSON lines), for audits.")
@_opt("--uneven/--no-uneven", default=TRAIN["uneven"],
      help="Train on every sample: shards may differ by one sample and a rank's last batch may "
           "be partial; a rank that runs out joins (hvd.join / DDP Join) until the others finish. "
           "Default: the tail that does not fill a global batch is dropped.")
@translate_errors
def train_command(**options: Any) -> None:
    """Train a model; run it under horovodrun, mpirun or srun for N ranks."""
    cfg = usage_checked(options)
    try:
        from ..loop import train

        result = train(cfg)
    except HvdkitError:
        raise
    except Exception as exc:  # a bug or bad data: traceback, then one line
        traceback.print_exc()
        where = getattr(exc, "hvdkit_rank", "this rank")
        raise click.ClickException(
            f"{where} failed: {type(exc).__name__}: {first_line(exc, limit=300, default='')}") from None
    if result is not None and result.preempted and not result.requeued:
        from ..preemption import EXIT_PREEMPTED

        # Unfinished work must not look COMPLETED to Slurm; the checkpoint is saved.
        sys.exit(EXIT_PREEMPTED)


def usage_checked(options: dict[str, Any]) -> TrainConfig:
    """The config, and the objects it names by import path resolved; any mistake is a usage
    error (exit 2), said by the first rank only (every rank finds the same one)."""
    from ..factories import resolve

    try:
        check_given_options(click.get_current_context())
        cfg = build_train_config(options)
        if cfg.model_args and ":" not in cfg.model:
            from ..models import check_builtin_args

            check_builtin_args(cfg.model, cfg.model_args)
        for value, args, what, skip in cfg.import_paths():
            resolve(value, args, what=what, skip=skip)
        from ..optim import check_optimizer

        cfg.check_outputs()
        check_optimizer(cfg)  # imports torch: hvdkit train is about to anyway
    except ConfigError as exc:
        from ..environments import launcher_rank

        if launcher_rank() != 0:
            sys.exit(2)
        raise click.UsageError(str(exc)) from None
    return cfg


