"""Worker: one optimizer step per case with the bucketed reducer, the stock optimizer and
(on rank 0) a single process over the whole global batch.

usage: reducer_worker.py OUT_DIR      (under a 2-rank Horovod launcher)
Writes OUT_DIR/rank<r>.pt: {case: {"bucketed": state, "stock": state, "reference": state}}.
"""

import sys
from pathlib import Path

import horovod.torch as hvd
import torch
from torch import nn

from hvdkit.backends.hvd_reducer import bucketed_optimizer

MICRO = 4  # samples per rank per micro-batch


class Net(nn.Module):
    """Four layers; ``frozen`` has requires_grad=False, ``extra`` is used only when asked."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(3)
        self.frozen = nn.Linear(8, 8)
        self.a = nn.Linear(8, 16)
        self.b = nn.Linear(16, 16)
        self.c = nn.Linear(16, 4)
        self.extra = nn.Linear(16, 4)
        self.frozen.requires_grad_(False)

    def forward(self, x: torch.Tensor, use_extra: bool) -> torch.Tensor:
        h = torch.tanh(self.b(torch.tanh(self.a(torch.tanh(self.frozen(x))))))
        out = self.c(h)
        return out + self.extra(h) if use_extra else out


# name: (accumulation, compression, op, predivide, cap_mb, which ranks use `extra`, groups)
CASES = {
    "plain": (1, "none", "average", 1.0, 25.0, (0, 1), False),
    "many_buckets": (1, "none", "average", 1.0, 0.0005, (0, 1), False),
    "accumulate2": (2, "none", "average", 1.0, 0.0005, (0, 1), False),
    "fp16": (1, "fp16", "average", 1.0, 0.0005, (0, 1), False),
    "predivide": (1, "none", "average", 2.0, 0.0005, (0, 1), False),
    "sum": (1, "none", "sum", 1.0, 0.0005, (0, 1), False),
    "unused_everywhere": (1, "none", "average", 1.0, 0.0005, (), False),
    "unused_on_rank0": (1, "none", "average", 1.0, 0.0005, (1,), False),
    "two_groups": (1, "none", "average", 1.0, 0.0005, (0, 1), True),
}


def make_optimizer(model: Net, groups: bool) -> torch.optim.Optimizer:
    if groups:  # different LRs and weight decay per group; `extra` in the second
        return torch.optim.SGD([
            {"params": [*model.a.parameters(), *model.b.parameters(), *model.c.parameters()], "lr": 0.1},
            {"params": model.extra.parameters(), "lr": 0.02, "weight_decay": 0.0},
        ], lr=0.1, momentum=0.9, weight_decay=0.01)
    return torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1,
                           momentum=0.9, weight_decay=0.01)


def batches(size: int, accum: int):
    gen = torch.Generator().manual_seed(7)
    X = torch.randn(size * accum * MICRO, 8, generator=gen)
    Y = torch.randint(0, 4, (size * accum * MICRO,), generator=gen)
    return X, Y


def one_step(case: str, reducer: str) -> dict[str, torch.Tensor]:
    accum, compression, op, predivide, cap, users, groups = CASES[case]
    rank, size = hvd.rank(), hvd.size()
    model = Net()
    opt = make_optimizer(model, groups)
    kw = dict(named_parameters=list(model.named_parameters()),
              compression=hvd.Compression.fp16 if compression == "fp16" else hvd.Compression.none,
              backward_passes_per_step=accum, op=hvd.Sum if op == "sum" else hvd.Average,
              gradient_predivide_factor=predivide)
    if reducer == "bucketed":
        opt = bucketed_optimizer(hvd, opt, bucket_cap_mb=cap, **kw)
    else:
        opt = hvd.DistributedOptimizer(opt, **kw)
    X, Y = batches(size, accum)
    for micro in range(accum):
        lo = (rank * accum + micro) * MICRO
        loss = nn.functional.cross_entropy(model(X[lo:lo + MICRO], rank in users), Y[lo:lo + MICRO])
        (loss / accum).backward()
    opt.step()
    opt.zero_grad()
    return {k: v.clone() for k, v in model.state_dict().items()}


def reference(case: str, size: int) -> dict[str, torch.Tensor] | None:
    """Single process over the global batch (where 'the same step' is well defined)."""
    accum, _, op, _, _, users, groups = CASES[case]
    if op == "sum" or len(users) == 1:
        return None  # Sum scales by the world size; a rank-dependent graph has no 1-process twin
    model = Net()
    opt = make_optimizer(model, groups)
    X, Y = batches(size, accum)
    loss = nn.functional.cross_entropy(model(X, bool(users)), Y)
    loss.backward()
    if not users:  # stock semantics: an unused parameter is reduced as zeros, so it steps
        for p in model.extra.parameters():
            p.grad = torch.zeros_like(p)
    opt.step()
    return {k: v.clone() for k, v in model.state_dict().items()}


hvd.init()
torch.set_num_threads(1)
out = {case: {"bucketed": one_step(case, "bucketed"), "stock": one_step(case, "stock"),
              "reference": reference(case, hvd.size()) if hvd.rank() == 0 else None}
       for case in CASES}
Path(sys.argv[1]).mkdir(parents=True, exist_ok=True)
torch.save(out, Path(sys.argv[1]) / f"rank{hvd.rank()}.pt")
hvd.shutdown()
