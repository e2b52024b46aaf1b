"""--compression powersgd on both backends: torch's powerSGD_hook semantics on real ranks, its
state checkpointed per parameter (exact resume, across backends and re-formed buckets), and
the refusals that keep it correct. Bad spellings: tests/test_bad_inputs.py."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
import torch

from helpers import HVDKIT, PY, ROOT, base_env, check, launch, read_metrics
from hvdkit.backends.powersgd import PowerSGD
from hvdkit.config import BackendConfig, CompressionSpec, HorovodOptions, TrainConfig, parse_compression
from hvdkit.errors import ConfigError

WORKER = ROOT / "tests" / "workers" / "powersgd_worker.py"
TRAIN = ["--model", "mlp", "--num-samples", "768", "--batch-size", "16", "--optimizer", "adamw", "--lr", "0.002",
         "--log-every", "0", "--epochs", "2", "--compression", "powersgd:rank=2,start=3"]


def test_the_compression_spec_parses_with_defaults_and_prints_back():
    assert parse_compression("none") == CompressionSpec("none")
    assert parse_compression("powersgd") == CompressionSpec("powersgd", 2, 10)
    spec = parse_compression("powersgd:start=50,rank=4")
    assert (spec.rank, spec.start) == (4, 50) and parse_compression(str(spec)) == spec
    for bad, said in (("powersgd:rank=0", "rank must be >= 1"), ("powersgd:rank", "'rank' is not an option"),
                      ("fp16:rank=1", "takes no options"), ("topk", "'topk' is not known")):
        with pytest.raises(ConfigError, match=said):
            parse_compression(bad)


def test_powersgd_refuses_what_would_silently_corrupt_its_error_feedback():
    psgd = BackendConfig(name="horovod", horovod=HorovodOptions(compression="powersgd"))
    for kwargs, said in (({"elastic": True}, "--elastic"), ({"precision": "fp16"}, "--precision fp16"),
                         ({"uneven": True}, "--uneven")):
        with pytest.raises(ConfigError, match=f"--compression powersgd cannot be combined with {said}"):
            TrainConfig(backend=psgd, **kwargs)
    with pytest.raises(ConfigError, match="cannot be combined with --hvd-op sum"):
        BackendConfig(name="horovod", horovod=HorovodOptions(compression="powersgd", op="sum"))
    assert TrainConfig(backend=psgd, precision="bf16").backend.compression.kind == "powersgd"


def test_the_state_follows_parameters_when_buckets_are_re_formed():
    """DDP re-forms its buckets in each process's first step, so a resumed run meets new
    buckets: the error feedback and Q must move with their parameters, not stay by bucket."""
    a, b, c = (torch.nn.Parameter(torch.zeros(s)) for s in ((16, 12), (12,), (16, 16)))
    psgd = PowerSGD(CompressionSpec("powersgd", 2, 2), {id(a): "a", id(b): "b", id(c): "c"})
    psgd.see_bucket(0, [a, b])
    psgd.see_bucket(1, [c])
    st = psgd.state
    st.error_dict[0] = torch.arange(16 * 12 + 12, dtype=torch.float32)
    st.error_dict[1] = -torch.arange(256, dtype=torch.float32)
    st.q_memory_dict[0], st.q_memory_dict[1] = torch.full((24,), 1.0), torch.full((32,), 2.0)
    st.p_memory_dict[0], st.p_memory_dict[1] = torch.empty(32), torch.empty(32)
    saved = psgd.state_dict()
    assert torch.equal(saved["error"]["b"], torch.arange(192, 204, dtype=torch.float32))
    assert saved["q"]["a"].shape == (12, 2) and set(saved["q"]) == {"a", "c"}  # b is a vector: sent whole
    psgd.see_bucket(0, [c, b, a])  # one bucket now, in another order
    assert torch.equal(st.error_dict[0], torch.cat([saved["error"][n].reshape(-1) for n in "cba"]))
    assert 1 not in st.error_dict and torch.equal(st.q_memory_dict[0][:32], torch.full((32,), 2.0))
    again = psgd.state_dict()
    assert all(torch.equal(again["error"][n], saved["error"][n]) for n in "abc")
    assert all(torch.equal(again["q"][n], saved["q"][n]) for n in "ac")


@pytest.mark.mp
@pytest.mark.timeout(300)  # measured 13 s (2 cores, loaded)
def test_horovods_powersgd_gives_torchs_powersgd_hook_update_on_two_ranks(tmp_path):
    """Eight SGD steps (3 plain, 5 compressed) of a 4-layer net, 2 ranks with their own data:
    torch's DDP + powerSGD_hook (the reference), hvdkit's DDP backend, and hvdkit's Horovod
    PowerSGD must give the same parameters after every step (within 1e-5; measured: equal bits)
    and the same per-rank error feedback."""
    for mode, kind in (("torch", "mpirun"), ("ddp", "mpirun"), ("horovod", "hvd-gloo")):
        check(launch(kind, 2, [PY, str(WORKER), mode, str(tmp_path)], timeout=240))
    runs = {m: [torch.load(tmp_path / f"{m}-rank{r}.pt") for r in (0, 1)] for m in ("torch", "ddp", "horovod")}
    ref = runs["torch"]
    assert ref[0]["iter"] == 8 and 0 < ref[0]["sent"] < ref[0]["before"] / 3  # it compressed
    assert any(e.abs().max() > 0 for e in ref[0]["errors"].values())
    assert not torch.equal(ref[0]["errors"][0], ref[1]["errors"][0])  # each rank its own error
    for mode in ("ddp", "horovod"):
        for rank in (0, 1):
            got, want = runs[mode][rank], ref[rank]
            assert (got["iter"], got["before"], got["sent"]) == (want["iter"], want["before"], want["sent"])
            for step, (ps, qs) in enumerate(zip(got["after"], want["after"])):
                for p, q in zip(ps, qs):
                    torch.testing.assert_close(p, q, rtol=0, atol=1e-5, msg=f"{mode} rank {rank} step {step}")
            for bucket, err in want["errors"].items():
                torch.testing.assert_close(got["errors"][bucket], err, rtol=0, atol=1e-5)


def _run(tmp_path: Path, name: str, backend: str, *extra: str) -> dict:
    metrics = tmp_path / f"{name}.json"
    proc = subprocess.run([*HVDKIT, "run", "-np", "2", "--backend", backend, "--log-dir", str(tmp_path), "--",
                           *TRAIN, "--metrics-file", str(metrics), *extra],
                          env=base_env(), capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return read_metrics(metrics)


@pytest.mark.mp
@pytest.mark.timeout(600)  # measured 45 s (2 cores, loaded)
def test_a_powersgd_run_stopped_and_resumed_on_the_other_backend_ends_on_the_straight_runs_bits(tmp_path):
    """Stopped at step 10 (7 compressed steps in) and resumed on the other backend: each rank's
    error feedback and the warm-started Q come back from the checkpoint, stored per parameter,
    so the other backend's buckets take them (and DDP's, re-formed in its first step, too).
    The two straight runs differ: their first buckets differ, so do their first random Q."""
    straight = {b: _run(tmp_path, f"straight-{b}", b) for b in ("horovod", "ddp")}
    for backend, m in straight.items():
        assert m["compression"]["kind"] == "powersgd" and m["compression"]["steps"] == 48, backend
        assert 0 < m["compression"]["sent_fraction"] < 0.2, backend  # rank 2 of mlp's matrices
    for first, then in (("horovod", "ddp"), ("ddp", "horovod")):
        ck = str(tmp_path / f"ck-{first}")
        _run(tmp_path, f"first-{first}", first, "--checkpoint-dir", ck, "--max-steps", "10")
        resumed = _run(tmp_path, f"resumed-{then}", then, "--checkpoint-dir", ck)
        assert resumed["start_step"] == 10 and resumed["global_step"] == 48
        assert resumed["param_digest"] == straight[first]["param_digest"], (first, then)
