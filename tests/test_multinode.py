"""Multi-node, for real: jobs across the namespaced nodes that scripts/local-cluster.sh makes.

Each node is its own network + UTS namespace (hostname node1, node2, ...) with a
management interface (eth0, where the hostnames resolve) and a fabric interface (eth1);
ranks on different nodes share no hostname, no loopback and no shared-memory transport.
scripts/test.sh brings the cluster up before pytest; where namespaces cannot be made it
starts a single-node cluster instead and these tests are skipped, with one loud line.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from click.testing import CliRunner

from helpers import (
    CLUSTER,
    CLUSTER_STATE,
    DONE_STATES,
    VENV,
    base_env,
    cluster,
    cluster_mode,
    elastic_one_host,
    job_state,
    read_metrics,
    render,
    sbatch,
    stop_process_group,
    wait_done,
    wait_for_text,
    wait_until,
)
from hvdkit.cli import cli

pytestmark = [pytest.mark.multinode, pytest.mark.slurm]

# cnn: 4 epochs of 16 (world 4) or 32 (world 2) steps; long enough to signal mid-run
TRAIN = ["--model", "cnn", "--epochs", "4", "--num-samples", "1024", "--batch-size", "16"]
SHORT = ["--model", "cnn", "--epochs", "2", "--num-samples", "512", "--batch-size", "16"]
CNN_GRAD_BYTES = 545_098 * 4  # float32 gradients of SmallCNN, sent every step


@pytest.fixture(scope="module", autouse=True)
def two_nodes():
    mode, nodes = cluster_mode()
    if mode != "multi" or nodes < 2:
        pytest.skip(f"multi-node tests skipped: the local cluster is mode={mode} with {nodes} "
                    "node(s) (scripts/local-cluster.sh could not make namespaces here)")


@pytest.fixture
def nodes_restored():
    """Whatever a test drains or crashes, every node is back (idle) afterwards."""
    yield
    for node in ("node1", "node2"):
        cluster("revive", node)


def veth_bytes(node: int, net: str) -> int:
    """Bytes both ways on node ``node``'s link to bridge ``net`` ('m' mgmt, 'f' fabric)."""
    stats = Path(f"/sys/class/net/hvk-n{node}-{net}/statistics")
    return int((stats / "rx_bytes").read_text()) + int((stats / "tx_bytes").read_text())


@contextlib.contextmanager
def node2_traffic() -> Iterator[dict[str, int]]:
    """Bytes over node2's management ('m') and fabric ('f') links while the block runs."""
    before = {net: veth_bytes(2, net) for net in "mf"}
    delta: dict[str, int] = {}
    yield delta
    delta.update({net: veth_bytes(2, net) - before[net] for net in "mf"})


def assert_gradients_on_fabric(delta: dict[str, int], steps: int = 16) -> None:
    # every step sends and receives about one copy of the gradients over node2's link: all of
    # that must be on the fabric; management carries only Slurm, ssh and launch chatter
    assert delta["f"] > steps * CNN_GRAD_BYTES, delta
    assert delta["m"] < delta["f"] / 10, delta


def on_node(node: str, argv: list[str], timeout: float = 180) -> subprocess.CompletedProcess:
    """Run ``argv`` on ``node`` (its hostname and network), as a user logged in there would."""
    # the "nodes" share this machine's cores: one thread per rank, as --cpus-per-task 1 gives jobs
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
    for var in [k for k in env if k.startswith(("SLURM_", "OMPI_COMM_WORLD", "HOROVOD_", "MASTER_"))]:
        env.pop(var)
    return subprocess.run([str(CLUSTER), "exec", node, "--", *argv], capture_output=True, text=True,
                          timeout=timeout, env=env, start_new_session=True)


# ---------------------------------------------------------------------------------------------
# 1 + 2. sbatch across nodes: placement, MASTER_ADDR, cross_size, equal to one node; transports
# ---------------------------------------------------------------------------------------------
LAYOUTS = {  # name: (nodes, tasks per node); each 2-node layout has a 1-node twin of equal world
    "2x1": (2, 1), "1x2": (1, 2), "2x2": (2, 2), "1x4": (1, 4),
}
TWIN = {"2x1": "1x2", "2x2": "1x4"}


@pytest.fixture(scope="module")
def layout_runs(tmp_path_factory):
    """Every layout for both backends, submitted together; metrics and logs keyed by (backend, layout)."""
    tmp = tmp_path_factory.mktemp("layouts")
    jobs = {}
    for backend in ("ddp", "horovod"):
        for name, (nodes, tpn) in LAYOUTS.items():
            extra = []
            if backend == "horovod" and name == "2x2":
                # Open MPI names the transport it picks for every peer (bml lines)
                extra = ["--env", "OMPI_MCA_btl_base_verbose=100"]
            # a twin pair shares its options; ddp 2x1/1x2 run the longer TRAIN because the
            # requeue test compares its interrupted run with ddp 1x2, the others keep it short
            train = TRAIN if backend == "ddp" and name in ("2x1", "1x2") else SHORT
            script = render(tmp, f"{backend}-{name}", "--backend", backend, "-N", str(nodes),
                            "--tasks-per-node", str(tpn), "--results-dir", str(tmp / "res"), *extra,
                            "--", *train)
            jobs[backend, name] = (sbatch(script, tmp), script)
    out = {}
    for (backend, name), (job, _) in jobs.items():
        log = tmp / f"{backend}-{name}-{job}.out"
        assert wait_done(job, timeout=420) == "COMPLETED", log.read_text()[-4000:]
        metrics = read_metrics(tmp / "res" / f"{backend}-{name}-{job}-0.json")
        out[backend, name] = (metrics, log.read_text())
    return out


