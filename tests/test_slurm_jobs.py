"""Generated scripts submitted to the real local Slurm (slurmctld + slurmd + munge).

scripts/test.sh starts the cluster (scripts/local-cluster.sh up) before pytest.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import time

import pytest
from click.testing import CliRunner

from helpers import VENV, final_loss, job_state, render, sbatch, wait_done
from hvdkit.cli import cli

pytestmark = [pytest.mark.slurm]
TRAIN = ["--model", "cnn", "--epochs", "3", "--num-samples", "1024", "--batch-size", "32"]


@pytest.fixture(scope="module", autouse=True)
def slurm_up():
    ok = shutil.which("sbatch") and subprocess.run(["sinfo", "-h"], capture_output=True).returncode == 0
    assert ok, "local Slurm is not running: run scripts/local-cluster.sh up (scripts/test.sh does)"


@pytest.fixture(scope="module")
def reference_losses(tmp_path_factory):
    """One uninterrupted 2-task run per backend, submitted for real; losses keyed by backend."""
    tmp = tmp_path_factory.mktemp("ref")
    jobs = {b: sbatch(render(tmp, f"ref-{b}", "--backend", b, "--tasks-per-node", "2", "--", *TRAIN), tmp)
            for b in ("ddp", "horovod")}
    logs = {}
    for backend, job in jobs.items():
        assert wait_done(job) == "COMPLETED", (tmp / f"ref-{backend}-{job}.out").read_text()
        logs[backend] = (tmp / f"ref-{backend}-{job}.out").read_text()
    return logs


@pytest.mark.timeout(400)  # measured 10 s (2 cores, loaded)
@pytest.mark.parametrize("backend", ["ddp", "horovod"])
def test_two_task_training_completes(reference_losses, backend):
    log = reference_losses[backend]
    assert "[sbatch] job" in log and "2 tasks" in log
    assert f"backend={backend} world=2" in log
    ranks = re.search(r" ranks=(.*)$", log, re.M).group(1).split()
    assert sorted(r.split("@")[0] for r in ranks) == ["0", "1"]   # both ranks took part
    assert "params_identical_on_all_ranks=True" in log
    loss = final_loss(log)
    assert 0 < loss < 2.31  # below the ~2.303 of chance on 10 classes: it learned


@pytest.mark.timeout(300)  # its runs are the reference_losses fixture's: measured 10 s (2 cores, loaded)
def test_horovod_and_ddp_agree(reference_losses):
    assert final_loss(reference_losses["ddp"]) == final_loss(reference_losses["horovod"])


@pytest.mark.timeout(400)  # measured 22 s (2 cores, loaded)
@pytest.mark.parametrize("who", ["steps", "full", "batch", "usr2", "zero", "fsdp", "zero3"])
def test_sigusr1_checkpoints_requeues_and_resumes(tmp_path, reference_losses, who):
    """scancel --signal=USR1 reaches the steps; --full also, --batch only, the batch shell (which traps it).
    USR2 (what sites pick when USR1 clashes; the script forwards it too) acts like USR1. Sharded
    runs (Horovod's ZeRO-1/2 and ZeRO-3, DDP's FSDP2) are preempted and resumed the same way; at 2
    ranks they end on the unsharded run's loss."""
    backend, shard = {"zero": ("horovod", "optimizer"), "fsdp": ("ddp", "full"),
                      "zero3": ("horovod", "full")}.get(who, ("ddp", "none"))
    # both ranks wait before step 20 until the signal has reached them (hvdkit.faults): it
    # lands mid-run whatever the machine's load, never after the last step
    script = render(tmp_path, "preempt", "--backend", backend, "--tasks-per-node", "2",
                    "--env", "HVDKIT_HOLD=step:20", "--env", "HVDKIT_HOLD_RELEASE=signal",
                    "--checkpoint-dir", str(tmp_path / "ck"), "--", *TRAIN, "--shard", shard)
    job = sbatch(script, tmp_path)
    log_path = tmp_path / f"preempt-{job}.out"
    deadline = time.time() + 120
    while (log_path.read_text() if log_path.exists() else "").count("holding at step 20 ") < 2:
        assert time.time() < deadline and job_state(job) in ("PENDING", "RUNNING"), "job never trained"
        time.sleep(0.2)
    # what Slurm does --signal=USR1@90 seconds before the time limit
    sig = "USR2" if who == "usr2" else "USR1"
    subprocess.run(["scancel", f"--signal={sig}", *({"full": ["--full"], "batch": ["--batch"]}.get(who, [])),
                    job], check=True, timeout=30)
    assert wait_done(job, kick_requeued=True) == "COMPLETED"
    log = log_path.read_text()
    assert re.search(rf"preempted at step 2[01] by SIG{sig}; checkpoint saved; requeued Slurm job", log), log
    assert "restart 1" in log and re.search(r"resumed from .*ckpt-\d+\.h5", log)
    assert "Traceback" not in log, log  # Slurm kills the step's other ranks at the requeue: no error
    assert ("[sbatch] got SIGUSR1, passing it to the training step" in log) == (who in ("full", "batch"))
    assert final_loss(log) == final_loss(reference_losses["ddp"])  # nothing lost, nothing repeated


@pytest.mark.timeout(400)  # measured 16 s (2 cores, loaded)
def test_job_array_runs_three_hyperparameter_sets(tmp_path):
    params = tmp_path / "params.txt"
    params.write_text("--lr 0.005\n--lr 0.02 --momentum 0.5\n--lr 0.05 --optimizer adam\n")
    script = render(tmp_path, "sweep", "--backend", "ddp", "--tasks-per-node", "2", "--array", "0-2",
                    "--array-params", str(params), "--results-dir", str(tmp_path / "results"),
                    "--output", str(tmp_path / "sweep-%A_%a.out"),
                    "--", "--model", "mlp", "--epochs", "1", "--num-samples", "512")
    job = sbatch(script, tmp_path)
    for task in range(3):
        assert wait_done(f"{job}_{task}") == "COMPLETED", list(tmp_path.iterdir())
    results = sorted((tmp_path / "results").glob("*.json"))
    assert len(results) == 3
    configs = [json.loads(p.read_text())["config"] for p in results]
    assert sorted((c["lr"], c["optimizer"]) for c in configs) == [(0.005, "sgd"), (0.02, "sgd"), (0.05, "adam")]
    losses = {json.loads(p.read_text())["final_loss"] for p in results}
    assert len(losses) == 3


@pytest.mark.timeout(300)  # measured 6 s (2 cores, loaded)
def test_submit_flag_prints_job_id(tmp_path):
    result = CliRunner().invoke(cli, ["slurm", "--backend", "ddp", "--venv", VENV, "--time", "5:00",
                                      "--output", str(tmp_path / "s-%j.out"), "--submit",
                                      "--", "--model", "tiny", "--epochs", "1", "--num-samples", "64"])
    assert result.exit_code == 0, result.output
    job = re.search(r"Submitted batch job (\d+)", result.output).group(1)
    assert wait_done(job) == "COMPLETED"
    assert "done: backend=ddp world=1" in (tmp_path / f"s-{job}.out").read_text()
