"""The bucketed Horovod reducer: its plan, and exactly the stock optimizer's arithmetic."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

from helpers import HVDKIT, PY, WORKERS, check, launch
from hvdkit.backends.buckets import FIRST_BUCKET_BYTES, plan_buckets
from hvdkit.backends.hvd_reducer import plan_allreduce_buckets

MiB = 1024 * 1024


def test_bucket_plan_is_what_the_docstring_says():
    # registration order: a (1 MiB), frozen (never reduced), b (0.5 MiB), c (3 MiB), d (0.25 MiB, fp16)
    params = [
        nn.Parameter(torch.zeros(MiB // 4)),
        nn.Parameter(torch.zeros(MiB // 8)),
        nn.Parameter(torch.zeros(3 * MiB // 4)),
        nn.Parameter(torch.zeros(MiB // 8, dtype=torch.float16)),
    ]
    plan = plan_allreduce_buckets(params, cap_bytes=4 * MiB)
    # reverse registration order; one dtype per bucket, each dtype filling its own (d, fp16, is
    # still open when the others close); c (3 MiB) and a (1 MiB) are >= 1 MiB, so each goes
    # alone even though the 4 MiB cap would hold more
    assert plan == [[2], [1], [0], [3]]
    assert FIRST_BUCKET_BYTES == MiB
    small = [nn.Parameter(torch.zeros(1000)) for _ in range(3)]     # 4 KB each
    mixed = plan_allreduce_buckets([small[0], nn.Parameter(torch.zeros(MiB)), *small[1:]], 4 * MiB)
    assert mixed == [[3, 2], [1], [0]]


def test_bucket_plan_caps_and_first_bucket():
    params = [nn.Parameter(torch.zeros(MiB // 16)) for _ in range(40)]  # 40 x 256 KiB
    plan = plan_allreduce_buckets(params, cap_bytes=2 * MiB)
    assert [len(b) for b in plan] == [4] + [8] * 4 + [4]   # 1 MiB first, then 2 MiB each
    assert plan[0] == [39, 38, 37, 36]
    assert sorted(i for b in plan for i in b) == list(range(40))
    with pytest.raises(ValueError):
        plan_allreduce_buckets(params, cap_bytes=0)
    # ZeRO's rules, the same planner without the two knobs: no small first bucket, and a
    # parameter goes alone only at the cap
    assert plan_buckets([MiB // 4] * 40, [None] * 40, 2 * MiB) == [list(range(39 - 8 * k, 31 - 8 * k, -1))
                                                                  for k in range(5)]
    assert plan_buckets([3, 5, 2, 9], [None] * 4, 5) == [[3], [2], [1], [0]]
    assert plan_buckets([1, 1, 1, 1], ["a", "b", "a", "b"], 2) == [[3, 1], [2, 0]]


@pytest.mark.mp
@pytest.mark.timeout(240)  # measured 12 s (2 cores, loaded)
@pytest.mark.parametrize("kind", ["hvd-gloo", "hvd-mpi"])
def test_bucketed_equals_stock_and_single_process(tmp_path, kind):
    check(launch(kind, 2, [PY, str(WORKERS / "reducer_worker.py"), str(tmp_path)]))
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    assert len(ranks[0]) == 9
    for case, results in ranks[0].items():
        bucketed, stock, ref = results["bucketed"], results["stock"], results["reference"]
        for k in bucketed:
            # identical on every rank, and the stock optimizer's numbers: with 2 ranks every
            # sum is a + b whatever the fusion layout, so bitwise
            assert torch.equal(bucketed[k], ranks[1][case]["bucketed"][k]), (case, k)
            assert torch.equal(bucketed[k], stock[k]), (case, k)
            if ref is not None:  # one process over the whole global batch
                tol = 2e-5 if case == "fp16" else 1e-6
                torch.testing.assert_close(bucketed[k], ref[k], rtol=tol, atol=tol)
        if case.startswith("unused"):   # the unused layer still stepped: reduced as zeros
            assert not torch.equal(bucketed["extra.weight"], stock["extra.weight"] * 0)


@pytest.mark.mp
@pytest.mark.timeout(300)  # measured 14 s (2 cores, loaded)
def test_cli_reducers_agree_and_adasum_stays_stock(tmp_path):
    runs = {}
    for reducer in ("bucketed", "stock"):
        metrics = tmp_path / f"{reducer}.json"
        check(launch("hvd-gloo", 2, [*HVDKIT, "train", "--backend", "horovod", "--hvd-reducer", reducer,
                                     "--model", "mlp", "--epochs", "1", "--num-samples", "256",
                                     "--bucket-cap-mb", "0.1", "--metrics-file", str(metrics)]))
        runs[reducer] = json.loads(metrics.read_text())
    assert runs["bucketed"]["topology"]["reducer"] == "bucketed"
    assert runs["stock"]["topology"]["reducer"] == "stock"
    assert runs["bucketed"]["param_digest"] == runs["stock"]["param_digest"]
    assert runs["bucketed"]["final_loss"] == runs["stock"]["final_loss"]


ENGINE_ON_HOROVOD = """
import horovod.torch as hvd, torch
from hvdkit.backends.hvd_reducer import bucketed_optimizer
hvd.init()
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
opt = bucketed_optimizer(hvd, torch.optim.SGD(model.parameters(), lr=0.1), model.named_parameters(),
                         hvd.Compression.none, bucket_cap_mb=40 / 2**20)  # 40 bytes: 3 buckets
engine = opt._engine
assert len(opt.buckets) == 3, opt.buckets
x = torch.randn(4, 8)
model(x).sum().backward()
assert engine.in_flight == 3, engine.in_flight
model(x).sum().backward()              # a second pass nobody announced: the buckets are stale
assert engine.stale == 3
summed = [p.grad.clone() for p in model.parameters()]
opt.synchronize()                      # re-sent with both passes' gradients (one rank: the average is the sum)
assert all(torch.equal(p.grad, s) for p, s in zip(model.parameters(), summed))
with opt.skip_synchronize():
    opt.step()
opt.zero_grad()
model(x).sum().backward()
opt.zero_grad()                        # a skipped step: what is in flight is finished and dropped
assert engine.idle and engine.in_flight == 0
model(x).sum().backward()
opt.step()
print("ok", engine.stats)
"""


@pytest.mark.timeout(120)  # measured 4 s
def test_horovod_reducer_resends_grown_buckets_and_a_skipped_step_leaves_nothing_in_flight():
    """The engine's two departures from the stock optimizer, on Horovod itself (one process)."""
    import subprocess

    from helpers import base_env

    proc = subprocess.run([PY, "-c", ENGINE_ON_HOROVOD], env=base_env(), capture_output=True, text=True, timeout=100)
    assert proc.returncode == 0 and "ok {'buckets': 3, 'steps': 2" in proc.stdout, proc.stdout + proc.stderr
