"""Exact metrics over ranks: every sample counts once, whatever the world size.

``DistributedSampler`` pads the last shards with repeated samples so that every rank has as
many, and a metric averaged over ranks then counts those twice (97 samples on 2 ranks are
scored as 98). Here each rank keeps *sums* weighted by how many units (samples, tokens) each
value covers, and the ranks add their sums and counts in one allreduce: the mean of the whole
set, exactly, as torchmetrics' sum/count states and Accelerate's ``gather_for_metrics`` do.

:func:`evaluate` is the held-out evaluation of ``hvdkit train``; :class:`MetricSums` is the
piece for your own loop.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Any

import torch
from torch.utils.data import DataLoader, Dataset, Sampler

from .tasks import Task, to_device

if TYPE_CHECKING:
    from .backends.base import Backend

__all__ = ["MetricSums", "EvalShard", "evaluate"]


class MetricSums:
    """Weighted sums of per-batch means, reduced exactly over ranks.

    ``add({"loss": mean, "accuracy": mean}, count)`` for each batch; :meth:`compute` is
    collective and returns ``sum(mean * count) / sum(count)`` of every metric, over all
    ranks. Sums stay on the device in float64 (no host sync per batch).
    """

    def __init__(self, device: torch.device | str = "cpu") -> None:
        self.device = torch.device(device)
        self.names: list[str] = []
        self._sums: dict[str, torch.Tensor] = {}
        self._count = torch.zeros((), dtype=torch.float64, device=self.device)

    def add(self, means: Mapping[str, Any], count: int | torch.Tensor) -> None:
        n = torch.as_tensor(count, dtype=torch.float64, device=self.device)
        for name, value in means.items():
            if name == "count":
                continue
            if name not in self._sums:
                self.names.append(name)
                self._sums[name] = torch.zeros((), dtype=torch.float64, device=self.device)
            self._sums[name] += torch.as_tensor(value, device=self.device).detach().to(torch.float64) * n
        self._count += n

    def compute(self, backend: Backend) -> dict[str, float]:
        """Collective: the exact means over every rank's samples; ``count`` is their number.

        Every rank must have added the same metric names (the same task guarantees it).
        """
        names = backend.broadcast_object(self.names, 0) if backend.size > 1 else self.names
        vector = torch.stack([*(self._sums.get(n, torch.zeros((), dtype=torch.float64, device=self.device))
                                for n in names), self._count])
        total = backend.allreduce_tensor(vector, op="sum") if backend.size > 1 else vector
        values = total.tolist()
        count = values[-1]
        out = {name: (v / count if count else float("nan")) for name, v in zip(names, values)}
        out["count"] = count
        return out


class EvalShard(Sampler[int]):
    """Indices ``rank::size`` of a dataset, in order: no padding, nothing dropped.

    Shards differ by at most one sample; together they are the dataset, each index once.
    """

    def __init__(self, num_samples: int, num_replicas: int, rank: int) -> None:
        self.num_samples, self.num_replicas, self.rank = num_samples, num_replicas, rank

    def __iter__(self) -> Iterator[int]:
        return iter(range(self.rank, self.num_samples, self.num_replicas))

    def __len__(self) -> int:
        return len(range(self.rank, self.num_samples, self.num_replicas))


@torch.no_grad()
def evaluate(backend: Backend, model: torch.nn.Module, dataset: Dataset, task: Task, batch_size: int,
             precision: str = "fp32", num_workers: int = 0, prefix: str = "") -> dict[str, float]:
    """Collective: the task's metrics over the whole ``dataset``, sharded over ranks, exactly.

    The model runs in eval mode (dropout off, norm layers on their running statistics) and
    unwrapped (no gradient hooks, no collective in the forward pass), so ranks with one
    sample less than others never wait on each other. Returns the task's finalized means
    (``loss``, ``accuracy``, ``perplexity``, ...) and ``count``, the samples scored, each name
    after ``prefix`` (``"val_"``: the names ``hvdkit train`` and ``keep_best`` use).
    """
    from .precision import autocast

    backend.sync_buffers(model)  # rank 0's BatchNorm statistics: one model is evaluated
    plain = backend.strategy.eval_module(model)
    was_training = plain.training
    plain.eval()
    sums = MetricSums(backend.device)
    shard = EvalShard(len(dataset), backend.size, backend.rank)  # type: ignore[arg-type]
    loader = DataLoader(dataset, batch_size=batch_size, sampler=shard, num_workers=num_workers)
    try:
        for batch in backend.strategy.eval_batches(loader, shard):
            batch, weight = batch
            batch = to_device(batch, backend.device)
            with autocast(precision, backend.device):
                out = task(plain, batch)
            sums.add({k: v for k, v in out.items() if k != "count"}, out["count"] * weight)
    finally:
        plain.train(was_training)
    means = sums.compute(backend)
    count = means.pop("count")
    return {f"{prefix}{k}": v for k, v in {**task.finalize(means), "count": count}.items()}
