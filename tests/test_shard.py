"""--shard optimizer|full on real ranks: the same training as unsharded (bitwise where the
reduction order allows), 1/N of the state per rank by measurement, and checkpoints that cross
sharding modes, backends and world sizes."""

from __future__ import annotations

import copy
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from helpers import HVDKIT, ROOT, base_env, check, launch, read_metrics, render, sbatch, wait_done
from hvdkit.backends.buckets import plan_buckets
from hvdkit.backends.zero import assign_owners
from hvdkit.checkpoint import read_checkpoint

USER = ROOT / "tests" / "userland" / "userland.py"
TRAIN = ["--model", "mlp", "--num-samples", "768", "--batch-size", "16", "--optimizer", "adamw",
         "--lr", "0.002", "--log-every", "0"]


def _run(tmp_path, name: str, backend: str, np: int, shard: str, *extra: str) -> dict:
    """``hvdkit run`` exactly as users type it; the metrics rank 0 wrote."""
    metrics = tmp_path / f"{name}.json"
    proc = subprocess.run([*HVDKIT, "run", "-np", str(np), "--backend", backend, "--log-dir", str(tmp_path),
                           "--", *TRAIN, "--shard", shard, "--metrics-file", str(metrics), *extra],
                          env=base_env(), capture_output=True, text=True, timeout=200)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return read_metrics(metrics)


def _modes(backend: str) -> list[str]:
    """Both backends shard both ways: full is FSDP2 on DDP, hvdkit's ZeRO-3 on Horovod."""
    return ["optimizer", "full"]


@pytest.mark.mp
@pytest.mark.timeout(400)  # measured 23 s (2 cores, loaded)
@pytest.mark.parametrize("backend", ["ddp", "horovod"])
def test_two_ranks_sharded_equal_unsharded_bit_for_bit_and_hold_their_share(tmp_path, backend):
    """2 ranks: the sum of two gradients is the same whichever collective adds them, and AdamW
    is elementwise, so every mode must end on the same bits. Memory by measurement."""
    ref = _run(tmp_path, "none", backend, 2, "none", "--epochs", "2")
    whole = ref["memory"][0]
    for shard in _modes(backend):
        got = _run(tmp_path, shard, backend, 2, shard, "--epochs", "2")
        assert got["param_digest"] == ref["param_digest"] and got["final_loss"] == ref["final_loss"], shard
        assert got["params_identical"] is True
        mem = got["memory"]
        # nothing duplicated, nothing lost: the ranks' optimizer state adds up to one replica's
        assert sum(m["optimizer_state"] for m in mem) == pytest.approx(whole["optimizer_state"], rel=0.01)
        assert all(m["optimizer_state"] < whole["optimizer_state"] for m in mem)
        if shard == "full":  # parameters and gradients halved too (FSDP pads a dim to even)
            for key in ("params", "grads", "optimizer_state"):
                assert all(m[key] == pytest.approx(whole[key] / 2, rel=0.02) for m in mem), (key, mem)
        else:
            assert all(m["params"] == whole["params"] for m in mem)  # ZeRO-1/2: weights replicated


@pytest.mark.mp
@pytest.mark.timeout(400)  # measured 37 s (2 cores, loaded)
@pytest.mark.parametrize("backend", ["ddp", "horovod"])
def test_three_ranks_with_clipping_and_accumulation_match_unsharded(tmp_path, backend):
    """3 ranks add in another order, and the sharded clip takes the norm from per-rank sums:
    with bf16 autocast over it, equal within 0.1% (measured 1e-4), not bit for bit. Small
    buckets at 3 ranks: some are replicated (allreduce and broadcasts), and all start in backward."""
    extra = ["--epochs", "1", "--clip-grad-norm", "0.5", "--accumulation-steps", "2", "--precision", "bf16"]
    ref = _run(tmp_path, "none", backend, 3, "none", *extra)
    for shard, more in [*[(m, []) for m in _modes(backend)], ("optimizer", ["--bucket-cap-mb", "0.01"])]:
        got = _run(tmp_path, shard + "".join(more), backend, 3, shard, *extra, *more)
        assert got["final_loss"] == pytest.approx(ref["final_loss"], rel=1e-3), (shard, more)
        assert got["params_identical"] is True
        if more:
            plan = got["shard_overlap"]
            assert plan["buckets"] > 10 and 0 < plan["replicated"] < plan["buckets"], plan
            assert plan["steps"] == got["global_step"] and plan["steps_overlapped"] == plan["steps"], plan
            # one parameter a bucket: rank 0 keeps only the gradients of those it owns, not the
            # other owners' parts of an allreduced bucket or a segment of padding
            assert plan["kept_bytes"] == plan["owned_bytes"] > 0, plan


