"""Typed configuration for the library. The CLI only translates flags into these.

Every dataclass validates itself in ``__post_init__`` and raises
:class:`~hvdkit.errors.ConfigError` with a one-line message and a hint.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any

from .backends.traits import BACKENDS, DEFAULT_BACKEND, TRAITS
from .errors import ConfigError
from .factories import is_import_path, parse_import_path

__all__ = [
    "BACKENDS",
    "HorovodOptions",
    "DDPOptions",
    "BackendConfig",
    "CompressionSpec",
    "TrainConfig",
    "parse_compression",
    "config_from_dict",
]

# the example models of hvdkit.models, named here so that validating a config needs no torch
MODEL_NAMES = ("cnn", "mlp", "tiny")
TASK_NAMES = ("classification", "language-model")  # hvdkit.tasks implements them
# what each built-in task's evaluation reports (hvdkit.tasks: Task.metrics), and what every
# epoch record holds besides: the names --keep-best may take (val_ + a task metric)
TASK_METRICS = {"classification": ("loss", "accuracy", "count"),
                "language-model": ("loss", "accuracy", "count", "perplexity")}
EPOCH_METRICS = ("loss", "samples_per_sec", "comm_wait")
MAX_WORKERS = 64  # DataLoader worker processes per rank (--num-workers): more is a mistake
OPTIMIZER_NAMES = ("sgd", "adam", "adamw")          # hvdkit.optim builds them
LR_SCHEDULES = ("constant", "cosine", "step")       # after the warm-up (hvdkit.schedule)
PRECISIONS = ("fp32", "bf16", "fp16")  # hvdkit.precision implements them
COMPRESSIONS = ("none", "fp16", "powersgd")  # powersgd takes options: powersgd:rank=R,start=N
POWERSGD_DEFAULTS = {"rank": 2, "start": 10}  # see CompressionSpec
SHARD_MODES = ("none", "optimizer", "full")  # hvdkit.backends.zero; full: FSDP2 (DDP), hvdkit.backends.zero3 (Horovod)
HOROVOD_OPS = ("average", "sum", "adasum")
HOROVOD_REDUCERS = ("bucketed", "stock")
NONFINITE_MODES = ("stop", "warn")  # hvdkit.nonfinite
LOG_LEVELS = ("DEBUG", "INFO", "WARNING")  # hvdkit.log
PROGRESS_MODES = ("auto", "bar", "lines")  # auto: a bar on a terminal, plain lines in a batch log


def launched_backend() -> str | None:
    """The backend hvdkit's launcher started this process's ranks for (``HVDKIT_BACKEND``), if any."""
    import os

    from .launch.vocabulary import BACKEND_VAR

    return os.environ.get(BACKEND_VAR) or None


def parse_keep_best(spec: str | None) -> tuple[str, str] | None:
    """``"val_accuracy:max"`` -> ``("val_accuracy", "max")``; without a mode, accuracies are
    maximised and everything else minimised."""
    if not spec:
        return None
    metric, _, mode = spec.partition(":")
    mode = mode or ("max" if "acc" in metric else "min")
    if not metric.isidentifier() or mode not in ("min", "max"):
        raise ConfigError(f"--keep-best {spec!r} is not METRIC[:min|max]", "e.g. --keep-best val_loss:min")
    return metric, mode


def _builtin_or_path(what: str, value: str, names: tuple[str, ...]) -> None:
    """A built-in name, or an import path (pkg.module:fn, file.py:fn)."""
    if is_import_path(value):
        parse_import_path(value, what)
    elif value not in names:
        raise ConfigError(f"{what} {value!r} is not known",
                          f"use one of: {', '.join(names)}, or an import path pkg.module:fn / file.py:fn")


def _choice(what: str, value: str, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise ConfigError(f"{what} {value!r} is not known", f"use one of: {', '.join(allowed)}")


def _positive(what: str, value: float, allow_zero: bool = False) -> None:
    if value < 0 or (value == 0 and not allow_zero):
        bound = ">= 0" if allow_zero else "> 0"
        raise ConfigError(f"{what} must be {bound}, got {value}", f"pass a value {bound}")


@dataclass(frozen=True)
class CompressionSpec:
    """``--compression none|fp16|powersgd[:rank=R,start=N]``, parsed.

    PowerSGD (Vogels et al., NeurIPS 2019) sends each gradient matrix as two rank-``rank``
    factors, with error feedback and warm start, as torch's ``powerSGD_hook``. Rank 2 is
    the paper's choice for ResNet-18 on CIFAR-10. The first ``start`` optimizer steps send
    plain averaged gradients (torch's ``start_powerSGD_iter``, whose default of 1000 would
    outlast many runs here); it must be 2 or more, as in torch, because DDP re-forms its
    buckets after the first step.
    """

    kind: str = "none"
    rank: int = POWERSGD_DEFAULTS["rank"]
    start: int = POWERSGD_DEFAULTS["start"]

    def __str__(self) -> str:
        return f"powersgd:rank={self.rank},start={self.start}" if self.kind == "powersgd" else self.kind


def parse_compression(text: str) -> CompressionSpec:
    """``none``, ``fp16``, ``powersgd`` or ``powersgd:rank=R,start=N`` (ConfigError in one line)."""
    kind, _, rest = text.partition(":")
    _choice("--compression", kind, COMPRESSIONS)
    if kind != "powersgd":
        if rest:
            raise ConfigError(f"--compression {text}: {kind} takes no options", f"use --compression {kind}")
        return CompressionSpec(kind)
    values = dict(POWERSGD_DEFAULTS)
    seen: set[str] = set()
    for item in filter(None, rest.split(",")):
        key, eq, value = item.partition("=")
        if key in seen:  # which of the two was meant is not for hvdkit to guess
            raise ConfigError(f"--compression {text}: {key} is given twice", f"give {key} once")
        seen.add(key)
        if key not in values or not eq:
            raise ConfigError(f"--compression {text}: {item!r} is not an option of powersgd",
                              f"use powersgd:{','.join(f'{k}=N' for k in values)} (defaults "
                              f"{', '.join(f'{k}={v}' for k, v in POWERSGD_DEFAULTS.items())})")
        try:
            values[key] = int(value)
        except ValueError:
            raise ConfigError(f"--compression {text}: {key} must be an integer, got {value!r}",
                              f"e.g. powersgd:{key}={POWERSGD_DEFAULTS[key]}") from None
    if values["rank"] < 1:
        raise ConfigError(f"--compression {text}: rank must be >= 1, got {values['rank']}",
                          "use a rank of 1 to 4 (each matrix is sent as two factors of that rank)")
    if values["start"] < 2:
        raise ConfigError(f"--compression {text}: start must be >= 2, got {values['start']}",
                          "PowerSGD's error feedback starts after DDP re-forms its buckets at step 1: "
                          "use start=2 or more")
    return CompressionSpec("powersgd", values["rank"], values["start"])


@dataclass(frozen=True)
class HorovodOptions:
    """Knobs of Horovod's ``DistributedOptimizer`` and of Horovod's background thread.

    ``fusion_threshold_mb`` and ``cycle_time_ms`` map to ``HOROVOD_FUSION_THRESHOLD``
    (bytes) and ``HOROVOD_CYCLE_TIME`` and must be set before Horovod initialises;
    ``None`` keeps Horovod's defaults (128 MiB, 1 ms in 0.28). 0 MB turns fusion off.

    ``reducer``: ``bucketed`` sends gradients in DDP-style buckets of ``bucket_cap_mb``
    through Horovod's allreduce (:mod:`hvdkit.backends.hvd_reducer`); ``stock`` is
    Horovod's ``DistributedOptimizer`` itself, one allreduce per parameter. Adasum always
    runs on the stock optimizer (it reduces tensor by tensor by design).
    """

    reducer: str = "bucketed"
    bucket_cap_mb: float = 25.0
    compression: str = "none"
    op: str = "average"
    gradient_predivide_factor: float = 1.0
    fusion_threshold_mb: float | None = None
    cycle_time_ms: float | None = None
    timeline: str | None = None
    stall_check_s: int | None = None
    stall_shutdown_s: int | None = None

    def __post_init__(self) -> None:
        parse_compression(self.compression)
        _choice("horovod op", self.op, HOROVOD_OPS)
        _choice("horovod reducer", self.reducer, HOROVOD_REDUCERS)
        _positive("bucket_cap_mb", self.bucket_cap_mb)
        _positive("gradient_predivide_factor", self.gradient_predivide_factor)
        if self.op != "average" and self.gradient_predivide_factor != 1.0:
            raise ConfigError(
                f"gradient_predivide_factor={self.gradient_predivide_factor} needs op 'average'",
                "drop the predivide factor or use op=average",
            )
        if self.fusion_threshold_mb is not None:
            _positive("fusion_threshold_mb", self.fusion_threshold_mb, allow_zero=True)
        if self.cycle_time_ms is not None:
            _positive("cycle_time_ms", self.cycle_time_ms)
        for name in ("stall_check_s", "stall_shutdown_s"):
            value = getattr(self, name)
            if value is not None:
                _positive(name, value, allow_zero=True)

    # -- what Horovod's own options cannot combine with (BackendConfig and TrainConfig ask the
    #    section of the backend in use, so no check compares a backend's name) ----------------
    def sharded_conflicts(self) -> tuple[tuple[bool, str], ...]:
        """``(bad, option)`` pairs that ``--shard`` refuses: the sharded reduction averages."""
        return ((self.op != "average", f"--hvd-op {self.op}"),)

    def powersgd_conflicts(self) -> tuple[tuple[bool, str], ...]:
        """What ``--compression powersgd`` refuses: it averages low-rank factors of whole buckets,
        on hvdkit's bucketed reducer."""
        return ((self.op != "average", f"--hvd-op {self.op}"),
                (self.reducer != "bucketed", f"--hvd-reducer {self.reducer}"),
                (self.gradient_predivide_factor != 1.0, "--predivide-factor"))

    def check_step(self, clip_grad_norm: float | None, precision: str) -> None:
        """Adasum reduces the update a local step made, inside step(): there is no reduced
        gradient to unscale or clip first (Horovod refuses skip_synchronize with it)."""
        if self.op == "adasum":
            refuse_combinations("--hvd-op adasum", (
                (clip_grad_norm is not None, "--clip-grad-norm"), (precision == "fp16", "--precision fp16")),
                ": Adasum reduces each rank's update, so there is no reduced gradient to clip or unscale",
                "drop {why}, or use --hvd-op average")

    def env_vars(self) -> dict[str, str]:
        """The ``HOROVOD_*`` variables these options imply (set before Horovod initialises)."""
        env: dict[str, str] = {}
        if self.fusion_threshold_mb is not None:
            env["HOROVOD_FUSION_THRESHOLD"] = str(int(self.fusion_threshold_mb * 1024 * 1024))
        if self.cycle_time_ms is not None:
            env["HOROVOD_CYCLE_TIME"] = repr(float(self.cycle_time_ms))
        if self.timeline:
            env["HOROVOD_TIMELINE"] = self.timeline
        if self.stall_check_s is not None:
            env["HOROVOD_STALL_CHECK_TIME_SECONDS"] = str(self.stall_check_s)
            if self.stall_check_s == 0:
                env["HOROVOD_STALL_CHECK_DISABLE"] = "1"
        if self.stall_shutdown_s is not None:
            env["HOROVOD_STALL_SHUTDOWN_TIME_SECONDS"] = str(self.stall_shutdown_s)
        return env


