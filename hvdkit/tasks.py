"""Tasks: how a batch and a model's output become the loss to minimise and the metrics to report.

The training loop never looks inside a batch; a task does. Built in:

* ``classification``: batch ``(x, y)``, output logits ``(N, C)``; loss is cross-entropy,
  metrics ``accuracy`` (top-1).
* ``language-model``: batch is token ids ``(N, T+1)`` (inputs are ``[:, :-1]``, targets
  ``[:, 1:]``) or a pair ``(inputs, targets)`` of ``(N, T)``; output logits ``(N, T, V)``;
  loss is the mean cross-entropy per token, metrics ``accuracy`` (next token) and
  ``perplexity`` (``exp`` of the loss, computed after the exact mean over all ranks).

A model may return a tensor, a dict with ``"logits"``, or an object with ``.logits``
(Hugging Face style). Anything else is served by your own function, ``--task pkg.mod:fn``::

    def my_task(model, batch):
        out = model(**batch)                       # whatever your model takes
        return {"loss": out.loss, "count": batch["labels"].numel(),
                "accuracy": (out.logits.argmax(-1) == batch["labels"]).float().mean()}

It returns the loss (a scalar tensor, the *mean* over ``count`` units: samples or tokens),
or a dict holding ``loss``, optionally ``count`` (default: the batch's first dimension) and
other scalar means over the same units. hvdkit weighs each by ``count`` when it averages over
batches and ranks, so a validation metric counts every sample exactly once.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn

from .errors import HvdkitError

__all__ = ["Task", "Classification", "LanguageModel", "FunctionTask", "TASKS", "make_task",
           "batch_size_of", "check_labels", "to_device", "logits_of"]


def to_device(batch: Any, device: torch.device) -> Any:
    """Move every tensor of a (nested) batch to ``device``."""
    if isinstance(batch, torch.Tensor):
        return batch.to(device, non_blocking=True)
    if isinstance(batch, Mapping):
        return {k: to_device(v, device) for k, v in batch.items()}
    if isinstance(batch, (list, tuple)):
        return type(batch)(to_device(v, device) for v in batch)
    return batch


def batch_size_of(batch: Any) -> int:
    """The first dimension of the first tensor in a batch."""
    if isinstance(batch, torch.Tensor):
        return int(batch.shape[0]) if batch.dim() else 1
    items = batch.values() if isinstance(batch, Mapping) else batch if isinstance(batch, (list, tuple)) else []
    for item in items:
        n = batch_size_of(item)
        if n:
            return n
    return 0


def logits_of(output: Any) -> torch.Tensor:
    """A model output's logits: the tensor itself, ``output["logits"]`` or ``output.logits``."""
    if isinstance(output, torch.Tensor):
        return output
    if isinstance(output, Mapping) and isinstance(output.get("logits"), torch.Tensor):
        return output["logits"]
    if isinstance(getattr(output, "logits", None), torch.Tensor):
        return output.logits
    if isinstance(output, (tuple, list)) and output and isinstance(output[0], torch.Tensor):
        return output[0]
    raise HvdkitError(f"the model returned a {type(output).__name__}, not logits",
                      "return a tensor (or a dict with 'logits'), or pass --task pkg.module:fn "
                      "that computes the loss from your model's output")


class Task:
    """Loss and metrics of one batch; ``higher_is_better`` names metrics to maximise."""

    name = "task"
    higher_is_better: tuple[str, ...] = ("accuracy",)
    metrics: tuple[str, ...] = ()  # what evaluate() reports, where known before running (else ())

    def __call__(self, model: nn.Module, batch: Any) -> dict[str, torch.Tensor]:
        """``{"loss": mean, "count": units, <metric>: mean, ...}`` for one batch."""
        raise NotImplementedError

    def check(self, model: nn.Module, batch: Any) -> dict[str, Any]:
        """Raise one line if this batch does not fit the model (the check before the first step);
        returns facts learnt from it (``classes``: the labels must be below; ``batch_labels``)."""
        self(model, batch)
        return {}

    def finalize(self, means: dict[str, float]) -> dict[str, float]:
        """Metrics derived from the exact means over all ranks (e.g. perplexity)."""
        return means


def _mismatch(what: str, hint: str) -> HvdkitError:
    return HvdkitError(what, hint)


class Classification(Task):
    """Cross-entropy on logits ``(N, C)`` against integer labels ``(N,)``; top-1 accuracy."""

    name = "classification"
    metrics = ("loss", "accuracy", "count")  # config.TASK_METRICS names them without torch

    @staticmethod
    def _split(batch: Any) -> tuple[Any, torch.Tensor]:
        if isinstance(batch, (tuple, list)) and len(batch) == 2:
            return batch[0], batch[1]
        if isinstance(batch, Mapping) and {"x", "y"} <= set(batch):
            return batch["x"], batch["y"]
        raise _mismatch(f"classification needs batches of (inputs, labels); got a {type(batch).__name__}",
                        "give the data a 'y' dataset of labels, or pass --task for other batches")

    def __call__(self, model: nn.Module, batch: Any) -> dict[str, torch.Tensor]:
        x, y = self._split(batch)
        logits = logits_of(model(x))
        loss = nn.functional.cross_entropy(logits.float(), y)
        accuracy = (logits.detach().argmax(dim=-1) == y).float().mean()
        return {"loss": loss, "count": torch.tensor(y.shape[0]), "accuracy": accuracy}

    def check(self, model: nn.Module, batch: Any) -> dict[str, Any]:
        x, y = self._split(batch)
        if y.is_floating_point() or y.dim() != 1:
            raise _mismatch(f"classification labels must be integers of shape (N,); got {tuple(y.shape)} "
                            f"{str(y.dtype).removeprefix('torch.')}",
                            "store class indices in 'y', or pass --task for another kind of target")
        logits = logits_of(model(x))
        if logits.dim() != 2 or logits.shape[0] != y.shape[0]:
            raise _mismatch(f"the model's output has shape {tuple(logits.shape)} for a batch of {y.shape[0]}: "
                            "classification needs logits (N, classes)",
                            "check the model's output layer, or pass --task language-model or your own")
        # the labels are checked by the caller: all of them where the data can list them
        return {"classes": int(logits.shape[1]), "batch_labels": y}