@pytest.mark.mp
@pytest.mark.timeout(300)  # measured 20 s (2 cores, loaded)
@pytest.mark.parametrize("backend", ["ddp", "horovod"])
def test_gradient_buckets_travel_during_backward(tmp_path, backend):
    """ZeRO's reduce-scatter overlaps backward by default: the mlp (3.2 MB) goes in 1 MiB
    buckets, and every step starts buckets before its last gradient exists, with the weights
    still bit for bit those of the unsharded run, with accumulation. A model in one bucket
    (``tiny``) can start nothing before its last gradient, and the count says so."""
    extra = ["--epochs", "1", "--accumulation-steps", "2"]
    ref = _run(tmp_path, "none", backend, 2, "none", *extra)
    got = _run(tmp_path, "default", backend, 2, "optimizer", *extra)
    assert got["param_digest"] == ref["param_digest"] and got["final_loss"] == ref["final_loss"]
    plan, steps = got["shard_overlap"], ref["global_step"]
    assert plan["buckets"] >= 3 and plan["replicated"] == 0, plan
    assert plan["steps"] == plan["steps_overlapped"] == steps, plan
    assert plan["buckets_started_in_backward"] == steps * plan["buckets"], plan
    assert plan["kept_bytes"] == plan["owned_bytes"] > 0, plan  # not the padding of its segments
    one = _run(tmp_path, "one", backend, 2, "optimizer", *extra, "--model", "tiny")
    assert one["shard_overlap"]["buckets"] == 1 and one["shard_overlap"]["steps_overlapped"] == 0


@pytest.mark.mp
@pytest.mark.timeout(1000)  # measured 109 s alone, 177 s beside the other xdist worker (2 AVX2 cores)
def test_checkpoints_cross_sharding_modes_backends_and_world_sizes(tmp_path):
    """Saved sharded (FSDP2, 2 ranks), the file holds what the unsharded run's holds, in
    torch.optim's layout; resumed on Horovod's ZeRO (1/2 and 3) or FSDP2 at 3 ranks it continues
    like an unsharded 3-rank resume of the same file."""
    a, b = tmp_path / "full", tmp_path / "none"
    _run(tmp_path, "save-full", "ddp", 2, "full", "--epochs", "1", "--checkpoint-dir", str(a))
    _run(tmp_path, "save-none", "ddp", 2, "none", "--epochs", "1", "--checkpoint-dir", str(b))
    fa, fb = read_checkpoint(max(a.glob("ckpt-*.h5"))), read_checkpoint(max(b.glob("ckpt-*.h5")))
    assert set(fa["model"]) == set(fb["model"])
    for name in fb["model"]:
        assert torch.equal(fa["model"][name], fb["model"][name]), name
    sa, sb = fa["optimizer"]["state"], fb["optimizer"]["state"]
    assert sorted(map(int, sa)) == sorted(map(int, sb)) == list(range(len(fb["model"])))
    for i in sb:
        for key in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(sa[i][key], sb[i][key]), (i, key)
    c, d = tmp_path / "none-copy", tmp_path / "full-copy"
    shutil.copytree(b, c)
    shutil.copytree(a, d)
    zero = _run(tmp_path, "resume-zero", "horovod", 3, "optimizer", "--epochs", "2", "--checkpoint-dir", str(a))
    plain = _run(tmp_path, "resume-none", "ddp", 3, "none", "--epochs", "2", "--checkpoint-dir", str(c))
    assert zero["final_loss"] == pytest.approx(plain["final_loss"], rel=1e-5)
    assert zero["global_step"] == plain["global_step"] and zero["params_identical"] is True
    # resumed into FSDP2 at 3 ranks: each rank is sent its own rows, the last parts shorter
    e = tmp_path / "full-copy-2"
    shutil.copytree(d, e)
    full = _run(tmp_path, "resume-full", "ddp", 3, "full", "--epochs", "2", "--checkpoint-dir", str(d))
    assert full["final_loss"] == pytest.approx(plain["final_loss"], rel=1e-5)
    assert full["global_step"] == plain["global_step"]
    # and into Horovod's ZeRO-3 at 3 ranks: the same rows, over Horovod's broadcasts
    zero3 = _run(tmp_path, "resume-zero3", "horovod", 3, "full", "--epochs", "2", "--checkpoint-dir", str(e))
    assert zero3["final_loss"] == pytest.approx(plain["final_loss"], rel=1e-5)
    assert zero3["global_step"] == plain["global_step"]