@dataclass(frozen=True)
class DDPOptions:
    """Knobs of ``DistributedDataParallel`` and of the process group.

    Defaults are PyTorch's own, except that ``broadcast_buffers`` is exposed so
    that a fair comparison with Horovod (which never re-broadcasts buffers) can
    turn it off, and ``gradient_as_bucket_view`` is on: the gradients are views
    into DDP's buckets instead of a second copy (measured on a 76M-parameter GPT
    at 2 ranks: peak RSS 1,926/1,931 -> 1,631/1,615 MiB per rank, the same bits).
    """

    bucket_cap_mb: float = 25.0
    gradient_as_bucket_view: bool = True
    static_graph: bool = False
    broadcast_buffers: bool = True
    find_unused_parameters: bool = False
    compression: str = "none"
    timeout_s: float = 1800.0
    environment: str = "auto"
    process_group_backend: str | None = None

    def __post_init__(self) -> None:
        _positive("bucket_cap_mb", self.bucket_cap_mb)
        if not self.timeout_s >= 1:  # torch counts it in whole milliseconds; 0 fails deep in C++
            raise ConfigError(f"--ddp-timeout must be at least 1 second, got {self.timeout_s:g}",
                              "pass seconds, e.g. --ddp-timeout 1800 (the default)")
        parse_compression(self.compression)
        if self.process_group_backend is not None:
            _choice("process group backend", self.process_group_backend, ("gloo", "nccl", "mpi"))

    def sharded_conflicts(self) -> tuple[tuple[bool, str], ...]:
        """Nothing of DDP's own options conflicts with ``--shard`` (HorovodOptions' counterpart)."""
        return ()

    def powersgd_conflicts(self) -> tuple[tuple[bool, str], ...]:
        return ()

    def check_step(self, clip_grad_norm: float | None, precision: str) -> None:
        return None