def check_labels(labels: Any, classes: int, where: str = "") -> None:
    """One line if any label is outside ``0..classes-1`` (an array or tensor of all labels)."""
    import numpy as np

    y = np.asarray(labels.cpu() if isinstance(labels, torch.Tensor) else labels)
    if y.size == 0:
        return
    bad = (y < 0) | (y >= classes)
    if bad.any():
        i = int(np.argmax(bad))
        raise _mismatch(f"label {int(y.flat[i])}{where.format(i) if where else ''} does not fit the model's "
                        f"{classes} outputs (classes 0..{classes - 1})",
                        f"give the model {int(y.max()) + 1} outputs (e.g. --model-arg num_classes=N) "
                        "or fix the labels")


class LanguageModel(Task):
    """Next-token cross-entropy on logits ``(N, T, V)``; token accuracy and perplexity."""

    name = "language-model"
    metrics = ("loss", "accuracy", "count", "perplexity")  # perplexity from finalize()

    @staticmethod
    def _split(batch: Any) -> tuple[torch.Tensor, torch.Tensor]:
        if isinstance(batch, torch.Tensor):
            if batch.dim() != 2 or batch.shape[1] < 2:
                raise _mismatch(f"language-model batches of token ids must be (N, T+1); got {tuple(batch.shape)}",
                                "store windows of T+1 tokens in 'x'")
            return batch[:, :-1], batch[:, 1:]
        if isinstance(batch, (tuple, list)) and len(batch) == 2:
            return batch[0], batch[1]
        raise _mismatch(f"language-model needs token ids (N, T+1) or (inputs, targets); got a "
                        f"{type(batch).__name__}", "see hvdkit.tasks")

    def __call__(self, model: nn.Module, batch: Any) -> dict[str, torch.Tensor]:
        x, y = self._split(batch)
        logits = logits_of(model(x.long()))
        flat = logits.reshape(-1, logits.shape[-1])
        targets = y.reshape(-1).long()
        loss = nn.functional.cross_entropy(flat.float(), targets)
        accuracy = (flat.detach().argmax(dim=-1) == targets).float().mean()
        return {"loss": loss, "count": torch.tensor(targets.numel()), "accuracy": accuracy}

    def check(self, model: nn.Module, batch: Any) -> dict[str, Any]:
        x, y = self._split(batch)
        if x.is_floating_point():
            raise _mismatch(f"language-model inputs must be integer token ids; got {x.dtype}",
                            "store token ids as integers")
        logits = logits_of(model(x.long()))
        if logits.dim() != 3 or tuple(logits.shape[:2]) != tuple(y.shape):
            raise _mismatch(f"the model's output has shape {tuple(logits.shape)} for targets {tuple(y.shape)}: "
                            "a language model needs logits (N, T, vocab)",
                            "check the model, or pass --task classification or your own")
        if y.numel() and int(y.max()) >= logits.shape[-1]:
            raise _mismatch(f"token id {int(y.max())} does not fit the model's vocabulary of {logits.shape[-1]}",
                            "raise the model's vocab size (e.g. --model-arg vocab_size=N)")
        return {}

    def finalize(self, means: dict[str, float]) -> dict[str, float]:
        loss = means.get("loss", float("nan"))
        return {**means, "perplexity": math.exp(loss) if loss < 700 else float("inf")}


class FunctionTask(Task):
    """Your function ``fn(model, batch)`` returning the loss or a dict of loss, count and metrics."""

    def __init__(self, fn: Callable[[nn.Module, Any], Any], name: str) -> None:
        self.fn, self.name = fn, name

    def __call__(self, model: nn.Module, batch: Any) -> dict[str, torch.Tensor]:
        out = self.fn(model, batch)
        if isinstance(out, torch.Tensor):
            out = {"loss": out}
        if not isinstance(out, Mapping) or not isinstance(out.get("loss"), torch.Tensor):
            raise HvdkitError(f"--task {self.name} returned a {type(out).__name__}, not a loss tensor or a "
                              "dict with 'loss'", "return the loss, or {'loss': ..., 'count': ..., ...}")
        result = {k: v if isinstance(v, torch.Tensor) else torch.tensor(float(v)) for k, v in out.items()}
        result.setdefault("count", torch.tensor(batch_size_of(batch)))
        if result["loss"].dim() != 0:
            raise HvdkitError(f"--task {self.name} returned a loss of shape {tuple(result['loss'].shape)}",
                              "return the mean loss over the batch (a scalar)")
        return result


TASKS: dict[str, type[Task]] = {"classification": Classification, "language-model": LanguageModel}


def make_task(spec: str, args: Mapping[str, Any] | None = None) -> Task:
    """A built-in task by name, or ``pkg.module:fn`` (a function, or a Task class)."""
    if spec in TASKS:
        return TASKS[spec]()
    from .factories import call, resolve

    obj = resolve(spec, args, what="--task")
    if isinstance(obj, type) and issubclass(obj, Task):
        return call(obj, spec, dict(args or {}), "--task")  # type: ignore[no-any-return]
    return FunctionTask(obj, spec)