def test_optimizer_state_is_balanced_on_a_real_model():
    """Whole parameters are owned by one rank each, balanced bucket by bucket; on the example
    GPT (4.8M parameters, 6 layers) every rank holds within 2% of 1/N in one 25 MiB bucket
    and within 5% in 4 MiB ones, at 2, 3 and 4 ranks; a bucket is replicated only where a
    reduce-scatter would send more than twice its size."""
    sys.path.insert(0, str(ROOT / "examples"))
    try:
        from models import gpt
    finally:
        sys.path.pop(0)
    sizes = [p.numel() for p in gpt(vocab_size=96, block_size=128, n_layer=6, n_head=8, n_embd=256).parameters()]
    for cap_mb, within in ((25, 1.02), (4, 1.05)):
        for world in (2, 3, 4):
            buckets, owner = assign_owners(plan_buckets([4 * n for n in sizes], [None] * len(sizes), cap_mb * 2**20),
                                           sizes, world)
            assert sorted(i for b in buckets for i in b.params) == list(range(len(sizes)))
            loads = [sum(n for n, o in zip(sizes, owner) if o == r) for r in range(world)]
            assert max(loads) <= sum(sizes) / world * within, (cap_mb, world, loads)
            for b in buckets:
                size = sum(sizes[i] for i in b.params)
                assert b.scatter == (world * b.width <= 2 * size) and b.width == max(
                    sum(sizes[i] for i in seg) for seg in b.segments)


@pytest.mark.parametrize("args, says", [
    # no word about Horovod for the local backend (the message was Horovod's for every backend)
    (["--backend", "local", "--shard", "full"], "--backend local: it shards the parameters over ranks, which "
                                                 "only --backend horovod, --backend ddp run"),
    (["--backend", "ddp", "--shard", "optimizer", "--precision", "fp16"], "cannot be combined with --precision fp16"),
    (["--backend", "horovod", "--shard", "optimizer", "--hvd-op", "adasum"], "cannot be combined with --hvd-op adasum"),
    (["--backend", "ddp", "--shard", "full", "--uneven"], "cannot be combined with --uneven"),
])
def test_combinations_that_cannot_work_are_refused_in_one_line(args, says):
    proc = subprocess.run([*HVDKIT, "train", *args, "--model", "tiny"], env=base_env(),
                          capture_output=True, text=True, timeout=60)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1 and says in lines[0] and "HINT" in lines[0], proc.stderr


CGROUP = Path("/sys/fs/cgroup/memory")


def _budget_job(tmp_path, name: str, shard: str, budget: int,
                backend: str = "ddp") -> tuple[str, str, list[dict[str, int]]]:
    """4 ranks on the 2-node cluster, each in a memory cgroup of ``budget`` bytes, training the
    42M-parameter wide MLP with AdamW (16 bytes a parameter unsharded: 672 MB of state).
    Returns the job's state, its log and each rank's cgroup figures; removes the cgroups."""
    script = render(tmp_path, name, "--backend", backend, "-N", "2", "--tasks-per-node", "2", "--no-requeue",
                    "--env", "MALLOC_MMAP_THRESHOLD_=131072",  # freed tensors go back to the kernel
                    "--", str(ROOT / "tests" / "workers" / "memory_budget.sh"), str(budget),
                    "python", "-m", "hvdkit", "train", "--backend", backend, "--model", f"{USER}:wide_mlp",
                    "--dataset", f"{USER}:vectors", "--epochs", "1", "--batch-size", "4", "--optimizer", "adamw",
                    "--lr", "1e-4", "--shard", shard, "--metrics-file", str(tmp_path / f"{name}.json"))
    job = sbatch(script, tmp_path)
    state = wait_done(job, timeout=300)
    figures = []
    for cg in sorted(CGROUP.glob(f"hvdkit-budget-{job}-*")):
        oom = dict(line.split() for line in (cg / "memory.oom_control").read_text().splitlines())
        figures.append({"max_usage": int((cg / "memory.max_usage_in_bytes").read_text()),
                        "oom_kill": int(oom.get("oom_kill", 0))})
        cg.rmdir()  # empty once its rank has exited
    return state, (tmp_path / f"{name}-{job}.out").read_text(), figures


