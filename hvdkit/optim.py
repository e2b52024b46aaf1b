"""Optimizers: the built-in three or any class by import path, with GPT-style parameter groups.

``--optimizer adamw`` or ``--optimizer torch.optim:RMSprop --optimizer-arg alpha=0.9``: the
class is called as ``cls(param_groups, lr=..., **optimizer_args)``. Weight decay goes to
weights of two or more dimensions (linear and conv kernels, embeddings) and not to biases or
normalisation scales, as nanoGPT and most transformer recipes do; decaying a LayerNorm's gain
towards zero only hurts.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from .config import TrainConfig
from .factories import call, is_import_path, resolve

__all__ = ["param_groups", "make_optimizer"]


def param_groups(model: nn.Module, weight_decay: float) -> list[dict[str, Any]]:
    """Two groups of trainable parameters: ``dim >= 2`` with ``weight_decay``, the rest without.

    A group left empty is dropped (some optimizers refuse empty groups).
    """
    decay: list[torch.nn.Parameter] = []
    no_decay: list[torch.nn.Parameter] = []
    for p in model.parameters():
        if p.requires_grad:
            (decay if p.dim() >= 2 else no_decay).append(p)
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return [g for g in groups if g["params"]]


def make_optimizer(cfg: TrainConfig, params: Iterable[nn.Parameter] | nn.Module, lr: float) -> torch.optim.Optimizer:
    """The optimizer ``cfg`` names, at learning rate ``lr``, over ``params`` (a model: its groups)."""
    groups: Any = param_groups(params, cfg.weight_decay) if isinstance(params, nn.Module) else params
    if cfg.optimizer == "sgd":
        return torch.optim.SGD(groups, lr=lr, momentum=cfg.momentum, weight_decay=cfg.weight_decay,
                               **cfg.optimizer_args)
    if cfg.optimizer in ("adam", "adamw"):
        cls = torch.optim.Adam if cfg.optimizer == "adam" else torch.optim.AdamW
        return cls(groups, lr=lr, weight_decay=cfg.weight_decay, **cfg.optimizer_args)
    assert is_import_path(cfg.optimizer)
    factory = resolve(cfg.optimizer, {"lr": lr, **cfg.optimizer_args}, what="--optimizer", skip=1)
    optimizer = call(factory, cfg.optimizer, {"lr": lr, **cfg.optimizer_args}, "--optimizer", groups)
    if not isinstance(optimizer, torch.optim.Optimizer):
        from .errors import ConfigError

        raise ConfigError(f"--optimizer {cfg.optimizer} made a {type(optimizer).__name__}, not a "
                          "torch.optim.Optimizer", "name an optimizer class, e.g. torch.optim:RMSprop")
    return optimizer
