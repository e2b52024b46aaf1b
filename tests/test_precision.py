"""Mixed precision on both backends: bf16 and fp16 (with a gradient scaler), on CPU.

Horovod reduces inside ``optimizer.step()``, so fp16 needs its documented order
(synchronize, unscale, step without reducing again); hvdkit's step must equal that
pattern bit for bit, and the wrong order must visibly differ (the test can fail).
"""

from __future__ import annotations

import re

import pytest
import torch

from helpers import HVDKIT, PY, WORKERS, check, launch
from hvdkit import build_model
from hvdkit.checkpoint import read_checkpoint
from hvdkit.precision import autocast


def run_amp(tmp_path, backend, kind, precision, order):
    out = tmp_path / f"{backend}-{precision}-{order}"
    check(launch(kind, 2, [PY, str(WORKERS / "amp_worker.py"), backend, str(out), precision, order]))
    return [torch.load(out / f"rank{r}.pt") for r in range(2)]


def reference(precision: str) -> list[dict[str, torch.Tensor]]:
    """One process, the whole global batch, the same autocast and scaler."""
    model = build_model("tiny", seed=100)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    scaler = torch.amp.GradScaler("cpu", init_scale=256.0) if precision == "fp16" else None
    gen = torch.Generator().manual_seed(7)
    out = []
    for _ in range(2):
        X, Y = torch.randn(8, 8, generator=gen), torch.randint(0, 4, (8,), generator=gen)
        with autocast(precision, torch.device("cpu")):
            loss = torch.nn.functional.cross_entropy(model(X), Y)
        if scaler:
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
        else:
            loss.backward()
            opt.step()
        opt.zero_grad()
        out.append({k: v.clone() for k, v in model.state_dict().items()})
    return out


@pytest.mark.mp
@pytest.mark.timeout(240)
@pytest.mark.parametrize("precision", ["bf16", "fp16"])
@pytest.mark.parametrize("backend,kind", [("horovod", "hvd-gloo"), ("ddp", "mpirun")])
def test_mixed_precision_steps_are_identical_on_ranks_and_close_to_one_process(tmp_path, backend, kind,
                                                                                precision):
    ranks = run_amp(tmp_path, backend, kind, precision, "backend")
    ref = reference(precision)
    for step in range(2):
        for k in ref[step]:
            assert torch.equal(ranks[0]["steps"][step][k], ranks[1]["steps"][step][k]), (step, k)
            # bf16/fp16 matmuls over 4 vs 8 samples round differently: close, not equal
            torch.testing.assert_close(ranks[0]["steps"][step][k], ref[step][k], rtol=2e-2, atol=2e-3)
    if precision == "fp16":
        assert ranks[0]["scale"] == ranks[1]["scale"] == 256.0  # no overflow, no skipped step


@pytest.mark.mp
@pytest.mark.timeout(240)
def test_horovod_fp16_step_is_the_documented_pattern_and_the_wrong_order_differs(tmp_path):
    ours = run_amp(tmp_path, "horovod", "hvd-gloo", "fp16", "backend")
    manual = run_amp(tmp_path, "horovod", "hvd-gloo", "fp16", "manual")
    wrong = run_amp(tmp_path, "horovod", "hvd-gloo", "fp16", "wrong")
    last = ours[0]["steps"][-1]
    for k in last:
        assert torch.equal(last[k], manual[0]["steps"][-1][k]), k
    # unscaling before the reduction: the reduced, still-scaled gradients are applied
    assert any(not torch.allclose(last[k], wrong[0]["steps"][-1][k], rtol=1e-3) for k in last)


@pytest.mark.mp
@pytest.mark.timeout(300)
@pytest.mark.parametrize("backend,kind", [("horovod", "hvd-gloo"), ("ddp", "mpirun")])
def test_fp16_resume_with_scaler_state_is_bitwise_exact(tmp_path, backend, kind):
    args = [*HVDKIT, "train", "--backend", backend, "--model", "tiny", "--epochs", "2", "--steps-per-epoch", "6",
            "--num-samples", "512", "--batch-size", "16", "--precision", "fp16"]
    straight = check(launch(kind, 2, [*args, "--checkpoint-dir", str(tmp_path / "a")]))
    check(launch(kind, 2, [*args, "--checkpoint-dir", str(tmp_path / "b"), "--max-steps", "4"]))
    saved = read_checkpoint(tmp_path / "b" / "ckpt-000000004.h5")
    assert saved["scaler"]["scale"] > 0
    second = check(launch(kind, 2, [*args, "--checkpoint-dir", str(tmp_path / "b")]))
    assert "start step 4" in second
    digest = re.compile(r"digest=(\w+)")
    assert digest.search(straight).group(1) == digest.search(second).group(1)
    a = read_checkpoint(tmp_path / "a" / "ckpt-000000012.h5")
    b = read_checkpoint(tmp_path / "b" / "ckpt-000000012.h5")
    assert a["scaler"] == b["scaler"]