@dataclass(frozen=True)
class BackendConfig:
    """Which backend, and the options that both honour.

    ``accumulation_steps`` is Horovod's ``backward_passes_per_step`` and the
    number of micro-batches per optimizer step under DDP's ``no_sync()``.
    """

    name: str = field(default_factory=lambda: launched_backend() or DEFAULT_BACKEND)
    accumulation_steps: int = 1
    shard: str = "none"  # optimizer: ZeRO-1/2 (1/N of the optimizer state); full: FSDP2 (DDP), ZeRO-3 (Horovod)
    activation_checkpointing: bool = False  # recompute each block's activations in backward (hvdkit.blocks)
    horovod: HorovodOptions = field(default_factory=HorovodOptions)
    ddp: DDPOptions = field(default_factory=DDPOptions)

    @property
    def options(self) -> HorovodOptions | DDPOptions | None:
        """This backend's own options section (``TRAITS[name].options``), None where it has none."""
        section = TRAITS[self.name].options
        return getattr(self, section) if section else None

    @property
    def compression(self) -> CompressionSpec:
        """The gradient compression of this backend (its own options section's; none without one)."""
        return parse_compression(self.options.compression if self.options else "none")

    @property
    def timeline(self) -> str | None:
        """``--timeline``: Horovod's own timeline, or another backend's profiler trace. It sits in
        Horovod's section because Horovod reads it at init (``HOROVOD_TIMELINE``)."""
        return self.horovod.timeline

    @property
    def bucket_cap_mb(self) -> float:
        """``--bucket-cap-mb`` from this backend's own options section (DDP's default where it
        has none); ZeRO's buckets use it too."""
        return float(self.options.bucket_cap_mb if self.options else DDPOptions.bucket_cap_mb)

    def __post_init__(self) -> None:
        if self.name not in BACKENDS and self.name == launched_backend():  # not given: the environment's
            from .launch.vocabulary import BACKEND_VAR

            raise ConfigError(f"{BACKEND_VAR}={self.name!r} in the environment is not a backend",
                              f"set it to one of: {', '.join(BACKENDS)} (hvdkit's launchers set it), or unset it")
        _choice("backend", self.name, BACKENDS)
        _choice("shard", self.shard, SHARD_MODES)
        own = TRAITS[self.name]
        if self.shard == "full" and not own.full_shard:
            full = ", ".join(f"--backend {t.name}" for t in TRAITS.values() if t.full_shard)
            raise ConfigError(f"--shard full is not available with --backend {self.name}: it shards the parameters "
                              f"over ranks, which only {full} run (each layer's weights gathered in forward and "
                              "backward)", f"use {full} --shard full")
        compression, section = self.compression, self.options
        if self.shard != "none":
            refuse_combinations(f"--shard {self.shard}", (
                *(section.sharded_conflicts() if section else ()),
                (compression.kind != "none", f"--compression {compression.kind}")),
                " (the sharded reduction averages plain gradients)", "drop {why} or --shard")
        if compression.kind == "powersgd" and section is not None:
            refuse_combinations("--compression powersgd", section.powersgd_conflicts(),
                                " (it averages low-rank factors of whole buckets, on hvdkit's bucketed reducer)",
                                "drop {why}")
        if self.accumulation_steps < 1:
            raise ConfigError(
                f"accumulation_steps must be >= 1, got {self.accumulation_steps}",
                "use 1 for no accumulation",
            )


