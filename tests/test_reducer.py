"""The bucketed Horovod reducer: its plan, and exactly the stock optimizer's arithmetic."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

from helpers import HVDKIT, PY, WORKERS, check, launch
from hvdkit.backends.buckets import FIRST_BUCKET_BYTES, plan_buckets

MiB = 1024 * 1024


def test_bucket_plan_is_what_the_docstring_says():
    # registration order: a (1 MiB), frozen (skipped), b (0.5 MiB), c (3 MiB), d (0.25 MiB, fp16)
    params = [
        ("a", nn.Parameter(torch.zeros(MiB // 4))),
        ("frozen", nn.Parameter(torch.zeros(10), requires_grad=False)),
        ("b", nn.Parameter(torch.zeros(MiB // 8))),
        ("c", nn.Parameter(torch.zeros(3 * MiB // 4))),
        ("d", nn.Parameter(torch.zeros(MiB // 8, dtype=torch.float16))),
    ]
    plan = plan_buckets(params, cap_bytes=4 * MiB)
    # reverse registration order; a dtype change closes a bucket (d is fp16); c (3 MiB) and
    # a (1 MiB) are >= 1 MiB, so each goes alone even though the 4 MiB cap would hold more;
    # frozen is absent
    assert [b.names for b in plan] == [("d",), ("c",), ("b",), ("a",)]
    assert [b.dtype for b in plan] == [torch.float16] + [torch.float32] * 3
    assert [b.nbytes for b in plan] == [MiB // 4, 3 * MiB, MiB // 2, MiB]
    assert [b.index for b in plan] == [0, 1, 2, 3]
    assert FIRST_BUCKET_BYTES == MiB
    small = [(f"s{i}", nn.Parameter(torch.zeros(1000))) for i in range(3)]     # 4 KB each
    mixed = plan_buckets([small[0], ("big", nn.Parameter(torch.zeros(MiB))), *small[1:]], 4 * MiB)
    assert [b.names for b in mixed] == [("s2", "s1"), ("big",), ("s0",)]
    assert mixed[0].offsets == (0, 1000) and mixed[0].numel == 2000


def test_bucket_plan_caps_and_first_bucket():
    params = [(f"p{i}", nn.Parameter(torch.zeros(MiB // 16))) for i in range(40)]  # 40 x 256 KiB
    plan = plan_buckets(params, cap_bytes=2 * MiB)
    assert [len(b.names) for b in plan] == [4] + [8] * 4 + [4]   # 1 MiB first, then 2 MiB each
    assert plan[0].names == ("p39", "p38", "p37", "p36")
    assert sum(len(b.names) for b in plan) == 40
    with pytest.raises(ValueError):
        plan_buckets(params, cap_bytes=0)


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