@pytest.mark.timeout(600)  # measured 52 s (2 cores, loaded)
@pytest.mark.parametrize("backend", ["ddp", "horovod"])
@pytest.mark.parametrize("layout", ["2x1", "2x2"])
def test_two_nodes_match_one_node(layout_runs, backend, layout):
    nodes, tpn = LAYOUTS[layout]
    metrics, log = layout_runs[backend, layout]
    placement, topo = metrics["placement"], metrics["topology"]
    by_host: dict[str, list[int]] = {}
    for p in placement:
        by_host.setdefault(p["host"], []).append(p["local_rank"])
    assert sorted(by_host) == ["node1", "node2"], placement          # two real hostnames
    assert all(sorted(v) == list(range(tpn)) for v in by_host.values()), placement  # local ranks restart
    assert placement[0]["host"] == "node1" and topo["master_addr"] == "node1", topo
    assert topo["nodes"] == 2
    if backend == "horovod":
        assert topo["cross_size"] == 2 and topo["local_size"] == tpn, topo
    assert metrics["params_identical"] is True
    # Same world size and global batch on one node: the reduction order is the same (a
    # 2-rank sum is commutative; 4 ranks keep their ring order whatever the node), and
    # OMP_NUM_THREADS=1 in both, so the result is bitwise equal.
    twin, twin_log = layout_runs[backend, TWIN[layout]]
    assert twin["topology"]["nodes"] == 1 and twin["world_size"] == metrics["world_size"]
    assert metrics["final_loss"] == twin["final_loss"], (log[-2000:], twin_log[-2000:])
    assert metrics["param_digest"] == twin["param_digest"]


@pytest.mark.timeout(600)  # its runs are the layout_runs fixture's: measured 52 s (2 cores, loaded)
def test_open_mpi_uses_tcp_between_nodes_and_shared_memory_within(layout_runs):
    _, log = layout_runs["horovod", "2x2"]
    # [node1:pid] mca: bml: Using tcp btl for send to [[job,1],2] on node node2
    picks = re.findall(r"\[(node\d):\d+\] mca: bml: Using (\w+) btl for send to \S+ on node (node\d)", log)
    assert picks, log[-3000:]
    between = {btl for src, btl, dst in picks if src != dst}
    within = {btl for src, btl, dst in picks if src == dst} - {"self"}
    assert between == {"tcp"}, picks
    assert within == {"vader"}, picks   # Open MPI's shared-memory transport


# ---------------------------------------------------------------------------------------------
# 3 + 6. Without Slurm: hvdkit run -H node1:1,node2:1 over ssh, pinned to the fabric interface
# ---------------------------------------------------------------------------------------------
RUNS = {
    "horovodrun-gloo": ["--backend", "horovod", "--launcher", "horovodrun", "--controller", "gloo"],
    "horovodrun-mpi": ["--backend", "horovod", "--launcher", "horovodrun", "--controller", "mpi"],
    "mpirun-ddp": ["--backend", "ddp", "--launcher", "mpirun"],
}


@pytest.mark.timeout(300)  # measured 6 s (2 cores, loaded)
@pytest.mark.parametrize("kind", sorted(RUNS))
def test_hvdkit_run_across_hosts_on_the_fabric(tmp_path, kind):
    metrics_file = tmp_path / "m.json"
    with node2_traffic() as delta:
        proc = on_node("node1", [sys.executable, "-m", "hvdkit", "run", "-np", "2", "-H",
                                 "node1:1,node2:1", "--iface", "eth1", *RUNS[kind], "--", "--model",
                                 "cnn", "--epochs", "1", "--num-samples", "512", "--batch-size", "16",
                                 "--metrics-file", str(metrics_file)])
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    metrics = read_metrics(metrics_file)
    assert sorted(p["host"] for p in metrics["placement"]) == ["node1", "node2"]
    assert metrics["params_identical"] is True
    assert_gradients_on_fabric(delta)


@pytest.mark.timeout(300)  # measured 7 s (2 cores, loaded)
@pytest.mark.parametrize("backend", ["ddp", "horovod"])
def test_sbatch_iface_pins_traffic_to_the_fabric(tmp_path, backend):
    script = render(tmp_path, f"iface-{backend}", "--backend", backend, "-N", "2", "--iface", "eth1",
                    "--results-dir", str(tmp_path / "res"), "--", "--model", "cnn", "--epochs", "1",
                    "--num-samples", "512", "--batch-size", "16")
    with node2_traffic() as delta:
        job = sbatch(script, tmp_path)
        state = wait_done(job)
    assert state == "COMPLETED", (tmp_path / f"iface-{backend}-{job}.out").read_text()[-3000:]
    assert_gradients_on_fabric(delta)


@pytest.mark.timeout(300)  # measured 5 s (2 cores, loaded)
@pytest.mark.parametrize("backend", ["ddp", "horovod"])
def test_wrong_iface_fails_on_every_rank_in_one_line(tmp_path, backend):
    script = render(tmp_path, f"badif-{backend}", "--backend", backend, "-N", "2", "--iface", "ib7",
                    "--", "--model", "tiny", "--epochs", "1", "--num-samples", "64")
    job = sbatch(script, tmp_path)
    assert wait_done(job) == "FAILED"
    log = (tmp_path / f"badif-{backend}-{job}.out").read_text()
    errors = [ln for ln in log.splitlines() if "Error:" in ln]
    assert errors and all("network interface 'ib7' (--iface) does not exist on node" in e for e in errors), log
    assert "Traceback" not in log and "epoch" not in log, log   # failed before training started


