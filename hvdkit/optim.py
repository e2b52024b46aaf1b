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

__all__ = ["param_groups", "make_optimizer", "check_optimizer"]

# what hvdkit passes to a built-in optimizer itself: an --optimizer-arg may not set these again
_SET_BY_HVDKIT = {"sgd": {"lr": "--lr", "momentum": "--momentum", "weight_decay": "--weight-decay"},
                  "adam": {"lr": "--lr", "weight_decay": "--weight-decay"},
                  "adamw": {"lr": "--lr", "weight_decay": "--weight-decay"}}


_BUILTIN: dict[str, Any] = {"sgd": torch.optim.SGD, "adam": torch.optim.Adam, "adamw": torch.optim.AdamW}


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
        return _BUILTIN[cfg.optimizer](groups, lr=lr, weight_decay=cfg.weight_decay, **cfg.optimizer_args)
    assert is_import_path(cfg.optimizer)
    factory = resolve(cfg.optimizer, {"lr": lr, **cfg.optimizer_args}, what="--optimizer", skip=1)
    optimizer = call(factory, cfg.optimizer, {"lr": lr, **cfg.optimizer_args}, "--optimizer", groups)
    if not isinstance(optimizer, torch.optim.Optimizer):
        from .errors import ConfigError

        raise ConfigError(f"--optimizer {cfg.optimizer} made a {type(optimizer).__name__}, not a "
                          "torch.optim.Optimizer", "name an optimizer class, e.g. torch.optim:RMSprop")
    return optimizer


def check_optimizer(cfg: TrainConfig) -> None:
    """Build the optimizer once over one throwaway parameter: any argument it refuses (a name
    it lacks, a value it rejects: ``eps=abc``, Adam's ``betas=[0.9]``) is one ConfigError now,
    not a traceback on every rank at set-up."""
    from .errors import ConfigError

    for key in cfg.optimizer_args:
        if key in _SET_BY_HVDKIT.get(cfg.optimizer, {}):
            raise ConfigError(f"--optimizer-arg {key}: --optimizer {cfg.optimizer} gets {key} from "
                              f"{_SET_BY_HVDKIT[cfg.optimizer][key]}", f"use {_SET_BY_HVDKIT[cfg.optimizer][key]}")
    _check_kinds(cfg)
    try:
        make_optimizer(cfg, [torch.nn.Parameter(torch.zeros(2, 2))], cfg.lr)
    except ConfigError:
        raise
    except Exception as exc:  # the optimizer's own refusal, whatever its type
        given = " ".join(f"--optimizer-arg {k}={v}" for k, v in cfg.optimizer_args.items())
        raise ConfigError(f"--optimizer {cfg.optimizer} refused {given or 'its arguments'}: "
                          f"{type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc).strip() else ''}",
                          "check the names and values against the optimizer's documentation") from None


def _check_kinds(cfg: TrainConfig) -> None:
    """Each --optimizer-arg has the kind of its default in the optimizer's signature: an
    optimizer takes what it is given, and 'amsgrad=maybe', a true string, would turn it on."""
    import inspect

    from .errors import ConfigError

    cls = _BUILTIN.get(cfg.optimizer) or resolve(cfg.optimizer, {"lr": cfg.lr, **cfg.optimizer_args},
                                                 what="--optimizer", skip=1)
    try:
        declared = inspect.signature(cls).parameters
    except (TypeError, ValueError):  # no signature to read (a C extension): its own checks only
        return
    for key, value in cfg.optimizer_args.items():
        default = declared[key].default if key in declared else None
        wanted = _kind(default)
        if wanted is not None and _kind(value) != wanted:
            raise ConfigError(f"--optimizer-arg {key}={value!r}: --optimizer {cfg.optimizer} takes {wanted} "
                              f"for {key} (its default is {default!r})", f"e.g. --optimizer-arg {key}={default}")


def _kind(value: Any) -> str | None:
    """A value's kind as an optimizer's defaults have it: true/false, a number, or a list."""
    if isinstance(value, bool):
        return "true or false"
    if isinstance(value, (int, float)):
        return "a number"
    if isinstance(value, (list, tuple)):
        return "a list"
    return None
