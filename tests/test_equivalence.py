"""Data-parallel steps equal a single-process step on the concatenated batch, on every backend."""

from __future__ import annotations

import pytest
import torch

from helpers import PY, WORKERS, check, launch
from hvdkit import build_model

CASES = [
    ("horovod", "hvd-gloo"),
    ("horovod", "hvd-mpi"),
    ("ddp", "mpirun"),
    ("ddp", "slurm-sim"),
]


def reference_steps(size: int, accum: int, opt_name: str) -> list[dict[str, torch.Tensor]]:
    """Single process, rank 0's initial weights, the whole global batch per step."""
    model = build_model("tiny", seed=100)
    if opt_name == "sgd":
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=0.01)
    else:
        opt = torch.optim.Adam(model.parameters(), lr=0.01, weight_decay=0.01)
    gen = torch.Generator().manual_seed(7)
    out = []
    for _ in range(2):
        X = torch.randn(size * accum * 4, 8, generator=gen)
        Y = torch.randint(0, 4, (size * accum * 4,), generator=gen)
        torch.nn.functional.cross_entropy(model(X), Y).backward()
        opt.step()
        opt.zero_grad()
        out.append({k: v.clone() for k, v in model.state_dict().items()})
    return out


def run_worker(tmp_path, backend, kind, accum, opt_name="sgd"):
    proc = launch(kind, 2, [PY, str(WORKERS / "step_worker.py"), backend, str(tmp_path), str(accum), opt_name])
    check(proc)
    return [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]


@pytest.mark.mp
@pytest.mark.timeout(240)  # measured 7 s (2 cores, loaded)
@pytest.mark.parametrize("backend,kind", CASES, ids=[f"{b}-{k}" for b, k in CASES])
@pytest.mark.parametrize("accum", [1, 2])
def test_step_matches_single_process(tmp_path, backend, kind, accum):
    ranks = run_worker(tmp_path, backend, kind, accum)
    assert [r["size"] for r in ranks] == [2, 2]
    # ranks started from different weights ...
    first = next(iter(ranks[0]["initial"]))
    assert not torch.equal(ranks[0]["initial"][first], ranks[1]["initial"][first])
    # ... and the broadcast made every rank hold rank 0's
    for r in ranks:
        for k, v in ranks[0]["initial"].items():
            assert torch.equal(r["after_broadcast"][k], v), k
    ref = reference_steps(2, accum, "sgd")
    for step in range(2):
        for k in ref[step]:
            assert torch.equal(ranks[0]["steps"][step][k], ranks[1]["steps"][step][k]), (step, k)
            torch.testing.assert_close(ranks[0]["steps"][step][k], ref[step][k], rtol=1e-5, atol=1e-6)


@pytest.mark.mp
@pytest.mark.timeout(240)  # measured 4 s (2 cores, loaded)
@pytest.mark.parametrize("backend,kind", [("horovod", "hvd-gloo"), ("ddp", "mpirun")])
def test_adam_with_weight_decay_matches(tmp_path, backend, kind):
    """Stateful optimizer: broadcast must not take a hidden step (Horovod's empty-state init does)."""
    ranks = run_worker(tmp_path, backend, kind, 1, "adam")
    ref = reference_steps(2, 1, "adam")
    for k in ref[1]:
        torch.testing.assert_close(ranks[0]["steps"][1][k], ref[1][k], rtol=1e-5, atol=1e-6)
        assert torch.equal(ranks[0]["steps"][1][k], ranks[1]["steps"][1][k])


@pytest.mark.mp
@pytest.mark.timeout(120)  # measured 4 s (2 cores, loaded)
def test_ddp_mpirun_without_master_addr_uses_mpi4py(tmp_path):
    ranks = run_worker(tmp_path, "ddp", "mpirun", 1)
    assert [r["env"] for r in ranks] == ["openmpi", "openmpi"]


@pytest.mark.mp
@pytest.mark.timeout(120)  # measured 3 s (2 cores, loaded)
def test_ddp_under_simulated_slurm(tmp_path):
    ranks = run_worker(tmp_path, "ddp", "slurm-sim", 1)
    assert [r["env"] for r in ranks] == ["slurm", "slurm"]