def test_hvdkit_run_refuses_a_missing_iface_at_once():
    result = CliRunner().invoke(cli, ["run", "-np", "2", "-H", "node1:1,node2:1", "--iface", "ib7",
                                      "--", "--model", "tiny"])
    assert result.exit_code == 2  # a usage error (click's standalone mode adds its Usage: block here)
    errors = [line for line in result.output.splitlines() if line.startswith("Error:")]
    assert len(errors) == 1 and "network interface 'ib7' (--iface) does not exist" in errors[0], result.output


# ---------------------------------------------------------------------------------------------
# 4. Requeue onto another node; 5. a node dies mid-run
# ---------------------------------------------------------------------------------------------
@pytest.mark.timeout(420)  # measured 16 s (2 cores, loaded)
def test_requeue_resumes_on_another_node(tmp_path, layout_runs, nodes_restored):
    subprocess.run(["scontrol", "update", "nodename=node2", "state=drain", "reason=hvdkit-test"],
                   check=True, timeout=30)          # so the job must start on node1
    script = render(tmp_path, "move", "--backend", "ddp", "--tasks-per-node", "2",
                    "--checkpoint-dir", str(tmp_path / "ck"), "--results-dir", str(tmp_path / "res"),
                    "--", *TRAIN)
    job = sbatch(script, tmp_path)
    log_path = tmp_path / f"move-{job}.out"
    wait_for_text(log_path, "epoch 0 loss", job)
    cluster("revive", "node2")
    subprocess.run(["scontrol", "update", "nodename=node1", "state=drain", "reason=hvdkit-test"],
                   check=True, timeout=30)          # node1 finishes this run but takes no new one
    subprocess.run(["scancel", "--signal=USR1", job], check=True, timeout=30)
    assert wait_done(job, kick_requeued=True, timeout=300) == "COMPLETED", log_path.read_text()[-3000:]
    log = log_path.read_text()
    starts = re.findall(r"\[sbatch\] job \d+ \(move\) on (node\d), 2 tasks, restart (\d)", log)
    assert starts == [("node1", "0"), ("node2", "1")], log
    assert re.search(r"preempted at step \d+ by SIGUSR1; checkpoint saved; requeued Slurm job", log)
    assert re.search(r"resumed from .*ckpt-\d+\.h5", log)
    metrics = read_metrics(next((tmp_path / "res").glob("*.json")))
    assert {p["host"] for p in metrics["placement"]} == {"node2"}
    reference, _ = layout_runs["ddp", "1x2"]             # the same run, never interrupted
    assert metrics["final_loss"] == reference["final_loss"]
    assert metrics["param_digest"] == reference["param_digest"]


def _node2_dies_mid_run(tmp_path, name: str, backend: str) -> tuple[Path, str, Path, float]:
    """A 2-node job that checkpoints every 8 steps; node2 is killed once epoch 1 is logged.
    Returns (the script, the job, its log, when node2 was killed)."""
    script = render(tmp_path, name, "--backend", backend, "-N", "2", "--no-requeue",
                    "--checkpoint-dir", str(tmp_path / "ck"), "--", "--model", "cnn", "--epochs", "12",
                    "--num-samples", "1024", "--batch-size", "16", "--checkpoint-every", "8")
    job = sbatch(script, tmp_path)
    log_path = tmp_path / f"{name}-{job}.out"
    wait_for_text(log_path, "epoch 1 loss", job)
    killed_at = time.monotonic()
    cluster("kill-node", "node2")
    return script, job, log_path, killed_at


@pytest.mark.timeout(420)  # measured 56 s (2 cores, loaded); the mark sat on the helper, where it did nothing
def test_node_death_ends_the_job_in_one_line_and_a_rerun_resumes(tmp_path, nodes_restored):
    ck = tmp_path / "ck"
    script, job, log_path, killed_at = _node2_dies_mid_run(tmp_path, "crash", "ddp")
    wait_for_text(log_path, "lost contact", job, timeout=60)
    noticed = time.monotonic() - killed_at
    state = wait_done(job, timeout=120)
    log = log_path.read_text()
    lost = [ln for ln in log.splitlines() if "lost contact" in ln]
    assert len(lost) == 1 and "rank 0/2 (ddp) lost contact with rank 1 on node2" in lost[0], log
    assert "HINT: rerun the job: it resumes from the last checkpoint" in lost[0]
    assert "Traceback" not in log
    assert noticed < 60 and state in ("FAILED", "NODE_FAIL"), (noticed, state)
    show = subprocess.run([sys.executable, "-m", "hvdkit", "ckpt", "show", str(ck)],
                          capture_output=True, text=True, timeout=60)
    assert show.returncode == 0, show.stdout + show.stderr       # the last checkpoint is valid
    cluster("revive", "node2")
    rerun = sbatch(script, tmp_path)
    assert wait_done(rerun, timeout=300) == "COMPLETED", (tmp_path / f"crash-{rerun}.out").read_text()[-3000:]
    relog = (tmp_path / f"crash-{rerun}.out").read_text()
    assert re.search(r"resumed from .*ckpt-\d+\.h5", relog) and "done: backend=ddp world=2" in relog