@dataclass(frozen=True)
class TrainConfig:
    """One training run: a model (built in, or yours by import path), its data, and the loop's knobs."""

    model: str = "cnn"  # a built-in name, or pkg.module:fn / file.py:fn returning an nn.Module
    model_args: dict[str, Any] = field(default_factory=dict)
    task: str = "classification"  # or language-model, or pkg.module:fn (hvdkit.tasks)
    epochs: int = 2
    steps_per_epoch: int | None = None
    max_steps: int | None = None
    batch_size: int = 32
    global_batch_size: int | None = None
    exact_batch: bool = False
    lr: float = 0.01
    scale_lr: bool = True
    warmup_epochs: float = 0.0
    lr_schedule: str = "constant"  # after the warm-up: constant, cosine (to min_lr_ratio x lr), step
    min_lr_ratio: float = 0.0
    lr_decay_steps: int | None = None  # cosine's length in steps [default: the run's, max_steps if given]
    lr_step_epochs: float = 1.0   # step schedule: multiply by lr_gamma every this many epochs
    lr_gamma: float = 0.1
    momentum: float = 0.9
    weight_decay: float = 0.0  # on weights of 2 or more dimensions; biases and norms get none
    optimizer: str = "sgd"  # sgd, adam, adamw, or pkg.module:Class (e.g. torch.optim:RMSprop)
    optimizer_args: dict[str, Any] = field(default_factory=dict)
    clip_grad_norm: float | None = None  # of the reduced (and unscaled) gradients
    num_samples: int = 1024
    data: str | None = None
    dataset: str | None = None  # pkg.module:fn returning a map-style Dataset (or train, val)
    dataset_args: dict[str, Any] = field(default_factory=dict)
    val_data: str | None = None
    val_fraction: float = 0.0  # a fixed split of the training data (seeded, never moves)
    eval_every: int = 0  # also evaluate every N steps (epoch ends always, with validation data)
    eval_batch_size: int | None = None
    num_workers: int = 0  # DataLoader worker processes per rank
    seed: int = 0
    checkpoint_dir: str | None = None
    checkpoint_every: int = 0
    keep_checkpoints: int = 3
    keep_best: str | None = None  # METRIC[:min|max]: also keep the best checkpoint, never rotated
    resume: bool = True
    requeue: bool = True
    log_every: int = 0
    on_nonfinite: str = "stop"  # stop | warn at the first NaN/inf loss on any rank
    memory_check: bool = True  # hvdkit.preflight: refuse before step 1 a run whose ranks cannot fit
    precision: str = "fp32"  # fp32 | bf16 | fp16 (autocast; fp16 with a gradient scaler)
    asha_dir: str | None = None  # a sweep's ASHA directory: judge this trial at each rung
    asha_trial: int | None = None
    metrics_file: str | None = None
    tensorboard: str | None = None  # rank 0 writes TensorBoard event files here
    progress: str = "auto"  # auto | bar | lines
    elastic: bool = False
    commit_every: int = 10  # fold the epoch loss (and, elastic, commit state to memory) every N steps
    sample_log: str | None = None  # JSON lines: the sample ids each committed step read
    uneven: bool = False  # keep every sample: shards may differ, ranks that finish early join
    log_level: str = "INFO"  # INFO: rank 0 speaks; DEBUG: every rank, with more detail
    backend: BackendConfig = field(default_factory=BackendConfig)

    @property
    def checks_memory(self) -> bool:
        """Whether the run's memory is checked against its model (``hvdkit.preflight`` before step 1,
        ``hvdkit slurm --mem`` before the queue): ``--memory-check``, except elastic runs (a newcomer
        checks alone, mid-run, with no collective)."""
        return self.memory_check and not self.elastic

    @property
    def has_validation(self) -> bool:
        """Validation data is named (a --dataset factory may bring its own: checked at set-up)."""
        return bool(self.val_data) or self.val_fraction > 0 or bool(self.dataset)

    def epoch_metrics(self) -> tuple[str, ...] | None:
        """The names each epoch's record holds (what --keep-best and a sweep's metric may name):
        the training ones, and ``val_`` + the task's with validation data; None for a task of
        your own, whose names are known only at its first evaluation."""
        if self.task not in TASK_METRICS:
            return None
        held_out = tuple(f"val_{m}" for m in TASK_METRICS[self.task] if m != "count") if self.has_validation else ()
        return (*EPOCH_METRICS, *held_out)

    def import_paths(self) -> list[tuple[str, dict[str, Any], str, int]]:
        """``(value, args, option, skip)`` of every object this run names by import path (model,
        dataset, task, optimizer): what the CLI checks before anything runs. ``skip``: leading
        parameters the call fills itself (an optimizer's parameters)."""
        named: list[tuple[str | None, dict[str, Any], str, int]] = [
            (self.model, self.model_args, "--model", 0), (self.dataset, self.dataset_args, "--dataset", 0),
            (self.task, {}, "--task", 0), (self.optimizer, {"lr": self.lr, **self.optimizer_args}, "--optimizer", 1)]
        return [(value, args, what, skip) for value, args, what, skip in named if value and is_import_path(value)]

    def check_outputs(self) -> None:
        """Every path the run will write can be written: found now, not after the training (a
        metrics file) or at the first step (TensorBoard, the sample log, the timeline)."""
        from .fileio import check_writable

        for value, what, directory in ((self.metrics_file, "--metrics-file", False),
                                       (self.sample_log, "--sample-log", False),
                                       (self.tensorboard, "--tensorboard", True),
                                       (self.backend.timeline, "--timeline", False),
                                       (self.checkpoint_dir, "--checkpoint-dir", True)):
            if value:
                check_writable(value, what, directory)

    def __post_init__(self) -> None:
        _builtin_or_path("--model", self.model, MODEL_NAMES)
        _builtin_or_path("--task", self.task, TASK_NAMES)
        _builtin_or_path("--optimizer", self.optimizer, OPTIMIZER_NAMES)
        if self.dataset is not None:
            parse_import_path(self.dataset, "--dataset")
        _choice("lr_schedule", self.lr_schedule, LR_SCHEDULES)
        _choice("on_nonfinite", self.on_nonfinite, NONFINITE_MODES)
        _choice("precision", self.precision, PRECISIONS)
        _choice("log_level", self.log_level, LOG_LEVELS)
        _choice("progress", self.progress, PROGRESS_MODES)
        for name in ("model_args", "optimizer_args", "dataset_args"):
            if not isinstance(getattr(self, name), dict):
                raise ConfigError(f"{name} must be a mapping of keyword: value", f"e.g. {name}: {{key: 1}}")
        if self.data and self.dataset:
            raise ConfigError("--data and --dataset both name the training data", "pass one of them")
        if self.val_data and self.val_fraction:
            raise ConfigError("--val-data and --val-fraction both name the validation data", "pass one of them")
        if not 0.0 <= self.val_fraction < 1.0:
            raise ConfigError(f"--val-fraction must be in [0, 1), got {self.val_fraction}",
                              "e.g. --val-fraction 0.1 holds out a tenth of the training data")
        if self.eval_every and not self.has_validation:
            raise ConfigError("--eval-every needs validation data", "add --val-data FILE or --val-fraction F")
        best = parse_keep_best(self.keep_best)
        if best is not None:
            if not self.checkpoint_dir:
                raise ConfigError("--keep-best needs --checkpoint-dir", "add --checkpoint-dir DIR")
            if best[0].startswith("val_") and not self.has_validation:
                raise ConfigError(f"--keep-best {best[0]} needs validation data",
                                  "add --val-data FILE or --val-fraction F")
            known = self.epoch_metrics()  # None: a task of your own, checked at its first evaluation
            if known is not None and best[0] not in known:
                raise ConfigError(f"--keep-best {best[0]} is never produced: the {self.task} task's "
                                  f"epochs report {', '.join(known)}", "name one of them, e.g. val_loss")
        if self.model not in MODEL_NAMES and not self.data and not self.dataset:
            # said here, so when a script is generated too, not by every rank after the launch
            raise ConfigError(f"--model {self.model} needs data: synthetic data exists only for the built-in "
                              f"models ({', '.join(MODEL_NAMES)})", "pass --data FILE.h5 or --dataset pkg.module:fn")
        if (self.asha_dir is None) != (self.asha_trial is None):
            raise ConfigError("--asha-dir and --asha-trial go together",
                              "let 'hvdkit sweep --scheduler asha' pass both")
        if self.elastic and self.asha_dir is not None:
            raise ConfigError("--asha-dir with --elastic is not supported: a rung compares trials of "
                              "one fixed size, and rank 0, which judges it, may change in an elastic job",
                              "sweep trials run without --elastic")
        if self.backend.shard != "none":
            refuse_combinations(f"--shard {self.backend.shard}", (
                (self.elastic, "--elastic"), (self.uneven, "--uneven"),
                (self.precision == "fp16", "--precision fp16 (use bf16)")),
                ": every rank must take part in every sharded reduction, and each holds only its part "
                "of the state", "drop {why} or --shard")
        if self.backend.compression.kind == "powersgd":
            refuse_combinations("--compression powersgd", (
                (self.elastic, "--elastic"), (self.uneven, "--uneven"),
                (self.precision == "fp16", "--precision fp16 (use bf16)")),
                ": its error feedback is each rank's own state, kept across steps (a changing world or a "
                "joined rank has none to give, and a scaled gradient that overflows would poison it)",
                "drop {why} or use --compression fp16")
        if self.uneven:
            refuse_combinations("--uneven", (
                (self.backend.accumulation_steps > 1, "--accumulation-steps above 1"),
                (self.elastic, "--elastic"), (self.precision == "fp16", "--precision fp16"),
                (self.steps_per_epoch is not None, "--steps-per-epoch")),
                " (a rank that has joined cannot take part in it)", "drop {why} or --uneven")
        for name in ("epochs", "batch_size", "num_samples"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be >= 1, got {getattr(self, name)}", f"raise {name}")
        for name in ("global_batch_size", "max_steps", "steps_per_epoch", "eval_batch_size", "lr_decay_steps"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ConfigError(f"{name} must be >= 1, got {value}", "raise it or omit it")
        _finite_positive("lr", self.lr)
        _positive("warmup_epochs", self.warmup_epochs, allow_zero=True)
        _positive("checkpoint_every", self.checkpoint_every, allow_zero=True)
        _positive("eval_every", self.eval_every, allow_zero=True)
        _positive("num_workers", self.num_workers, allow_zero=True)
        _positive("momentum", self.momentum, allow_zero=True)
        if self.num_workers > MAX_WORKERS:
            # each worker is a forked copy of the rank: thousands fork until the process limit
            raise ConfigError(f"--num-workers {self.num_workers} is more than {MAX_WORKERS} DataLoader processes "
                              "for one rank", "use a few per rank (2-8 is typical; about the cores each rank has)")
        _positive("weight_decay", self.weight_decay, allow_zero=True)
        _positive("lr_step_epochs", self.lr_step_epochs)
        _positive("lr_gamma", self.lr_gamma)
        if self.lr_decay_steps is not None and self.lr_schedule != "cosine":
            raise ConfigError(f"--lr-decay-steps sets the cosine schedule's length, and --lr-schedule is "
                              f"{self.lr_schedule}: it would be ignored", "add --lr-schedule cosine, or drop it")
        if not 0.0 <= self.min_lr_ratio <= 1.0:
            raise ConfigError(f"min_lr_ratio must be in [0, 1], got {self.min_lr_ratio}", "e.g. 0.1")
        if self.clip_grad_norm is not None:
            _finite_positive("clip_grad_norm", self.clip_grad_norm)
        if self.backend.options is not None:
            self.backend.options.check_step(self.clip_grad_norm, self.precision)
        if self.commit_every < 1:
            raise ConfigError("commit_every must be >= 1", "commit at least every step")
        if self.keep_checkpoints < 1:
            raise ConfigError("keep_checkpoints must be >= 1", "keep at least one checkpoint")


def refuse_combinations(option: str, combos: tuple[tuple[bool, str], ...], reason: str, hint: str) -> None:
    """ConfigError for the first ``(bad, why)`` in ``combos`` that holds: "``option`` cannot be
    combined with ``why``" and ``reason``; ``hint`` may name ``{why}``."""
    for bad, why in combos:
        if bad:
            raise ConfigError(f"{option} cannot be combined with {why}{reason}", hint.format(why=why))


def _finite_positive(what: str, value: float) -> None:
    if not math.isfinite(value) or value <= 0:
        raise ConfigError(f"{what} must be a finite number > 0, got {value}", "pass e.g. 0.01")


def config_from_dict(cls: type, data: dict[str, Any]) -> Any:
    """Build dataclass ``cls`` from a (possibly nested) dict, rejecting unknown keys."""
    known = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - set(known))
    if unknown:
        raise ConfigError(
            f"unknown {cls.__name__} key(s): {', '.join(unknown)}",
            f"valid keys are: {', '.join(sorted(known))}",
        )
    kwargs: dict[str, Any] = {}
    for key, value in data.items():
        sub = {"horovod": HorovodOptions, "ddp": DDPOptions, "backend": BackendConfig}.get(key)
        if sub is not None and isinstance(value, dict):
            value = config_from_dict(sub, value)
        kwargs[key] = value
    return cls(**kwargs)
