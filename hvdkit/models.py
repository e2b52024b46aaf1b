"""Example models and the synthetic data they train on.

Two shapes of work matter for data-parallel training:

* ``cnn`` – a small convolutional net on 3x32x32 images: few, mid-sized
  gradient tensors, compute-heavy.
* ``mlp`` – a deep residual MLP with LayerNorm: ~200 small gradient tensors,
  the case where Horovod's tensor fusion (and DDP's bucketing) matter.

The data is generated from a fixed seed, identically on every rank, and
labelled by a fixed random "teacher" so that the loss really goes down.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils.data import Dataset, TensorDataset

from .config import MODEL_NAMES
from .materialise import Built, build

__all__ = ["SmallCNN", "ManyTensorsMLP", "ModelSpec", "MODELS", "build_model", "build_model_lazily",
           "build_model_on_meta", "check_builtin_args", "synthetic_dataset"]


class SmallCNN(nn.Module):
    """Conv-ReLU-pool x2 then two linear layers; 10 classes on 3x32x32 inputs."""

    def __init__(self, width: int = 32, classes: int = 10) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(3, width, 3, padding=1),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Conv2d(width, 2 * width, 3, padding=1),
            nn.ReLU(),
            nn.MaxPool2d(2),
        )
        self.head = nn.Sequential(
            nn.Flatten(), nn.Linear(2 * width * 8 * 8, 128), nn.ReLU(), nn.Linear(128, classes)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x))


class _Block(nn.Module):
    def __init__(self, dim: int, depth: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.fc = nn.Linear(dim, dim)
        self.scale = 1.0 / depth**0.5  # keeps the residual stream's variance bounded

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.scale * torch.relu(self.fc(self.norm(x)))


class ManyTensorsMLP(nn.Module):
    """Residual MLP: ``depth`` blocks of LayerNorm + Linear, 4 small tensors each."""

    def __init__(self, in_dim: int = 64, dim: int = 128, depth: int = 48, classes: int = 10) -> None:
        super().__init__()
        self.inp = nn.Linear(in_dim, dim)
        self.blocks = nn.Sequential(*[_Block(dim, depth) for _ in range(depth)])
        self.norm = nn.LayerNorm(dim)
        self.out = nn.Linear(dim, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.norm(self.blocks(self.inp(x))))


@dataclass(frozen=True)
class ModelSpec:
    """How to build a model and the shape of one input sample."""

    factory: Callable[[], nn.Module]
    input_shape: tuple[int, ...]
    classes: int = 10


MODELS: dict[str, ModelSpec] = {
    "cnn": ModelSpec(SmallCNN, (3, 32, 32)),
    "mlp": ModelSpec(ManyTensorsMLP, (64,)),
    "tiny": ModelSpec(lambda: nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4)), (8,), 4),
}


assert tuple(sorted(MODELS)) == tuple(sorted(MODEL_NAMES)), "keep config.MODEL_NAMES in step with MODELS"


def check_builtin_args(name: str, args: Mapping[str, Any]) -> None:
    """ConfigError unless built-in model ``name`` takes keyword arguments ``args``."""
    import inspect

    from .errors import ConfigError

    factory = MODELS[name].factory
    params = [p for p in inspect.signature(factory).parameters]
    unknown = [k for k in args if k not in params]
    if unknown:
        raise ConfigError(f"--model {name} takes no argument {', '.join(map(repr, unknown))}",
                          f"its arguments are: {', '.join(params) or '(none)'}")


def _factory(name: str, args: Mapping[str, Any] | None) -> tuple[Callable[..., Any], Callable[[], Any]]:
    """``name``'s factory (a built-in or an import path, checked here), and its call with ``args``."""
    from .factories import call, is_import_path, resolve

    args = dict(args or {})
    if is_import_path(name):
        factory: Callable[..., Any] = resolve(name, args, what="--model")
    elif name in MODELS:
        factory = MODELS[name].factory
        check_builtin_args(name, args)
    else:
        from .errors import ConfigError

        raise ConfigError(f"model {name!r} is not known", f"use one of {', '.join(MODELS)} or pkg.module:fn")
    return factory, lambda: call(factory, name, args, "--model")


def _checked(name: str, model: Any) -> nn.Module:
    if not isinstance(model, nn.Module):
        from .errors import ConfigError

        raise ConfigError(f"--model {name} returned a {type(model).__name__}, not a torch.nn.Module",
                          "return the model object from the factory")
    return model


def build_model(name: str, seed: int = 0, args: Mapping[str, Any] | None = None) -> nn.Module:
    """Build model ``name`` with weights drawn from ``seed`` (same seed, same weights).

    ``name`` is a built-in (:data:`MODELS`) or an import path ``pkg.module:fn`` /
    ``file.py:fn`` to a function or class returning an ``nn.Module``, called with ``args``.
    """
    _, factory = _factory(name, args)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return _checked(name, factory())


def build_model_lazily(name: str, seed: int = 0, args: Mapping[str, Any] | None = None) -> Built:
    """:func:`build_model`, on the meta device where the factory is a class defining
    ``hvdkit_init``, or a function annotated to return one (:mod:`hvdkit.materialise`):
    ``Backend.wrap(model, optimizer, init=built.init)`` makes it."""
    target, factory = _factory(name, args)
    built = build(factory, seed, target)
    _checked(name, built.model)
    return built


def build_model_on_meta(name: str, args: Mapping[str, Any] | None = None) -> nn.Module:
    """Model ``name`` built under the meta device: its shapes and dtypes, no memory (to size it
    where it will not be trained, as ``hvdkit slurm --mem`` does). A factory that loads real
    tensors (a file, an explicit device) still does."""
    _, factory = _factory(name, args)
    with torch.device("meta"):
        return _checked(name, factory())


def synthetic_dataset(name: str, num_samples: int, seed: int = 1234) -> Dataset:
    """Inputs ~ N(0, 1) and labels from a fixed random linear teacher; identical on all ranks."""
    spec = MODELS[name]
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn((num_samples, *spec.input_shape), generator=gen)
    teacher = torch.randn((x[0].numel(), spec.classes), generator=gen)
    y = (x.flatten(1) @ teacher).argmax(dim=1)
    return TensorDataset(x, y)