@pytest.mark.multinode
@pytest.mark.timeout(900)  # measured 103 s alone with both backends (2 cores)
@pytest.mark.skipif(not os.access(CGROUP, os.W_OK), reason="no writable cgroup-v1 memory controller here")
def test_a_model_over_one_ranks_memory_budget_trains_when_fully_sharded_over_four_ranks(tmp_path):
    """Each rank may use 800 MB. Unsharded, the model's state alone (672 MB) on top of torch's
    runtime does not fit: the memory preflight refuses it before step 1, in one line that names
    --shard full (before the preflight, the kernel's OOM killer ended this job). Over 4 ranks on
    2 nodes a rank holds a quarter of it and trains: FSDP2 on DDP, and ZeRO-3 on Horovod's
    collectives, whose gathers and reduce-scatters then cross the nodes' link."""
    budget = 800 * 2**20
    state, log, figures = _budget_job(tmp_path, "whole", "none", budget)
    assert state == "FAILED", (state, log[-2000:])
    said = [line for line in log.splitlines() if "a rank needs ~" in line]
    assert len(said) == 1 and "under --shard none" in said[0] and "HINT: use --shard" in said[0], log[-2000:]
    assert all(f["oom_kill"] == 0 for f in figures), (figures, log[-2000:])  # refused, not killed
    peaks = {}
    for backend in ("ddp", "horovod"):
        name = f"sharded-{backend}"
        state, log, figures = _budget_job(tmp_path, name, "full", budget, backend)
        assert state == "COMPLETED", (backend, state, log[-3000:])
        assert len(figures) == 4 and all(f["oom_kill"] == 0 and f["max_usage"] < budget for f in figures), figures
        metrics = read_metrics(tmp_path / f"{name}.json")
        assert metrics["world_size"] == 4 and len({r["host"] for r in metrics["placement"]}) == 2, metrics["placement"]
        assert all(m["params"] * 4 == pytest.approx(168 * 10**6, rel=0.01) for m in metrics["memory"]), metrics
        peaks[backend] = [f["max_usage"] >> 20 for f in figures]
    print(f"per-rank cgroup peak, sharded over 4 on 2 nodes: {peaks} MiB (budget {budget >> 20} MiB)")


def test_buckets_are_resent_when_a_gradient_grows_after_they_started_and_forgotten_on_zero_grad():
    """One process, the local backend's collectives. A loop that runs two backward passes without
    saying so (backward_passes=1) starts every bucket on the first: the second makes them stale,
    and the step must reduce the summed gradients, not the first pass's: the first pass's were
    freed when their buckets started (ZeRO-2), so the second pass's result is added to the
    first's. ``zero_grad`` without a step (a skipped step) leaves no bucket behind for the next one."""
    from hvdkit.backends.local import LocalBackend
    from hvdkit.backends.zero import ShardedOptimizer
    from hvdkit.config import BackendConfig

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 8), torch.nn.ReLU(),
                                torch.nn.Linear(8, 1))
    ref = [p.detach().clone() for p in model.parameters()]
    plain = copy.deepcopy(model)  # the two passes accumulated, for the expected gradients
    opt = ShardedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), LocalBackend(BackendConfig(name="local")),
                           bucket_cap_mb=300 / 2**20)  # 300 bytes: weights of 256 bytes split them
    assert len(opt.buckets) == 3 and sorted(i for b in opt.buckets for i in b.params) == list(range(6))
    x = torch.randn(4, 8)
    model(x).sum().backward()
    assert opt.engine.in_flight == 3 and opt.overlap["buckets_started_in_backward"] == 3
    assert all(p.grad is None for p in model.parameters())  # ZeRO-2: freed as each bucket started
    model(x).sum().backward()
    assert opt.engine.stale == 3
    for _ in range(2):
        plain(x).sum().backward()
    expected = [p.grad for p in plain.parameters()]  # both passes, as accumulated
    opt.reduce_gradients()
    assert all(torch.equal(p.grad, e) for p, e in zip(model.parameters(), expected))
    opt.zero_grad()
    model(x).sum().backward()
    opt.zero_grad()  # a skipped step
    assert opt.engine.idle and opt.engine.stale == 0
    model(x).sum().backward()
    opt.step()
    assert opt.overlap["steps"] == 2 and not any(torch.equal(p, r) for p, r in zip(model.parameters(), ref))


