"""hvdkit: thin, honest data-parallel PyTorch training with Horovod or native DDP.

Everything public is re-exported here explicitly.
"""

__version__ = "0.3.0"

# Re-exports are resolved on first use (PEP 562), so that the CLI can render a job script
# or read a checkpoint summary without importing torch (about 3 s on a busy login node).
_EXPORTS = {
    "Backend": "backends", "LocalBackend": "backends", "create_backend": "backends",
    "CheckpointManager": "checkpoint", "Restored": "checkpoint", "Snapshot": "checkpoint",
    "read_checkpoint": "checkpoint", "verify_checkpoint": "checkpoint", "write_checkpoint": "checkpoint",
    "BackendConfig": "config", "DDPOptions": "config", "HorovodOptions": "config", "TrainConfig": "config",
    "H5Dataset": "data", "ShardSampler": "data", "make_synthetic_h5": "data", "per_rank_batch_size": "data",
    "split_indices": "data",
    "ClusterEnvironment": "environments", "detect_environment": "environments",
    "expand_nodelist": "environments",
    "BackendUnavailableError": "errors", "CheckpointError": "errors", "ConfigError": "errors",
    "HvdkitError": "errors", "LauncherEnvError": "errors",
    "EvalShard": "metrics", "MetricSums": "metrics", "evaluate": "metrics",
    "MODELS": "models", "build_model": "models", "synthetic_dataset": "models",
    "EXIT_PREEMPTED": "preemption", "Preempted": "preemption", "Preemption": "preemption",
    "Progress": "progress",
    "Stateful": "state",
    "Task": "tasks", "make_task": "tasks",
    "TrainResult": "loop", "param_digest": "loop", "train": "loop",
}


def __getattr__(name: str) -> object:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'hvdkit' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value  # resolved once
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_EXPORTS])


__all__ = ["__version__", *sorted(_EXPORTS)]