@pytest.mark.timeout(420)  # measured 47 s (2 cores, loaded)
def test_horovod_mpi_controller_node_death_is_one_line_and_keeps_the_checkpoint(tmp_path, nodes_restored):
    """Horovod over MPI (srun --mpi=pmix, the MPI controller) across 2 nodes: node2 dies."""
    ck = tmp_path / "ck"
    _, job, log_path, _ = _node2_dies_mid_run(tmp_path, "hcrash", "horovod")
    state = wait_done(job, timeout=180)
    log = log_path.read_text()
    assert state in ("FAILED", "NODE_FAIL"), (state, log[-3000:])
    # Who tells first is a race that neither side controls: rank 0 noticing the silent peer
    # (hvdkit's one line), or srun noticing the dead slurmstepd and cancelling the job (Slurm's
    # one line, after which no rank lives to say more). Either way: one reason, no traceback.
    ours = [ln for ln in log.splitlines() if "lost contact with rank 1 on node2" in ln]
    slurms = [ln for ln in log.splitlines() if re.search(r"CANCELLED AT \S+ DUE TO NODE FAILURE", ln)]
    assert len(ours) == 1 or slurms, log[-3000:]
    assert "Traceback" not in log, log[-3000:]
    show = subprocess.run([sys.executable, "-m", "hvdkit", "ckpt", "verify", str(ck)],
                          capture_output=True, text=True, timeout=60)
    assert show.returncode == 0 and "OK" in show.stdout, show.stdout + show.stderr


@pytest.mark.timeout(400)  # measured 17 s (2 cores, loaded)
def test_elastic_on_one_cluster_node_with_two_slots(tmp_path):
    """Discovery 'node1:2' on node1 itself: trains, shrinks when a worker dies, grows back."""
    text, resets, first = elastic_one_host(tmp_path, "node1", prefix=[str(CLUSTER), "exec", "node1", "--"],
                                           env={**base_env(), "OMP_NUM_THREADS": "1"})
    assert first < 60, first
    assert [w for w, _ in resets] == [2, 1, 2], resets
    assert re.search(r"done: backend=horovod world=2 ", text)


# ---------------------------------------------------------------------------------------------
# 8. hvdkit doctor inside a 2-node allocation
# ---------------------------------------------------------------------------------------------
@pytest.mark.timeout(300)  # measured 8 s (2 cores, loaded)
def test_doctor_in_a_two_node_allocation(tmp_path):
    script = tmp_path / "doctor.sh"
    script.write_text(
        "#!/bin/bash\n#SBATCH --nodes=2 --ntasks-per-node=2 --time=5:00\n"
        f"#SBATCH --output={tmp_path}/doctor-%j.out\nset -euo pipefail\n"
        'MASTER_ADDR="$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)"\n'
        f"export MASTER_ADDR\n{sys.executable} -m hvdkit doctor\n")
    job = sbatch(script, tmp_path)
    state = wait_done(job, timeout=200)
    out = (tmp_path / f"doctor-{job}.out").read_text()
    assert state == "COMPLETED", out
    line = next(ln for ln in out.splitlines() if "allocation" in ln)
    assert line.startswith("[ok  ] allocation"), out
    assert "2 node(s) node1,node2, tasks per node 2(x2)" in line
    assert "MASTER_ADDR node1 -> 10.233.1.1" in line and "reachable from node1, node2" in line


# ---------------------------------------------------------------------------------------------
# 7. Horovod Elastic across nodes: a node lost mid-run and added back
# ---------------------------------------------------------------------------------------------
@pytest.mark.timeout(400)  # measured 41 s (2 cores, loaded)
def test_elastic_sbatch_job_loses_a_node_takes_it_back_and_sees_every_sample(tmp_path, nodes_restored):
    """hvdkit slurm --elastic, submitted: node2 crashes mid-epoch (worker, slurmd, sshd), the job
    (--no-kill) goes on with node1, node2 comes back and rejoins; then USR1 to the batch shell
    (as before a time limit) reaches the ranks through the stop file: checkpoint, requeue,
    resume. Every epoch trains on every sample once (the sample log), and the job ends
    COMPLETED with both nodes."""
    from hvdkit.data import make_synthetic_h5
    from hvdkit.samplelog import read_sample_log

    data = make_synthetic_h5(tmp_path / "train.h5", "mlp", 2048, seed=3)
    script = render(tmp_path, "elastic", "--elastic", "-N", "2", "--min-nodes", "1",
                    "--blacklist-cooldown-range", "1", "2", "--checkpoint-dir", str(tmp_path / "ck"), "--",
                    "--model", "mlp", "--epochs", "12", "--data", str(data), "--commit-every", "4",
                    "--log-every", "1", "--sample-log", str(tmp_path / "ids.jsonl"))
    job = sbatch(script, tmp_path)
    log = tmp_path / f"elastic-{job}.out"
    try:
        wait_for_text(log, "commit at step 8 ", job, timeout=120)
        cluster("kill-node", "node2")                    # crashed: worker, slurmd, sshd
        wait_for_text(log, "reset: rank 0 of 1", job, timeout=120)
        cluster("revive", "node2")                       # back after a "reboot"
        wait_for_text(log, "reset: rank 0 of 2", job, timeout=120)
        subprocess.run(["scancel", "--signal=USR1", "--batch", job], check=True, timeout=30)
        wait_for_text(log, "requeued Slurm job", job, timeout=120)
        state = wait_done(job, timeout=300, kick_requeued=True)
    finally:
        subprocess.run(["scancel", job], timeout=30, check=False)
        cluster("kill-node", "node2")                    # no stray worker left on node2
    text = log.read_text()
    assert state == "COMPLETED", text[-4000:]
    assert "#SBATCH --no-kill" in script.read_text()
    workers = set(re.findall(r"elastic worker rank \d+ of \d+ \(local \d+\) host (node\d)", text))
    assert workers == {"node1", "node2"}, text[-3000:]
    resets = re.findall(r"reset: rank 0 of (\d) ", text)
    # shrink first, grow later (a busy machine may show the loss as two resets of world 1)
    assert resets[0] == "1" and "2" in resets[resets.index("1"):], resets
    done = re.search(r"done: backend=horovod world=(\d) .*params_identical_on_all_ranks=True", text)
    assert done and done.group(1) == "2", text[-3000:]
    stopped = re.search(r"preempted at step (\d+) by SIGUSR1; checkpoint saved; requeued Slurm job", text)
    assert stopped and "restart 1" in text, text[-3000:]
    assert f"resumed from {tmp_path}/ck/ckpt-{int(stopped.group(1)):09d}.h5" in text, text[-3000:]
    records = read_sample_log(tmp_path / "ids.jsonl")
    for epoch in range(12):
        assert sorted(i for r in records if r["epoch"] == epoch for i in r["ids"]) == list(range(2048)), epoch


