"""Typed configuration for the library. The CLI only translates flags into these.

Every dataclass validates itself in ``__post_init__`` and raises
:class:`~hvdkit.errors.ConfigError` with a one-line message and a hint.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from .backends.traits import BACKENDS
from .errors import ConfigError

__all__ = [
    "BACKENDS",
    "HorovodOptions",
    "DDPOptions",
    "BackendConfig",
    "TrainConfig",
    "config_from_dict",
]

# the example models of hvdkit.models, named here so that validating a config needs no torch
MODEL_NAMES = ("cnn", "mlp", "tiny")
PRECISIONS = ("fp32", "bf16", "fp16")  # hvdkit.precision implements them
COMPRESSIONS = ("none", "fp16")
HOROVOD_OPS = ("average", "sum", "adasum")
HOROVOD_REDUCERS = ("bucketed", "stock")


def _choice(what: str, value: str, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise ConfigError(f"{what} {value!r} is not known", f"use one of: {', '.join(allowed)}")


def _positive(what: str, value: float, allow_zero: bool = False) -> None:
    if value < 0 or (value == 0 and not allow_zero):
        bound = ">= 0" if allow_zero else "> 0"
        raise ConfigError(f"{what} must be {bound}, got {value}", f"pass a value {bound}")


@dataclass(frozen=True)
class HorovodOptions:
    """Knobs of Horovod's ``DistributedOptimizer`` and of Horovod's background thread.

    ``fusion_threshold_mb`` and ``cycle_time_ms`` map to ``HOROVOD_FUSION_THRESHOLD``
    (bytes) and ``HOROVOD_CYCLE_TIME`` and must be set before Horovod initialises;
    ``None`` keeps Horovod's defaults (128 MiB, 1 ms in 0.28). 0 MB turns fusion off.

    ``reducer``: ``bucketed`` sends gradients in DDP-style buckets of ``bucket_cap_mb``
    through Horovod's allreduce (:mod:`hvdkit.backends.buckets`); ``stock`` is
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
        _choice("compression", self.compression, COMPRESSIONS)
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

    def environment(self) -> dict[str, str]:
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
    turn it off.
    """

    bucket_cap_mb: float = 25.0
    gradient_as_bucket_view: bool = False
    static_graph: bool = False
    broadcast_buffers: bool = True
    find_unused_parameters: bool = False
    compression: str = "none"
    timeout_s: float = 1800.0
    environment: str = "auto"
    process_group_backend: str | None = None

    def __post_init__(self) -> None:
        _positive("bucket_cap_mb", self.bucket_cap_mb)
        _positive("timeout_s", self.timeout_s)
        _choice("compression", self.compression, COMPRESSIONS)
        if self.process_group_backend is not None:
            _choice("process group backend", self.process_group_backend, ("gloo", "nccl", "mpi"))


@dataclass(frozen=True)
class BackendConfig:
    """Which backend, and the options that both honour.

    ``accumulation_steps`` is Horovod's ``backward_passes_per_step`` and the
    number of micro-batches per optimizer step under DDP's ``no_sync()``.
    """

    name: str = "local"
    accumulation_steps: int = 1
    horovod: HorovodOptions = field(default_factory=HorovodOptions)
    ddp: DDPOptions = field(default_factory=DDPOptions)

    def __post_init__(self) -> None:
        _choice("backend", self.name, BACKENDS)
        if self.accumulation_steps < 1:
            raise ConfigError(
                f"accumulation_steps must be >= 1, got {self.accumulation_steps}",
                "use 1 for no accumulation",
            )


@dataclass(frozen=True)
class TrainConfig:
    """One training run of an example model on synthetic (or HDF5) data."""

    model: str = "cnn"
    epochs: int = 2
    steps_per_epoch: int | None = None
    max_steps: int | None = None
    batch_size: int = 32
    global_batch_size: int | None = None
    exact_batch: bool = False
    lr: float = 0.01
    scale_lr: bool = True
    warmup_epochs: float = 0.0
    momentum: float = 0.9
    weight_decay: float = 0.0
    optimizer: str = "sgd"
    num_samples: int = 1024
    data: str | None = None
    seed: int = 0
    checkpoint_dir: str | None = None
    checkpoint_every: int = 0
    keep_checkpoints: int = 3
    resume: bool = True
    requeue: bool = True
    log_every: int = 0
    on_nonfinite: str = "stop"  # stop | warn at the first NaN/inf loss on any rank
    precision: str = "fp32"  # fp32 | bf16 | fp16 (autocast; fp16 with a gradient scaler)
    asha_dir: str | None = None  # a sweep's ASHA directory: judge this trial at each rung
    asha_trial: int | None = None
    metrics_file: str | None = None
    elastic: bool = False
    commit_every: int = 10  # fold the epoch loss (and, elastic, commit state to memory) every N steps
    sample_log: str | None = None  # JSON lines: the sample ids each committed step read
    uneven: bool = False  # keep every sample: shards may differ, ranks that finish early join
    log_level: str = "INFO"  # INFO: rank 0 speaks; DEBUG: every rank, with more detail
    backend: BackendConfig = field(default_factory=BackendConfig)

    def __post_init__(self) -> None:
        _choice("model", self.model, MODEL_NAMES)
        _choice("optimizer", self.optimizer, ("sgd", "adam", "adamw"))
        _choice("on_nonfinite", self.on_nonfinite, ("stop", "warn"))
        _choice("precision", self.precision, PRECISIONS)
        _choice("log_level", self.log_level, ("DEBUG", "INFO", "WARNING"))
        if (self.asha_dir is None) != (self.asha_trial is None):
            raise ConfigError("--asha-dir and --asha-trial go together",
                              "let 'hvdkit sweep --scheduler asha' pass both")
        if self.elastic and self.asha_dir is not None:
            raise ConfigError("--asha-dir with --elastic is not supported: a rung compares trials of "
                              "one fixed size, and rank 0, which judges it, may change in an elastic job",
                              "sweep trials run without --elastic")
        if self.uneven:
            for bad, why in ((self.backend.accumulation_steps > 1, "--accumulation-steps above 1"),
                             (self.elastic, "--elastic"), (self.precision == "fp16", "--precision fp16"),
                             (self.steps_per_epoch is not None, "--steps-per-epoch")):
                if bad:
                    raise ConfigError(f"--uneven cannot be combined with {why} (a rank that has joined "
                                      "cannot take part in it)", f"drop {why} or --uneven")
        for name in ("epochs", "batch_size", "num_samples"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be >= 1, got {getattr(self, name)}", f"raise {name}")
        if self.global_batch_size is not None and self.global_batch_size < 1:
            raise ConfigError(
                f"global_batch_size must be >= 1, got {self.global_batch_size}", "raise it"
            )
        if self.max_steps is not None and self.max_steps < 1:
            raise ConfigError(f"max_steps must be >= 1, got {self.max_steps}", "raise it or omit it")
        if self.steps_per_epoch is not None and self.steps_per_epoch < 1:
            raise ConfigError(
                f"steps_per_epoch must be >= 1, got {self.steps_per_epoch}", "raise it or omit it"
            )
        _positive("lr", self.lr)
        _positive("warmup_epochs", self.warmup_epochs, allow_zero=True)
        _positive("checkpoint_every", self.checkpoint_every, allow_zero=True)
        if self.commit_every < 1:
            raise ConfigError("commit_every must be >= 1", "commit at least every step")
        if self.keep_checkpoints < 1:
            raise ConfigError("keep_checkpoints must be >= 1", "keep at least one checkpoint")


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
