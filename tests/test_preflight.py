"""The memory preflight (issue #43): each part of the estimate on its own, in one process, and
real 2-rank runs under a per-rank memory cgroup: a mode that cannot fit is refused before step 1
in one line that names one that fits, and the mode it names trains under the same budget."""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path
from unittest import mock

import pytest
import torch
from torch import nn

from helpers import MEMORY_CGROUPS as CGROUP
from helpers import ROOT, run_in_budgets
from hvdkit.backends.buckets import MAX_IN_FLIGHT
from hvdkit.backends.footprint import ModelSizes, model_sizes, needs
from hvdkit.config import TrainConfig
from hvdkit.environments import slurm_job_memory
from hvdkit.preflight import ActivationMeter, _cgroup_limit, _instead, memory_limits, optimizer_ratio, peak


def test_each_mode_holds_its_share_of_the_state_and_its_own_in_flight_buffers():
    sizes = ModelSizes(params=4000, trainable=3000, largest_unit=500, largest_tensor=400, zero_grads=900, zero_flat=150,
                       zero_gather=250)
    none, opt, full = (needs(m, sizes, 4, 2.0, 100) for m in ("none", "optimizer", "full"))
    assert (none.params, none.grads, none.optimizer, none.in_flight) == (4000, 3000, 6000, 0)  # DDP: bucket views
    assert needs("none", sizes, 4, 2.0, 100, "horovod").in_flight == (MAX_IN_FLIGHT + 1) * 100  # its flat copies
    assert (opt.params, opt.grads, opt.optimizer, opt.in_flight) == \
        (4000, 900, 1500, max((MAX_IN_FLIGHT + 1) * 150, MAX_IN_FLIGHT * 250))
    assert (full.params, full.grads, full.optimizer, full.in_flight) == (1000, 750, 1500, 2000)
    # a save holds no gradients but its buffer; training holds activations
    assert peak(none, 10, 5, 0) == 10 + 4000 + 3000 + 6000 + 5
    assert peak(none, 10, 5, 50_000) == 10 + 4000 + 6000 + 50_000
    with pytest.raises(ValueError):
        needs("both", sizes, 4, 2.0, 100)