@pytest.mark.timeout(200)  # measured 6 s (2 cores, loaded)
@pytest.mark.parametrize("backend", ["ddp", "horovod"])
def test_an_exception_on_one_node_ends_the_job_promptly_under_srun(tmp_path, backend):
    """srun --kill-on-bad-exit: one unreadable sample on node2's shard fails that rank mid-epoch;
    the job ends FAILED within seconds, with one line naming rank, node and cause."""
    from helpers import bit_rotten_dataset

    data = bit_rotten_dataset(tmp_path / "rot.h5", 77)
    script = render(tmp_path, f"rot-{backend}", "--backend", backend, "-N", "2", "--tasks-per-node", "1",
                    "--", "--model", "tiny", "--data", str(data), "--epochs", "2", "--batch-size", "8",
                    *(["--ddp-timeout", "900"] if backend == "ddp" else []))
    t0 = time.monotonic()
    job = sbatch(script, tmp_path)
    assert wait_done(job, timeout=150) == "FAILED"
    assert time.monotonic() - t0 < 60  # submit to FAILED: not the 900 s --ddp-timeout
    log = (tmp_path / f"rot-{backend}-{job}.out").read_text()
    errors = re.findall(rf"Error: rank (\d)/2 \({backend}\) on (node\d) failed: OSError: Can't "
                        r"synchronously read data", log)
    assert len(errors) == 1, log[-4000:]
    rank, node = errors[0]
    assert node == f"node{int(rank) + 1}"  # one task per node, in rank order


RAY_MLP = ["--model", "mlp", "--epochs", "2", "--steps-per-epoch", "8", "--num-samples", "1024"]
RAY_HEAD = "10.233.2.1"  # node1 on the fabric
RAY_HEAD_IP_RE = r"10\.233\.\d\.1"  # node1, on the network its name resolves to, or the fabric


def ray_run_on_node1(address: str, backend: str, env: dict[str, str]) -> str:
    """'hvdkit run --launcher ray --ray-placement spread' from node1, joined to ``address``:
    asserts one rank on each node, returns the digest."""
    passed = {k: v for k, v in base_env(**env).items()
              if k in ("PYTHONPATH", "OMPI_ALLOW_RUN_AS_ROOT", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "HOME", *env)}
    proc = subprocess.run([str(CLUSTER), "exec", "node1", "--", "env", *[f"{k}={v}" for k, v in passed.items()],
                           sys.executable, "-m", "hvdkit", "run", "-np", "2", "--launcher", "ray", "--ray-address",
                           address, "--ray-placement", "spread", "--iface", "eth1", "--backend", backend, "--",
                           *RAY_MLP], capture_output=True, text=True, timeout=300)
    out = proc.stdout + proc.stderr
    done = re.search(r"done: backend=(\w+) .* digest=(\w+) ranks=0@(\w+):\d+ 1@(\w+):\d+", out)
    assert proc.returncode == 0 and done and done.group(1) == backend, out[-2000:]
    assert {done.group(3), done.group(4)} == {"node1", "node2"}, out[-1000:]  # one rank per node
    return done.group(2)


def mpirun_digest(backend: str) -> str:
    local = subprocess.run([sys.executable, "-m", "hvdkit", "run", "-np", "2", "--launcher", "mpirun", "--backend",
                            backend, "--", *RAY_MLP], env=base_env(), capture_output=True, text=True, timeout=300)
    assert local.returncode == 0, local.stderr[-2000:]
    return re.search(r"digest=(\w+)", local.stdout).group(1)


def no_ray_left(nodes: tuple[str, ...] = ("node1", "node2")) -> None:
    """No raylet or GCS is left on the nodes (found by namespace membership, not by name)."""
    for node in nodes:
        pids = cluster("pids", node).split()
        left = subprocess.run(["ps", "-o", "args=", "-p", ",".join(pids)], capture_output=True, text=True,
                              timeout=30).stdout if pids else ""
        assert "raylet" not in left and "gcs_server" not in left, left


@pytest.mark.timeout(600)  # measured 30 s on 2 cores
def test_ray_up_cluster_has_its_own_token_and_ray_down_stops_it_by_pid(tmp_path):
    """scripts/local-cluster.sh ray-up: a Ray head on node1 and a worker on node2, joined over
    the fabric, with a token made for it (in a root-only file, never ~/.ray); a command given
    that file joins it and puts one rank on each node; ray-down leaves no Ray process."""
    pytest.importorskip("ray")
    out = cluster("ray-up", timeout=300)
    try:
        token = Path(re.search(r"join with RAY_AUTH_TOKEN_PATH=(\S+);", out).group(1))
        assert token.stat().st_mode & 0o077 == 0 and len(token.read_text().strip()) == 64
        digest = ray_run_on_node1(f"{RAY_HEAD}:6379", "horovod", {"RAY_AUTH_TOKEN_PATH": str(token)})
    finally:
        cluster("ray-down", timeout=120)
    assert digest == mpirun_digest("horovod")
    assert not token.exists() and not (Path.home() / ".ray").exists()
    no_ray_left()


