"""hvdkit bench with tiny sizes: every experiment runs and writes well-formed, positive figures."""

from __future__ import annotations

import json
import math
import socket
import subprocess

import pytest

from helpers import HVDKIT, base_env
from hvdkit.bench.costmodel import allreduce_time, fit_alpha_beta, predict_scaling
from hvdkit.bench.stats import ratio_ci, summarize


def numbers(obj):
    if isinstance(obj, bool) or obj is None:
        return
    if isinstance(obj, (int, float)):
        yield obj
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from numbers(v)
    elif isinstance(obj, list):
        for v in obj:
            yield from numbers(v)


def flat_items(obj, key=None):
    """(innermost key, number) for every number in a nested summary."""
    if isinstance(obj, bool) or obj is None:
        return
    if isinstance(obj, (int, float)):
        yield key, obj
    elif isinstance(obj, dict):
        for k, v in obj.items():
            yield from flat_items(v, k)
    elif isinstance(obj, list):
        for v in obj:
            yield from flat_items(v, key)


def test_summarize_and_cost_model():
    s = summarize([1.0, 2.0, 3.0, 4.0])
    assert s["median"] == 2.5 and s["min"] == 1 and s["max"] == 4 and s["n"] == 4
    # a ring of 2 with alpha=1 ms, B=1 GB/s: t = 2 ms + S/1e9 exactly
    sizes = [1 << 10, 1 << 20, 1 << 26]
    alpha, bw = fit_alpha_beta(sizes, [2e-3 + s / 1e9 for s in sizes], 2)
    assert math.isclose(alpha, 1e-3, rel_tol=1e-6) and math.isclose(bw, 1e9, rel_tol=1e-6)
    assert allreduce_time(1, 1e9, 1, 1) == 0.0
    rows = predict_scaling(0.01, 4 << 20, 200, 1e-5, 1e10, [8, 64])
    assert rows[0]["efficiency_unfused"] < rows[0]["efficiency_fused"] <= 1.0
    assert rows[1]["step_fused_s"] > rows[0]["step_fused_s"]


def test_ratio_ci_resamples_rounds_not_steps():
    # 4 rounds; A is 2x B within every round, but rounds differ a lot (machine drift)
    b = [[1.0, 1.01, 0.99], [2.0, 2.02, 1.98], [1.5, 1.5, 1.5], [3.0, 3.1, 2.9]]
    a = [[2 * t for t in blk] for blk in b]
    point, lo, hi = ratio_ci(a, b)
    assert point == pytest.approx(2.0, rel=0.02) and lo <= point <= hi
    assert ratio_ci(a, b) == ratio_ci(a, b)            # seeded: the same figures twice
    # a round-to-round difference shows up as width: B's rounds alone jump around
    shuffled = [b[1], b[0], b[3], b[2]]
    _, lo2, hi2 = ratio_ci(shuffled, b)
    assert hi2 - lo2 > 0.5
    with pytest.raises(ValueError):
        ratio_ci(a, b[:2])


@pytest.mark.mp
@pytest.mark.timeout(1000)  # measured 94 s alone, 156 s beside the other xdist worker (2 AVX2 cores)
def test_quick_bench_tiny(tmp_path):
    out = tmp_path / "bench"
    proc = subprocess.run([*HVDKIT, "bench", "--quick", "--out", str(out), "--models", "mlp",
                           "--steps", "3", "--rounds", "1", "--sizes", "4096,65536", "--world-sizes", "1,2",
                           "--fusion-mb", "0,128", "--bucket-mb", "25", "--cycle-ms", "1,5",
                           "--ckpt-params-m", "1", "--overhead-epochs", "2",
                           "--only", "reducer,ab,fusion,scaling,allreduce,ckpt,overhead,model"],
                          env=base_env(), capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    data = json.loads((out / "bench.json").read_text())
    assert set(data) == {"env", "config", "results", "summary", "targets"}
    assert data["env"]["torch"].startswith("2.13") and data["env"]["world_size"] == 2
    for exp in ("reducer", "ab", "fusion", "scaling", "allreduce", "ckpt", "overhead", "model"):
        assert exp in data["summary"], exp
        assert exp in data["results"] or exp == "model"
    red = data["summary"]["reducer"][0]
    variants = ("bucketed", "bucketed-cycle5", "stock", "ddp")
    assert red["model"] == "mlp" and red["floor_s"] > 0 and red["best"] in variants
    for v in variants:
        assert red[v]["n"] == 3 and red[v]["p25_s"] <= red[v]["median_s"] <= red[v]["p75_s"]
        assert red[v]["cpu_s_per_step"] > 0
    lo, hi = red["bucketed_over_ddp"]["ci95"]
    assert lo <= red["bucketed_over_ddp"]["ratio"] <= hi
    assert {b["variant"] for b in data["results"]["reducer"]["blocks"]} == set(variants)
    assert data["results"]["reducer"]["hosts"] == [socket.gethostname()] * 2   # no --hosts: both here
    ab = data["summary"]["ab"][0]
    assert ab["model"] == "mlp" and ab["horovod_samples_s"]["median"] > 0 and ab["ddp_samples_s"]["median"] > 0
    assert {r["setting"] for r in data["summary"]["fusion"]["rows"]} >= {
        "horovod fusion=0MB", "horovod fusion=128MB", "ddp bucket=25MB", "horovod fusion=128MB cycle=5ms"}
    assert {(r["np"], r["backend"]) for r in data["summary"]["scaling"]["rows"]} == {
        (1, "horovod"), (1, "ddp"), (2, "horovod"), (2, "ddp")}
    sizes = [r["bytes"] for r in data["summary"]["allreduce"]["rows"]]
    assert sizes == [4096, 65536]
    assert len(data["results"]["ckpt"]["seconds"]["hdf5_save"]) == 2
    assert len(data["targets"]) >= 5 and all("met" in t for t in data["targets"])
    for exp, summary in data["summary"].items():
        for x in numbers(summary):
            assert math.isfinite(x), (exp, x)
    # signed by nature: the overhead, and comm shares (1 - compute/step, two noisy medians)
    signed = ("overhead_pct", "comm_share", "horovod_comm_share", "ddp_comm_share", "comm_s")
    for exp, summary in data["summary"].items():
        for key, x in flat_items(summary):
            if exp != "overhead" and key not in signed:
                assert x >= 0, (exp, key, x)
    for name in ("ab", "fusion", "scaling", "allreduce", "model"):
        png = out / f"{name}.png"
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", name
    assert "Horovod vs DDP" in (out / "summary.md").read_text()
    assert "Gradient reducers" in (out / "summary.md").read_text()
