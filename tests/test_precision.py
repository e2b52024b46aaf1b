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
@pytest.mark.timeout(240)  # measured 4 s (2 cores, loaded)
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
@pytest.mark.timeout(240)  # measured 12 s (2 cores, loaded)
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
@pytest.mark.timeout(300)  # measured 13 s (2 cores, loaded)
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


def test_lowp_support_names_the_missing_cpu_feature_or_the_cap(monkeypatch):
    """Judged without the CPU having or lacking anything: oneDNN's answer and the flags are set."""
    from hvdkit import precision

    monkeypatch.setattr(precision, "_onednn_has", lambda p: False)
    monkeypatch.setattr(precision, "cpu_flags", lambda path="/proc/cpuinfo": {"avx", "avx2", "fma", "avx_vnni"})
    bf16 = precision.lowp_support("bf16")
    assert not bf16.native and "this CPU lacks avx512bw, avx512dq, avx512vl, avx_ne_convert" in bf16.reason
    line = bf16.warning()
    assert line is not None and line.startswith("--precision bf16 is emulated on this CPU")
    assert "6x (AMD EPYC, AVX2)" in line and line.endswith("(hvdkit doctor shows which)")
    assert "HINT: use --precision fp32 here" in line
    assert "avx512_fp16" in precision.lowp_support("fp16").reason
    monkeypatch.setattr(precision, "cpu_flags", lambda path="/proc/cpuinfo": {"avx512bw", "avx512vl", "avx512dq"})
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX2")
    assert "capped below them (ONEDNN_MAX_CPU_ISA=AVX2)" in precision.lowp_support("bf16").reason
    monkeypatch.setattr(precision, "_onednn_has", lambda p: True)
    assert precision.lowp_support("bf16").native and precision.lowp_support("bf16").warning() is None
    assert precision.lowp_support("fp32").warning() is None


def test_cpu_flags_are_read_from_cpuinfo(tmp_path):
    from hvdkit.precision import cpu_flags

    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nmodel name\t: X\nflags\t\t: fpu sse2 avx2 avx512bw\n\nprocessor\t: 1\n")
    assert cpu_flags(str(info)) == {"fpu", "sse2", "avx2", "avx512bw"}
    assert cpu_flags(str(tmp_path / "missing")) == set()


def test_bf16_autocast_trains_the_char_gpt_like_fp32():
    """bf16's correctness, independent of speed (seconds even where oneDNN emulates bf16): a
    2-layer char GPT from the same weights, 6 AdamW steps on one batch: the matmuls ran in
    bf16, the loss falls, and each step's loss is within 3% of fp32's."""
    import sys

    from helpers import ROOT

    sys.path.insert(0, str(ROOT / "examples"))
    from models import gpt

    x = torch.randint(0, 32, (4, 16), generator=torch.Generator().manual_seed(0))
    losses: dict[str, list[float]] = {}
    for precision in ("fp32", "bf16"):
        torch.manual_seed(0)
        model = gpt(vocab_size=32, block_size=16, n_layer=2, n_head=2, n_embd=32)
        opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
        losses[precision] = []
        for _ in range(6):
            with autocast(precision, torch.device("cpu")):
                logits = model(x)
                loss = torch.nn.functional.cross_entropy(logits.float().view(-1, 32), x.view(-1))
            assert logits.dtype == (torch.bfloat16 if precision == "bf16" else torch.float32)
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses[precision].append(float(loss))
    assert losses["bf16"][-1] < losses["bf16"][0] - 0.1, losses
    assert losses["bf16"] != losses["fp32"]  # the bf16 path really ran
    for a, b in zip(losses["bf16"], losses["fp32"]):
        assert a == pytest.approx(b, rel=0.03), losses


@pytest.mark.mp
@pytest.mark.timeout(240)  # measured 14 s on 2 cores (two 2-rank runs of 2 steps)
def test_emulated_lowp_is_said_once_before_training_and_native_is_not(tmp_path):
    """ONEDNN_MAX_CPU_ISA=AVX2 makes any x86 CPU one without bf16 kernels (oneDNN honours the cap),
    so the warning is tested on every machine; the uncapped run warns only where the CPU lacks them."""
    import subprocess

    from helpers import base_env
    from hvdkit.precision import lowp_support

    args = [*HVDKIT, "run", "-np", "2", "--backend", "ddp", "--", "--model", "tiny", "--epochs", "1",
            "--steps-per-epoch", "2", "--num-samples", "64", "--precision", "bf16"]
    said = {}
    for name, env in (("capped", base_env(ONEDNN_MAX_CPU_ISA="AVX2")), ("plain", base_env())):
        proc = subprocess.run(args, env=env, capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0, proc.stderr[-2000:]
        said[name] = [line for line in (proc.stdout + proc.stderr).splitlines() if "is emulated" in line]
    assert len(said["capped"]) == 1, said  # rank 0 only, once
    line = said["capped"][0]
    assert line.startswith("[hvdkit] WARNING: --precision bf16 is emulated on this CPU: oneDNN's bf16 kernels need")
    assert "slower than fp32" in line and "HINT: use --precision fp32 here" in line
    assert len(said["plain"]) == (0 if lowp_support("bf16").native else 1), said