@contextlib.contextmanager
def users_ray_cluster(home: Path, port: int, auth: bool) -> Iterator[None]:
    """A Ray cluster started the way Ray's docs show: 'ray start --head' on node1, then 'ray start
    --address' on node2. With ``auth``, as Ray's token-authentication docs do: RAY_AUTH_MODE=token
    and 'ray get-auth-token --generate' (the token in ``home``/.ray/auth_token) first. Each
    'ray start --block' is stopped through its process group at the end."""
    ray = str(Path(sys.executable).parent / "ray")
    env = {"HOME": str(home), **({"RAY_AUTH_MODE": "token"} if auth else {})}
    if auth:
        subprocess.run([ray, "get-auth-token", "--generate"], env={**os.environ, **env}, check=True,
                       capture_output=True, timeout=120)
    procs: list[subprocess.Popen] = []
    logs = [home / f"ray-node{k}.log" for k in (1, 2)]
    temp = Path(tempfile.mkdtemp(prefix="hvk-ray-"))  # short: Ray's socket paths must fit 107 bytes
    try:
        for k, role in ((1, ["--head", "--port", str(port)]), (2, ["--address", f"{RAY_HEAD}:{port}"])):
            with logs[k - 1].open("w") as log:
                procs.append(subprocess.Popen(
                    [str(CLUSTER), "exec", f"node{k}", "--", "env", *[f"{a}={b}" for a, b in env.items()], ray,
                     "start", "--block", *role, "--node-ip-address", f"10.233.2.{k}", "--num-cpus", "2",
                     "--disable-usage-stats", "--temp-dir", str(temp / f"node{k}")],
                    stdout=log, stderr=subprocess.STDOUT, start_new_session=True))
            log, proc = logs[k - 1], procs[-1]
            wait_until(lambda: "Ray runtime started" in log.read_text() or proc.poll() is not None,  # noqa: B023
                       120, f"Ray to start on node{k}")
            assert procs[-1].poll() is None, logs[k - 1].read_text()[-2000:]
        yield
    finally:
        for proc in procs:
            stop_process_group(proc)
        shutil.rmtree(temp, ignore_errors=True)


@pytest.mark.timeout(900)  # measured 95 s on 2 cores
def test_hvdkit_joins_a_users_own_ray_cluster_with_and_without_token_authentication(tmp_path):
    """A user's own Ray cluster across two nodes, started as Ray's docs say, once without
    authentication and once with a token ('ray get-auth-token --generate', RAY_AUTH_MODE=token
    on every node). 'hvdkit run --launcher ray --ray-address' joins each the way it runs (the
    token from the user's ~/.ray/auth_token, or none) and ends on mpirun's digest on both
    backends; neither hvdkit nor the test leaves a token where there was none."""
    pytest.importorskip("ray")
    from hvdkit.environments import find_free_port

    expected = {backend: mpirun_digest(backend) for backend in ("ddp", "horovod")}
    for auth in (False, True):
        home = tmp_path / ("token" if auth else "open")
        home.mkdir()
        port = find_free_port("127.0.0.1")
        with users_ray_cluster(home, port, auth):
            for backend in ("ddp", "horovod"):
                assert ray_run_on_node1(f"{RAY_HEAD}:{port}", backend, {"HOME": str(home)}) == expected[backend]
        assert (home / ".ray" / "auth_token").exists() == auth  # only Ray's own --generate made one
    no_ray_left()


@pytest.mark.timeout(300)  # measured 8 s on 2 cores
def test_a_ray_step_that_exits_ends_the_ray_job_at_once_naming_the_node_and_rays_error(tmp_path):
    """hvdkit slurm --engine ray with the head's 'ray start' failing (its temp dir /tmp/ray-JOBID
    is taken by a file, made while the job was held): the job ends FAILED within 30 s of its
    release, not after the 300 s join timeout, with one line naming node1 and Ray's error."""
    pytest.importorskip("ray")
    script = render(tmp_path, "raydies", "-N", "2", "--tasks-per-node", "1", "--engine", "ray", "--backend", "ddp",
                    "--", *RAY_MLP)
    job = sbatch(script, tmp_path, "--hold")
    blocker = Path(f"/tmp/ray-{job}")
    blocker.write_text("not a directory\n")
    try:
        released = time.monotonic()
        subprocess.run(["scontrol", "release", job], check=True, timeout=30)
        assert wait_done(job, timeout=200) == "FAILED"
        assert time.monotonic() - released < 30
    finally:
        blocker.unlink()
    log = (tmp_path / f"raydies-{job}.out").read_text()
    errors = [line for line in log.splitlines() if line.startswith("Error:")]
    assert len(errors) == 1, log[-3000:]
    assert re.match(rf"Error: Ray on node1 exited before the cluster at {RAY_HEAD_IP_RE}:\d+ formed: "
                    rf"FileExistsError: \[Errno 17\] File exists: '/tmp/ray-{job}' \(its whole log: "
                    rf"ray-{job}-node1.out\)$", errors[0]), errors[0]
    assert "Traceback" not in log
    no_ray_left()