class _Tied(nn.Module):
    """A GPT's shape: embedding and head tied (the root's), blocks of their own."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(4000, 64)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(64, 1024), nn.ReLU(), nn.Linear(1024, 64))
                                    for _ in range(3))
        self.head = nn.Linear(64, 4000, bias=False)
        self.head.weight = self.embed.weight
        self.norm = nn.LayerNorm(64)
        self.norm.weight.requires_grad_(False)


def test_sizes_count_a_tied_parameter_once_and_the_root_as_the_unit_that_keeps_it():
    with torch.device("meta"):  # shapes only: a meta-built model is sized the same
        model = _Tied()
    sizes = model_sizes(model)
    block = (64 * 1024 + 1024 + 1024 * 64 + 64) * 4
    root = (4000 * 64 + 64 + 64) * 4
    assert sizes.params == 3 * block + root
    assert sizes.trainable == sizes.params - 64 * 4  # the frozen norm weight
    assert sizes.largest_unit == root and sizes.largest_tensor == 4000 * 64 * 4


def test_zero_s_plan_decides_what_a_rank_receives_under_shard_optimizer():
    """Small parameters share buckets, split between owners: each rank keeps about half. A
    parameter over the bucket cap is alone in its bucket: its owner keeps its gradient and the
    other rank frees its segment (all padding) as it arrives, so the two parameters' ranks keep
    one each. In flight: a bucket's padded flat buffer and the segment received (test_shard
    checks that a real run keeps exactly what it owns)."""
    small = nn.Sequential(*[nn.Linear(256, 256) for _ in range(16)])  # 16 x 257 KiB, one 4 MiB bucket
    params = list(small.parameters())
    sizes = model_sizes(small, params, world=2, bucket_cap_mb=25)
    assert sizes.zero_grads == pytest.approx(sizes.trainable / 2, rel=0.02)
    big = nn.Sequential(nn.Linear(2048, 2048, bias=False), nn.Linear(2048, 2048, bias=False))  # 16 MiB each
    sizes = model_sizes(big, list(big.parameters()), world=2, bucket_cap_mb=8)
    assert sizes.zero_grads == sizes.trainable / 2  # one parameter each
    # the largest bucket in flight: its padded flat buffer and a segment
    assert sizes.zero_flat == sizes.zero_gather == 3 * 2048 * 2048 * 4


@pytest.mark.parametrize("optimizer, args, ratio", [
    ("adamw", {}, 2.0), ("sgd", {"momentum": 0.9}, 1.0), ("sgd", {"momentum": 0.0}, 0.0),
])
def test_the_optimizer_s_bytes_per_parameter_are_measured_by_stepping_it(optimizer, args, ratio):
    cfg = TrainConfig(optimizer=optimizer, **args)
    assert optimizer_ratio(cfg) == pytest.approx(ratio, abs=0.01)  # Adam's step counter: a few bytes


def test_an_optimizer_that_cannot_step_a_plain_parameter_gives_no_estimate():
    cfg = TrainConfig(optimizer="torch.optim:LBFGS")  # needs a closure
    assert optimizer_ratio(cfg) is None


def test_activations_are_each_leaf_s_output_once_and_recomputed_blocks_keep_only_their_inputs():
    torch.manual_seed(0)
    blocks = [nn.Sequential(nn.Linear(16, 64), nn.ReLU(inplace=True), nn.Linear(64, 16)) for _ in range(3)]
    model = nn.Sequential(nn.Linear(8, 16), *blocks, nn.Linear(16, 2))
    x = torch.randn(10, 8)
    meter = ActivationMeter(model, [])
    with torch.no_grad(), meter.counting():
        model(x)
    f = 4 * 10  # bytes of one float per sample
    # the first Linear, each block's two Linears (the in-place ReLU shares its input's storage), the head
    assert meter.bytes == f * (16 + 3 * (64 + 16) + 2)
    recomputed = ActivationMeter(model, list(blocks))
    with torch.no_grad(), recomputed.counting():
        model(x)
    assert recomputed.bytes == f * (16 + 2) + 3 * f * 16 + f * (64 + 16)  # outputs kept; one block's insides
    assert not model._forward_hooks and not blocks[0][0]._forward_hooks  # the hooks are gone


def test_the_tightest_cgroup_limit_up_the_path_is_the_one_that_binds(tmp_path):
    proc = tmp_path / "cgroup"
    proc.write_text("5:devices:/\n4:memory:/job/step/task0\n0::/\n")
    root = tmp_path / "fs"
    for path, limit in (("", "9223372036854771712"), ("job", str(3 << 30)), ("job/step", str(5 << 30)),
                        ("job/step/task0", "9223372036854771712")):
        (root / "memory" / path).mkdir(parents=True, exist_ok=True)
        (root / "memory" / path / "memory.limit_in_bytes").write_text(limit + "\n")
    assert _cgroup_limit(proc, root) == ("/job", 3 << 30)
    v2 = tmp_path / "v2"
    (v2 / "a" / "b").mkdir(parents=True)
    (v2 / "cgroup.controllers").write_text("memory\n")
    (v2 / "a" / "memory.max").write_text("max\n")
    (v2 / "a" / "b" / "memory.max").write_text(f"{1 << 30}\n")
    proc.write_text("0::/a/b\n")
    assert _cgroup_limit(proc, v2) == ("/a/b", 1 << 30)
    (v2 / "a" / "b" / "memory.max").write_text("max\n")
    assert _cgroup_limit(proc, v2) is None


def test_the_slurm_job_s_memory_is_its_mem_or_mem_per_cpu_times_its_cpus():
    assert slurm_job_memory({"SLURM_MEM_PER_NODE": "4096"}) == 4 << 30
    assert slurm_job_memory({"SLURM_MEM_PER_CPU": "1000", "SLURM_CPUS_ON_NODE": "4"}) == 4000 << 20
    assert slurm_job_memory({"SLURM_MEM_PER_NODE": "0"}) is None  # --mem=0: the whole node
    assert slurm_job_memory({}) is None and slurm_job_memory({"SLURM_MEM_PER_NODE": "4G"}) is None


def test_the_limits_are_the_node_the_cgroup_and_the_job_each_keyed_by_who_shares_it():
    with mock.patch.dict(os.environ, {"SLURM_MEM_PER_NODE": "2048", "SLURM_JOB_ID": "77"}):
        limits = {limit.key.split(":")[0]: limit for limit in memory_limits("nodeA")}
    assert limits["node"].key == "node:nodeA" and limits["node"].bytes > 1 << 30
    assert limits["slurm"].key == "slurm:nodeA:77" and limits["slurm"].bytes == 2 << 30


def _ranks(peaks: dict[str, int], hosts: tuple[str, ...] = ("a", "a")) -> list[dict]:
    return [{"limits": [("node " + h, "node:" + h, 100)], "peaks": peaks} for h in hosts]


def test_the_mode_named_instead_is_the_least_sharded_that_leaves_room_for_what_the_estimate_misses():
    modes = ["none", "optimizer", "full"]
    # two ranks share a node of 100: optimizer at 2 x 45 fits but leaves under a fifth free
    assert _instead(_ranks({"none": 70, "optimizer": 45, "full": 30}), "none", modes) == "full"
    assert _instead(_ranks({"none": 70, "optimizer": 38, "full": 30}), "none", modes) == "optimizer"
    assert _instead(_ranks({"none": 70, "optimizer": 48, "full": 45}), "none", modes) == "full"  # most room
    assert _instead(_ranks({"none": 70, "optimizer": 60, "full": 55}), "none", modes) is None
    # a node of its own each: the same peaks fit
    assert _instead(_ranks({"none": 90, "optimizer": 45, "full": 30}, ("a", "b")), "none", modes) == "optimizer"


# -- real runs under a memory cgroup per rank ---------------------------------------------------

USER = ROOT / "tests" / "userland" / "userland.py"
BUDGET = 1350 * 2**20
WIDTH = 2896  # wide_mlp(2896, 10): 84M parameters; AdamW: ~1.6 GiB a rank replicated, ~1.1 GiB sharded


def _budgeted(tmp_path: Path, backend: str, *train: str) -> tuple[subprocess.CompletedProcess, list[dict]]:
    """Two ranks of hvdkit train on the wide MLP, each in a memory cgroup of BUDGET bytes."""
    return run_in_budgets(tmp_path, 2, backend, BUDGET, [
        "--model", f"{USER}:wide_mlp", "--model-arg", f"width={WIDTH}", "--dataset", f"{USER}:vectors",
        "--dataset-arg", f"width={WIDTH}", "--dataset-arg", "samples=32", "--batch-size", "4", "--optimizer", "adamw",
        "--lr", "1e-4", "--epochs", "1", "--log-every", "1", *train])


@pytest.mark.mp
@pytest.mark.timeout(600)
@pytest.mark.skipif(not os.access(CGROUP, os.W_OK), reason="no writable cgroup-v1 memory controller here")
@pytest.mark.parametrize("backend", ["horovod", "ddp"])
def test_a_mode_that_cannot_fit_the_budget_is_refused_before_step_1_naming_one_that_trains_under_it(
        tmp_path, backend):
    refused, _ = _budgeted(tmp_path, backend)
    lines = [line for line in refused.stderr.strip().splitlines() if "hvdkit train" not in line and line.strip()]
    said = [line for line in lines if "needs ~" in line]
    assert refused.returncode != 0 and len(said) == 1, refused.stdout[-2000:] + refused.stderr[-3000:]
    assert "under --shard none" in said[0] and "memory cgroup" in said[0], said[0]
    assert "step 1 " not in refused.stdout, refused.stdout  # before any step
    named = re.search(r"HINT: use --shard (\w+)", said[0])
    assert named, said[0]
    fits, figures = _budgeted(tmp_path, backend, "--shard", named.group(1))
    assert fits.returncode == 0, fits.stdout[-2000:] + fits.stderr[-3000:]
    assert "it fits" in fits.stderr and "step 4 " in fits.stdout, fits.stderr[-2000:]
    assert len(figures) == 2 and all(f["oom_kill"] == 0 and f["peak"] < BUDGET for f in figures), figures
    print(f"{backend}: {said[0]}\n  --shard {named.group(1)}: cgroup peaks {[f['peak'] >> 20 for f in figures]} MiB")


@pytest.mark.mp
@pytest.mark.timeout(600)
@pytest.mark.skipif(not os.access(CGROUP, os.W_OK), reason="no writable cgroup-v1 memory controller here")
def test_the_refused_mode_really_does_not_fit_the_budget(tmp_path):
    """The refusal was right: without the check, the same run is ended by the budget (its OOM killer)."""
    run, figures = _budgeted(tmp_path, "ddp", "--no-memory-check")
    assert run.returncode != 0 and any(f["oom_kill"] > 0 for f in figures), (figures, run.stderr[-2000:])


# ---------------------------------------------------------------------------------------------
# Before the queue: hvdkit slurm --mem against the least a node's ranks need (the model sized on
# the meta device in a child process; the CLI itself stays torch-free)
# ---------------------------------------------------------------------------------------------
def test_slurm_s_mem_is_read_as_sbatch_reads_it():
    from hvdkit.errors import ConfigError
    from hvdkit.launch.slurm import mem_bytes

    assert (mem_bytes("16G"), mem_bytes("512K"), mem_bytes("2T")) == (16 << 30, 512 << 10, 2 << 40)
    assert mem_bytes("4000") == 4000 << 20 and mem_bytes("1.5G") == 3 << 29  # no unit: MiB
    assert mem_bytes("0") is None  # all of each node's memory
    with pytest.raises(ConfigError, match="is not a Slurm memory size"):
        mem_bytes("16GB")


def test_the_job_check_counts_the_state_of_a_meta_built_model_and_nothing_it_cannot_see():
    from hvdkit.models import build_model_on_meta
    from hvdkit.preflight import job_check

    model = build_model_on_meta("mlp")
    params = list(model.parameters())
    assert params and all(p.is_meta for p in params)  # sized, not allocated
    cfg = TrainConfig(model="mlp", optimizer="adamw")  # Horovod: its flat buckets are in flight too
    ratio = optimizer_ratio(cfg)  # AdamW: two moments (and a step count) a parameter
    part = needs("none", model_sizes(model, params, 2), 2, ratio, 25 << 20, "horovod")
    floor = part.state + part.in_flight  # what two ranks on a node need at the least, each
    numel = sum(p.numel() for p in params)
    assert part.in_flight == (MAX_IN_FLIGHT + 1) * 4 * numel  # each bucket no larger than the model
    assert floor >= (16 + 4 * (MAX_IN_FLIGHT + 1)) * numel  # 16 bytes a parameter, and the buckets
    assert job_check(cfg, model, 1, 2, 2 * floor) is None
    refusal = job_check(cfg, model, 1, 2, 2 * floor - 1)
    assert refusal is not None and "--shard none" in refusal.message and "at least" in refusal.message
    refusal = job_check(cfg, model, 1, 2, 1 << 20)  # nothing fits one MiB: no mode is named
    assert refusal is not None and "use --shard" not in str(refusal) and "a larger --mem" in refusal.hint


GPT_51M = ["--model", f"{ROOT / 'examples' / 'models.py'}:gpt", "--model-arg", "vocab_size=50304",
           "--model-arg", "block_size=64", "--model-arg", "n_layer=8", "--model-arg", "n_head=8",
           "--model-arg", "n_embd=512", "--task", "language-model", "--optimizer", "adamw", "--data", "train.h5"]


@pytest.mark.timeout(300)  # six CLI calls, four of them sizing the model in a child: ~5 s each
def test_hvdkit_slurm_refuses_a_mem_the_ranks_cannot_fit_before_writing_the_script(tmp_path):
    from helpers import HVDKIT, base_env

    (tmp_path / "train.h5").write_bytes(b"")  # --data only has to exist to make the script

    def slurm(mem: str, *train: str) -> subprocess.CompletedProcess:
        (tmp_path / "job.sbatch").unlink(missing_ok=True)
        return subprocess.run([*HVDKIT, "slurm", "-N", "1", "--tasks-per-node", "2", "--mem", mem, "-o",
                               "job.sbatch", "--", *train], cwd=tmp_path, env=base_env(), capture_output=True,
                              text=True, timeout=120)

    # 51M parameters, AdamW: ~853 MiB a rank at the least replicated, ~783 MiB under --shard full
    proc = slurm("1700M", *GPT_51M)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr
    assert lines[0].startswith("Error: --mem 1700M: a rank needs at least ~") and "under --shard none" in lines[0]
    named = re.search(r"HINT: use --shard (\w+)", lines[0])
    assert named and named.group(1) != "none", lines[0]
    assert not (tmp_path / "job.sbatch").exists()
    # the mode it names passes the same check, and the script carries it
    proc = slurm("1700M", *GPT_51M, "--shard", named.group(1))
    assert proc.returncode == 0, proc.stderr
    assert f"--shard {named.group(1)}" in (tmp_path / "job.sbatch").read_text()
    # far too little for any mode: no mode named, what to change instead
    proc = slurm("64M", *GPT_51M)
    assert proc.returncode == 2 and "HINT: a larger --mem, fewer --tasks-per-node" in proc.stderr, proc.stderr
    # the run's own switch skips it; --mem=0 (the whole node) is not checked
    assert slurm("64M", *GPT_51M, "--no-memory-check").returncode == 0
    assert slurm("0", *GPT_51M).returncode == 0
    # a model that cannot be built on the meta device here: said, and the run checks before step 1
    (tmp_path / "odd.py").write_text("import torch\nfrom torch import nn\n\n\ndef odd() -> nn.Module:\n"
                                     "    n = int(torch.ones(1).sum().item())  # a value: not on meta\n"
                                     "    return nn.Linear(8 * n, 4)\n")
    proc = slurm("64M", "--model", "odd.py:odd", "--data", "train.h5")
    assert proc.returncode == 0 and (tmp_path / "job.sbatch").is_file(), proc.stderr
    assert "Warning: --mem 64M was not checked against the model here (--model odd.py:odd could not be sized" \
        in proc.stderr and "the run checks its memory before step 1" in proc.stderr, proc.stderr
