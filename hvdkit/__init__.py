"""hvdkit: thin, honest data-parallel PyTorch training with Horovod or native DDP.

The public surface is the names below, each documented in docs/own-loop.md ("Every public
name"; a test keeps the two equal). Everything else is reachable by its module
(``hvdkit.environments``, ``hvdkit.data``, ...) but is the CLI's or the loop's own, and may change.
"""

__version__ = "0.3.0"

# Re-exports are resolved on first use (PEP 562), so that the CLI can render a job script
# or read a checkpoint summary without importing torch (about 3 s on a busy login node).
_EXPORTS = {
    # hvdkit train as a function
    "train": "loop", "TrainConfig": "config", "TrainResult": "loop",
    # your own loop: the backend and its configuration
    "create_backend": "backends", "Backend": "backends",
    "BackendConfig": "config", "HorovodOptions": "config", "DDPOptions": "config",
    # data: the sampler whose position resumes, HDF5 files, the split, the batch per rank
    "ShardSampler": "data", "H5Dataset": "data", "split_indices": "data", "per_rank_batch_size": "data",
    # checkpoints of any states, and preemption
    "CheckpointManager": "checkpoint", "Stateful": "state", "Snapshot": "checkpoint", "Restored": "checkpoint",
    "read_checkpoint": "checkpoint", "write_checkpoint": "checkpoint", "verify_checkpoint": "checkpoint",
    "Preemption": "preemption", "Preempted": "preemption", "EXIT_PREEMPTED": "preemption",
    # exact metrics over uneven shards, and the tasks hvdkit train scores
    "evaluate": "metrics", "MetricSums": "metrics", "make_task": "tasks", "Task": "tasks",
    # the built-in models and data to try things on, and the check that ranks agree
    "build_model": "models", "build_model_lazily": "models", "synthetic_dataset": "models", "param_digest": "loop",
    # what hvdkit raises: one line and a HINT
    "HvdkitError": "errors", "ConfigError": "errors", "CheckpointError": "errors",
    "BackendUnavailableError": "errors", "LauncherEnvError": "errors",
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
