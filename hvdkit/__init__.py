"""hvdkit: thin, honest data-parallel PyTorch training with Horovod or native DDP.

Everything public is re-exported here explicitly.
"""

__version__ = "0.1.0"

from .backends import Backend, LocalBackend, create_backend
from .checkpoint import (
    CheckpointManager,
    Snapshot,
    TrainingState,
    read_checkpoint,
    verify_checkpoint,
    write_checkpoint,
)
from .config import BackendConfig, DDPOptions, HorovodOptions, TrainConfig
from .data import H5Dataset, ShardSampler, make_synthetic_h5, per_rank_batch_size
from .environments import ClusterEnvironment, detect_environment, expand_nodelist
from .errors import (
    BackendUnavailableError,
    CheckpointError,
    ConfigError,
    HvdkitError,
    LauncherEnvError,
)
from .models import MODELS, build_model, synthetic_dataset
from .train import TrainResult, train

__all__ = [
    "__version__",
    "Backend",
    "BackendConfig",
    "BackendUnavailableError",
    "CheckpointError",
    "CheckpointManager",
    "ClusterEnvironment",
    "ConfigError",
    "DDPOptions",
    "H5Dataset",
    "HorovodOptions",
    "HvdkitError",
    "LauncherEnvError",
    "LocalBackend",
    "MODELS",
    "ShardSampler",
    "Snapshot",
    "TrainConfig",
    "TrainResult",
    "TrainingState",
    "build_model",
    "create_backend",
    "detect_environment",
    "expand_nodelist",
    "make_synthetic_h5",
    "per_rank_batch_size",
    "read_checkpoint",
    "synthetic_dataset",
    "train",
    "verify_checkpoint",
    "write_checkpoint",
]