@pytest.mark.mp
@pytest.mark.timeout(300)  # measured 31 s (2 cores, loaded)
def test_fsdp_run_stopped_and_resumed_equals_the_straight_run(tmp_path):
    """FSDP2 resuming its own checkpoint: the data check's forward leaves the root unit's
    parameters gathered, and the optimizer's sharded parameters were then not found in the
    model (the resume failed with a KeyError). Stopped at step 5 and resumed, it ends on the
    straight run's bits."""
    straight = _run(tmp_path, "straight", "ddp", 2, "full", "--epochs", "2")
    ck = str(tmp_path / "ck")
    _run(tmp_path, "first", "ddp", 2, "full", "--epochs", "2", "--checkpoint-dir", ck, "--max-steps", "5")
    resumed = _run(tmp_path, "resumed", "ddp", 2, "full", "--epochs", "2", "--checkpoint-dir", ck)
    assert resumed["start_step"] == 5 and resumed["global_step"] == straight["global_step"]
    assert resumed["param_digest"] == straight["param_digest"] and resumed["final_loss"] == straight["final_loss"]


@pytest.mark.mp
@pytest.mark.timeout(300)  # measured 5 s per case (2 cores)
@pytest.mark.parametrize("backend,shard", [("ddp", "none"), ("ddp", "optimizer"), ("horovod", "none"),
                                           ("horovod", "optimizer")])
def test_every_strategy_takes_the_state_of_the_root_it_is_given(tmp_path, backend, shard):
    """broadcast_state(root=1) after wrap: every rank continues exactly as rank 1 would have
    alone, with rank 1's weights and Adam moments. Before, DDP's wrap sent rank 0's weights
    (so rank 1 had none of its own left) and Horovod's and ZeRO's wraps dropped the
    optimizer's state (a restore done before the wrap was lost on those backends only)."""
    check(launch("mpirun", 2, [sys.executable, str(ROOT / "tests/workers/root_worker.py"), backend, shard,
                               str(tmp_path)], timeout=240))
    expected = torch.load(tmp_path / "rank1.pt")["own"]
    for rank in (0, 1):
        got = torch.load(tmp_path / f"rank{rank}.pt")["got"]
        for stage, (e, g) in enumerate(zip(expected, got)):
            torch.testing.assert_close(g, e, rtol=1e-5, atol=1e-6, msg=f"rank {rank}, stage {stage}")
    own0 = torch.load(tmp_path / "rank0.pt")["own"]
    assert not torch.allclose(own0[0], expected[0]), "the ranks must start different for this to test anything"


@pytest.mark.mp
@pytest.mark.timeout(300)  # measured 6 s (2 cores)
def test_a_fully_sharded_model_refuses_a_root_that_holds_no_state_on_every_rank(tmp_path):
    """--shard full: wrap() takes rank 0's weights (once sharded, no rank holds its own whole
    model), so root 1 with nothing loaded on it is refused, on every rank, before any tensor
    moves, instead of silently giving rank 0's."""
    proc = launch("mpirun", 2, [sys.executable, str(ROOT / "tests/workers/root_worker.py"), "ddp", "full",
                                str(tmp_path)], timeout=240)
    assert proc.returncode != 0
    assert proc.stdout.count("so rank 1's can come only from a state loaded on rank 1") == 2, proc.stdout[-3000:]
    assert not list(tmp_path.glob("rank*.pt"))