@pytest.mark.timeout(900)  # measured 70 s on 2 cores
def test_ray_sbatch_job_starts_ray_in_the_allocation_is_preempted_requeued_and_resumes_exactly(tmp_path):
    """hvdkit slurm --engine ray, submitted for real: Ray's head on the first node, a worker on
    the second, joined before training (polled); USR1 to the batch shell reaches every rank
    through 'hvdkit run', the ranks checkpoint and exit 75, the shell requeues the job, and the
    requeued job starts Ray again, resumes, and ends on the weights of a run never preempted."""
    pytest.importorskip("ray")
    train = ["--model", "mlp", "--epochs", "3", "--steps-per-epoch", "60", "--num-samples", "8192"]
    straight = subprocess.run([sys.executable, "-m", "hvdkit", "run", "-np", "2", "--backend", "ddp", "--", *train],
                              env=base_env(), capture_output=True, text=True, timeout=300)
    assert straight.returncode == 0, straight.stderr[-2000:]
    script = render(tmp_path, "rayjob", "-N", "2", "--tasks-per-node", "1", "--engine", "ray", "--backend", "ddp",
                    "--checkpoint-dir", str(tmp_path / "ck"), "--", *train,
                    "--metrics-file", str(tmp_path / "m.json"))
    text = script.read_text()
    assert "#SBATCH --signal=B:USR1@90" in text and "#SBATCH --ntasks-per-node=1" in text
    job = sbatch(script, tmp_path)
    log = tmp_path / f"rayjob-{job}.out"
    wait_for_text(log, "epoch 0 loss", job, timeout=240)
    subprocess.run(["scancel", "--signal=USR1", "--batch", job], check=True, timeout=30)
    assert wait_done(job, timeout=400, kick_requeued=True) == "COMPLETED"
    out = log.read_text()
    assert "[sbatch] Ray: 2 node(s) joined" in out and "requeueing job" in out, out[-3000:]
    stop = int(re.search(r"preempted at step (\d+) by SIGUSR1; checkpoint saved", out).group(1))
    assert re.search(rf"resumed from \S+ckpt-{stop:09d}\.h5 \(step {stop}\)", out), out[-2000:]
    assert "restart 1" in out and "Traceback" not in out
    m = read_metrics(tmp_path / "m.json")
    assert m["param_digest"] == re.search(r"digest=(\w+)", straight.stdout).group(1)
    assert {p["host"] for p in m["placement"]} == {"node1", "node2"}


@pytest.mark.timeout(900)  # measured 53 s on 2 cores
def test_ray_sweep_job_is_preempted_every_trial_checkpoints_and_the_requeued_job_resumes_the_experiment(tmp_path):
    """hvdkit sweep run --engine ray --slurm: one job starts Ray on two nodes and runs the Tune
    driver there, one trial per node. Both trials' ranks hold at step 90 until a signal arrives;
    USR1 to the batch shell reaches the driver, which makes each trial checkpoint and stop, saves
    the experiment and exits 75; the shell requeues the job, the requeued job restores the
    experiment, and each trial resumes from the checkpoint of the signal (not its last epoch)
    and ends on the weights of a run never preempted."""
    pytest.importorskip("ray")
    fixed = {"model": "mlp", "epochs": 3, "steps_per_epoch": 60, "num_samples": 8192}
    space = tmp_path / "space.yaml"
    space.write_text(f"metric: final_loss\nmode: min\nfixed: {fixed}\ngrid: {{lr: [0.01, 0.02]}}\n".replace("'", ""))
    out = tmp_path / "out"
    submit = subprocess.run([sys.executable, "-m", "hvdkit", "sweep", "run", str(space), "--engine", "ray", "--slurm",
                             "-N", "2", "-np", "1", "--parallel", "2", "--backend", "ddp", "--venv", VENV,
                             "--time", "10:00", "--out", str(out), "--no-wait"],
                            env=base_env(HVDKIT_HOLD="step:90", HVDKIT_HOLD_RELEASE="signal"),
                            capture_output=True, text=True, timeout=120)
    assert submit.returncode == 0, submit.stderr
    job = re.search(r"Submitted batch job (\d+)", submit.stdout).group(1)
    script = out / "sweep-ray.sbatch"
    lint = subprocess.run(["shellcheck", str(script)], capture_output=True, text=True, timeout=60)
    assert lint.returncode == 0, lint.stdout
    assert "#SBATCH --nodes=2" in script.read_text() and "--resume" in script.read_text()
    logs = [out / "trials" / f"trial-{t:03d}.log" for t in range(2)]
    deadline = time.time() + 300
    while not all(p.exists() and "holding at step 90" in p.read_text() for p in logs):
        assert time.time() < deadline and job_state(job) not in DONE_STATES, job_state(job)
        time.sleep(0.5)
    subprocess.run(["scancel", "--signal=USR1", "--batch", job], check=True, timeout=30)
    assert wait_done(job, timeout=500, kick_requeued=True) == "COMPLETED"
    text = (out / "logs" / f"hvdkit-sweep-{job}.out").read_text()
    for line in ("[sbatch] Ray: 2 node(s) joined", "tune: got SIGUSR1", "preempted (exit 75)",
                 "[sbatch] preempted: the trials checkpointed; requeueing", "restart 1"):
        assert line in text, text[-3000:]
    assert "Traceback" not in text
    rows = json.loads((out / "results.json").read_text())
    assert [(r["status"], r["epochs"]) for r in rows] == [("completed", 3)] * 2, rows
    hosts = set()
    for path in logs:
        log = path.read_text()
        hosts |= set(re.findall(r"ranks 0@(node\d)", log))
        stop = int(re.search(r"preempted at step (\d+) by SIGUSR1; checkpoint saved", log).group(1))
        assert f"its own newer checkpoint ckpt-{stop:09d}.h5" in log, log[-2000:]
        assert re.search(rf"resumed from \S+ckpt-{stop:09d}\.h5 \(step {stop}\)", log), log[-2000:]
    assert hosts == {"node1", "node2"}
    # a trial's ranks run in a Ray worker of one CPU: one OpenMP thread, as here
    straight = subprocess.run([sys.executable, "-m", "hvdkit", "run", "-np", "1", "--backend", "ddp", "--",
                               "--model", "mlp", "--epochs", "3", "--steps-per-epoch", "60", "--num-samples", "8192",
                               "--lr", "0.02"], env=base_env(OMP_NUM_THREADS="1"), capture_output=True, text=True,
                              timeout=300)
    assert straight.returncode == 0, straight.stderr[-2000:]
    resumed = json.loads((out / "results" / "ray-1.json").read_text())
    assert resumed["param_digest"] == re.search(r"digest=(\w+)", straight.stdout).group(1)


# ---------------------------------------------------------------------------------------------
# Links with a real speed: the fabric shaped with tc in every node, and measured
# ---------------------------------------------------------------------------------------------
LINK_RATE = 1e9 / 8  # 1gbit in bytes/s


def fabric_busbw(tmp_path: Path, name: str) -> float:
    """Median bus bandwidth (bytes/s) of a 64 MiB gloo allreduce between node1 and node2, over
    eth1 (3 timed repetitions after a warm-up)."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
    argv = [sys.executable, str(Path(__file__).resolve().parent / "workers" / "link_allreduce.py")]
    procs = [subprocess.Popen([str(CLUSTER), "exec", f"node{rank + 1}", "--", *argv, str(rank),
                               str(tmp_path / f"{name}.store"), "64", "3"],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                              start_new_session=True)
             for rank in (0, 1)]
    outs = []
    for proc in procs:
        try:
            outs.append(proc.communicate(timeout=240)[0])
        except subprocess.TimeoutExpired:
            for p in procs:
                os.killpg(p.pid, 9)
            raise
    assert all(p.returncode == 0 for p in procs), outs
    busbw = json.loads(outs[0].strip().splitlines()[-1])["busbw"]
    return sorted(busbw)[len(busbw) // 2]


def qdiscs(node: str) -> str:
    return cluster("exec", node, "--", "tc", "qdisc", "show", "dev", "eth1")


@pytest.mark.timeout(600)  # measured 30 s on 2 cores
def test_the_fabric_link_is_shaped_to_its_rate_and_unshaped_again(tmp_path):
    """`local-cluster.sh link 1gbit` puts a tbf qdisc on every node's eth1: a 64 MiB allreduce
    between the nodes then reaches 80-100% of 1 Gbit/s as bus bandwidth and never more; `link
    off` removes it (the same allreduce is then well above the rate)."""
    try:
        said = cluster("link", "1gbit")
        assert "fabric link: 1gbit" in said, said
        for node in ("node1", "node2"):
            assert "qdisc tbf" in qdiscs(node) and "rate 1Gbit" in qdiscs(node), qdiscs(node)
        assert (CLUSTER_STATE / "link").read_text().strip() == "1gbit"
        shaped = fabric_busbw(tmp_path, "shaped")
        print(f"1gbit link: busbw {shaped / 1e6:.1f} MB/s = {shaped / LINK_RATE:.0%} of the rate")
        assert 0.80 * LINK_RATE <= shaped <= 1.02 * LINK_RATE, shaped / LINK_RATE
    finally:
        cluster("link", "off")
    for node in ("node1", "node2"):
        assert "tbf" not in qdiscs(node), qdiscs(node)
    assert (CLUSTER_STATE / "link").read_text().strip() == "off"
    free = fabric_busbw(tmp_path, "unshaped")
    print(f"unshaped: busbw {free / 1e6:.1f} MB/s")
    assert free > 1.5 * LINK_RATE, free / LINK_RATE


@pytest.mark.parametrize("spec, says", [
    ("0gbit", "RATE '0gbit' is not a positive rate"),
    ("fast", "RATE 'fast' is not a positive rate"),
    ("1gbit,soon", "DELAY 'soon' is not a delay"),
])
def test_a_bad_link_is_refused_in_one_line_and_changes_nothing(spec, says):
    before = [qdiscs(n) for n in ("node1", "node2")]
    proc = subprocess.run([str(CLUSTER), "link", spec], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1 and says in proc.stderr and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert [qdiscs(n) for n in ("node1", "node2")] == before


def test_a_link_on_a_cluster_that_is_not_up_is_refused_in_one_line(tmp_path):
    env = {**os.environ, "HVDKIT_CLUSTER_STATE": str(tmp_path / "no-cluster")}
    proc = subprocess.run([str(CLUSTER), "link", "1gbit"], capture_output=True, text=True, timeout=60, env=env)
    assert proc.returncode == 1 and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert "the local cluster is not up" in proc.stderr and "up --link 1gbit" in proc.stderr


def test_a_link_delay_is_emulated_where_the_kernel_can_and_refused_in_one_line_where_not(tmp_path):
    """DELAY needs the netem qdisc; some kernels (this machine's) are built without it."""
    proc = subprocess.run([str(CLUSTER), "link", "1gbit,50us"], capture_output=True, text=True, timeout=60)
    try:
        if proc.returncode == 0:
            assert "netem" in qdiscs("node1") and "tbf" in qdiscs("node1"), qdiscs("node1")
        else:
            assert proc.returncode == 1 and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
            assert "this kernel has no netem qdisc (sch_netem)" in proc.stderr and "--link 1gbit" in proc.stderr
            assert "tbf" not in qdiscs("node1")
    finally:
        cluster("link", "off")
