"""Horovod Elastic as a mode of the one training loop: real data, durable checkpoints, same behaviour.

Every run here is a real ``hvdkit run`` (horovodrun, Gloo controller, 2 ranks on this machine);
"hosts" are names for this machine in the discovery script.
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import time
from pathlib import Path

import pytest
import torch

from helpers import HVDKIT, PY, base_env, elastic_one_host, kill_job, spawn
from hvdkit.checkpoint import read_checkpoint
from hvdkit.data import make_synthetic_h5
from hvdkit.samplelog import read_sample_log


def _discovery(tmp_path: Path, hosts: str) -> tuple[Path, Path]:
    listing = tmp_path / "hosts"
    listing.write_text(hosts)
    script = tmp_path / "discover.sh"
    script.write_text(f"#!/bin/sh\ncat '{listing}'\n")
    script.chmod(0o755)
    return listing, script


def _elastic(script: Path, np: int = 2, min_np: int = 1) -> list[str]:
    return [*HVDKIT, "run", "--elastic", "-np", str(np), "--min-np", str(min_np), "--max-np", str(np),
            "--host-discovery-script", str(script)]


def _follow(proc, deadline_s: float, on_line=None) -> str:
    """All of ``proc``'s output; ``on_line(line)`` sees each line as it comes."""
    log, deadline = [], time.time() + deadline_s
    for line in proc.stdout:
        log.append(line)
        assert time.time() < deadline, "run did not finish in time:\n" + "".join(log)[-3000:]
        if on_line is not None:
            on_line(line)
    proc.wait(timeout=60)
    return "".join(log)


def _rank_pids(line: str) -> dict[int, int] | None:
    m = re.search(r"ranks ((?:\d+@\S+:\d+ ?)+)$", line.strip())
    return {int(r): int(p) for r, p in re.findall(r"(\d+)@\S+:(\d+)", m.group(1))} if m else None


def _done(text: str) -> re.Match:
    done = re.search(r"done: backend=horovod world=(\d) final_loss=(\S+) steps=(\d+) "
                     r"params_identical_on_all_ranks=True digest=(\w+)", text)
    assert done, text[-3000:]
    return done


def implied_steps(segments, epochs=8, samples_per_epoch=2048, batch=32):
    """Optimizer steps the run must take if it resumed at each committed step with that world size."""
    samples = step = epoch = 0
    while epoch < epochs:
        world = next(w for w, start in reversed(segments) if step >= start)
        if samples + batch * world > samples_per_epoch:  # drop-last: the epoch is over
            samples, epoch = 0, epoch + 1
            continue
        samples += batch * world
        step += 1
    return step


@pytest.mark.mp
@pytest.mark.timeout(300)  # measured 12 s (2 cores, loaded)
def test_elastic_on_real_data_shrinks_and_grows_and_sees_every_sample_once_per_epoch(tmp_path):
    data = make_synthetic_h5(tmp_path / "train.h5", "mlp", 2048, seed=5)
    hosts, script = _discovery(tmp_path, "localhost:1\n127.0.0.1:1\n")
    argv = [*_elastic(script), "--commit-every", "4", "--model", "mlp", "--epochs", "5",
            "--data", str(data), "--sample-log", str(tmp_path / "samples.jsonl"), "--log-every", "1"]
    proc = spawn(argv, cwd=tmp_path)
    pids, phase = {}, [0]

    def on_line(line: str) -> None:
        m = re.search(r"elastic worker rank \d+ of \d+ \(local \d+\) host (\S+) pid (\d+)", line)
        if m:
            pids[m.group(1)] = int(m.group(2))
        if phase[0] == 0 and "commit at step 12 " in line:
            # the host's only worker dies mid-epoch: all its workers failed, so the driver
            # blacklists it and goes on with one (kill first: unlisting it first would let the
            # driver stop that worker itself if a discovery poll fell in between)
            os.kill(pids["127.0.0.1"], signal.SIGKILL)
            hosts.write_text("localhost:1\n")
            phase[0] = 1
        elif phase[0] == 1 and "reset: rank 0 of 1" in line:
            hosts.write_text(f"localhost:1\n{socket.gethostname()}:1\n")  # a worker comes back
            phase[0] = 2

    try:
        text = _follow(proc, 240, on_line)
    finally:
        kill_job(proc)
    assert proc.returncode == 0 and phase[0] == 2, text[-4000:]

    # What the commits imply: world size per step range, 2048 samples per epoch, 32 per rank.
    commits = [int(c) for c in re.findall(r"commit at step (\d+) ", text)]
    resets = [(int(w), int(s)) for w, s in re.findall(r"reset: rank 0 of (\d) .*?committed step (\d+)", text)]
    assert [w for w, _ in resets] == [1, 2], resets
    for _, step in resets:  # every reset continued exactly at a step that had been committed ...
        assert step in commits, (step, commits)
    before_kill = commits[:commits.index(resets[0][1]) + 1]
    assert resets[0][1] == max(before_kill)  # ... the newest one: no committed step was lost
    assert re.search(r"committed step \d+ at sample \d+ of epoch \d's order", text)  # where it goes on
    done = _done(text)
    assert int(done.group(1)) == 2
    assert int(done.group(3)) == implied_steps([(2, 0), *resets], epochs=5)

    # Every sample of every epoch was trained on exactly once, whatever the world did.
    records = read_sample_log(tmp_path / "samples.jsonl")
    assert {r["world"] for r in records} == {1, 2}
    for epoch in range(5):
        ids = [i for r in records if r["epoch"] == epoch for i in r["ids"]]
        assert sorted(ids) == list(range(2048)), f"epoch {epoch}: {len(ids)} ids, {len(set(ids))} distinct"
    assert records[-1]["step"] == int(done.group(3))


@pytest.mark.mp
@pytest.mark.timeout(300)  # measured 16 s (2 cores, loaded)
def test_one_host_with_two_slots_starts_at_once_shrinks_and_grows(tmp_path):
    """Discovery 'localhost:2': one machine, several slots (one node, several GPUs). horovodrun
    waited silently for a second host before hvdkit gave it the interface, and blacklisted a
    whole host for one killed worker, which ended a one-host job instead of replacing it."""
    text, resets, first = elastic_one_host(tmp_path, "localhost")
    assert first < 60, first  # not Horovod's silent 600 s wait for a second host
    assert [w for w, _ in resets] == [2, 1, 2], resets
    done = _done(text)
    assert int(done.group(1)) == 2
    records = read_sample_log(tmp_path / "samples.jsonl")
    assert {r["world"] for r in records} == {1, 2}
    for epoch in range(8):  # every sample once per epoch, through the death, the shrink, the growth
        ids = [i for r in records if r["epoch"] == epoch for i in r["ids"]]
        assert sorted(ids) == list(range(2048)), f"epoch {epoch}"


COMMON = ["--model", "tiny", "--num-samples", "1024", "--batch-size", "32", "--lr", "0.05",
          "--warmup-epochs", "0.5", "--commit-every", "2", "--log-every", "1"]
SLOW = ["--model", "cnn"]  # steps long enough that a signal sent before the first lands before step 11


@pytest.mark.mp
@pytest.mark.timeout(300)  # measured 13 s (2 cores, loaded)
def test_a_killed_elastic_job_resumes_from_its_checkpoint_and_ends_like_a_plain_run(tmp_path):
    """Kill every worker and the launcher mid-run; the rerun resumes from the last HDF5
    checkpoint and ends with the same loss and weights as an uninterrupted plain run."""
    _, script = _discovery(tmp_path, "localhost:1\n127.0.0.1:1\n")
    ckpts = tmp_path / "ck"
    args = [*COMMON, "--epochs", "2", "--checkpoint-dir", str(ckpts), "--checkpoint-every", "5"]
    first = spawn([*_elastic(script, min_np=2), *args], cwd=tmp_path)
    killed = []

    def on_line(line: str) -> None:
        if not killed and re.search(r"\bstep (1[89]|2[0-5]) loss", line):
            kill_job(first, wait=False)  # the whole job: the launcher and every worker
            killed.append(line)

    try:
        _follow(first, 120, on_line)
    finally:
        kill_job(first)
    assert killed, "the first run ended before it could be killed"
    newest = max(int(p.name[5:14]) for p in ckpts.glob("ckpt-*.h5"))
    assert 16 <= newest < 32  # saved every 5 steps and at the end of epoch 0 (step 16)

    rerun = spawn([*_elastic(script, min_np=2), *args], cwd=tmp_path)
    try:
        text = _follow(rerun, 120)
    finally:
        kill_job(rerun)
    assert rerun.returncode == 0, text[-3000:]
    assert re.search(rf"resumed from \S+ckpt-{newest:09d}\.h5 \(step {newest}\)", text), text[-3000:]
    assert f"start step {newest}," in text

    plain = subprocess.run([*HVDKIT, "run", "-np", "2", "--backend", "horovod", "--", *COMMON,
                            "--epochs", "2", "--backend", "horovod"],
                           env=base_env(), cwd=tmp_path, text=True, capture_output=True, timeout=120)
    assert plain.returncode == 0, plain.stdout[-2000:] + plain.stderr[-2000:]
    resumed, straight = _done(text), _done(plain.stdout)
    assert resumed.group(2, 3, 4) == straight.group(2, 3, 4)  # final loss, steps, weights


@pytest.fixture(scope="module")
def uninterrupted_step_11(tmp_path_factory):
    """Checkpoint 11 of a plain run that nothing interrupted."""
    tmp = tmp_path_factory.mktemp("straight")
    proc = subprocess.run([*HVDKIT, "run", "-np", "2", "--backend", "horovod", "--", *COMMON, *SLOW,
                           "--backend", "horovod", "--epochs", "2", "--max-steps", "11",
                           "--checkpoint-dir", str(tmp / "ck"), "--checkpoint-every", "4"],
                          env=base_env(), cwd=tmp, text=True, capture_output=True, timeout=120)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    return read_checkpoint(tmp / "ck" / "ckpt-000000011.h5")


@pytest.mark.mp
@pytest.mark.timeout(300)  # measured 17 s (2 cores, loaded)
@pytest.mark.parametrize("mode", ["plain", "elastic"])
def test_preemption_max_steps_checkpoints_and_schedule_behave_alike(tmp_path, mode, uninterrupted_step_11):
    """SIGUSR1 to rank 1 stops both ranks at one step with a checkpoint; the rerun resumes there,
    checkpoints every 4 steps, stops at --max-steps with the LR schedule and weights of a run
    that was never interrupted.

    The signal goes out when the start line names rank 1's PID, just before the first step:
    wherever it lands (before the loop, it is remembered), the ranks stop at the next step.
    Sending it at a later step raced the run's end on a loaded machine (the console reaches
    the test late), and a USR1 after the loop used to kill the rank (exit 138)."""
    _, script = _discovery(tmp_path, "localhost:1\n127.0.0.1:1\n")
    launch = _elastic(script, min_np=2) if mode == "elastic" else \
        [*HVDKIT, "run", "-np", "2", "--backend", "horovod", "--", "--backend", "horovod"]
    ckpts = tmp_path / "ck"
    argv = [*launch, *COMMON, *SLOW, "--epochs", "2", "--max-steps", "11", "--checkpoint-dir", str(ckpts),
            "--checkpoint-every", "4"]
    first, pids, sent = spawn(argv, cwd=tmp_path), {}, []

    def on_line(line: str) -> None:
        pids.update(_rank_pids(line) or {})
        if not sent and 1 in pids:
            os.kill(pids[1], signal.SIGUSR1)
            sent.append(line)

    try:
        text = _follow(first, 120, on_line)
    finally:
        kill_job(first)
    stopped = re.search(r"preempted at step (\d+) by SIGUSR1; checkpoint saved", text)
    assert sent and stopped, text[-3000:]
    at = int(stopped.group(1))
    assert 1 <= at < 11 and first.returncode != 0  # unfinished work must not look finished
    saved = sorted({s for s in (4, 8) if s < at} | {at})[-3:]  # every 4 steps and at the signal; keep 3
    assert sorted(p.name for p in ckpts.glob("ckpt-*.h5")) == [f"ckpt-{s:09d}.h5" for s in saved]

    second = spawn(argv, cwd=tmp_path)
    try:
        text = _follow(second, 120)
    finally:
        kill_job(second)
    assert second.returncode == 0, text[-3000:]
    assert f"start step {at}," in text and "stopped at max_steps=11; checkpoint saved" in text
    # keep 3: the newest three of those, 4, 8 and the last step
    kept = sorted({*saved, 4, 8, 11})[-3:]
    assert sorted(p.name for p in ckpts.glob("ckpt-*.h5")) == [f"ckpt-{s:09d}.h5" for s in kept]
    last, reference = read_checkpoint(ckpts / "ckpt-000000011.h5"), uninterrupted_step_11
    assert last["loop"]["global_step"] == 11 and last["scheduler"]["last_epoch"] == 11
    assert last["scheduler"]["base_lrs"] == reference["scheduler"]["base_lrs"]
    assert last["optimizer"]["param_groups"][0]["lr"] == reference["optimizer"]["param_groups"][0]["lr"]
    for name, tensor in reference["model"].items():
        assert torch.equal(last["model"][name], tensor), name


def test_the_stop_file_counts_as_sigusr1(tmp_path):
    """How an elastic sbatch job's batch shell tells ranks that no Slurm signal can reach."""
    from hvdkit.preemption import PreemptionGuard

    stop = tmp_path / "stop"
    with PreemptionGuard(stop_file=str(stop)) as guard:
        assert not guard.requested
        stop.touch()
        time.sleep(1.1)  # looked for at most once a second
        assert guard.requested and guard.should_requeue


def test_a_usr1_outside_the_loop_is_remembered_not_fatal():
    """Slurm's USR1 comes at a fixed time whatever the run is doing: during set-up it must
    stop the run at its first step, after the last step it must not kill the process."""
    code = (
        "import os, signal\n"
        "from hvdkit.preemption import PreemptionGuard, catch_early\n"
        "catch_early()\n"
        "os.kill(os.getpid(), signal.SIGUSR1)\n"          # set-up: no guard yet
        "with PreemptionGuard() as guard:\n"
        "    assert guard.requested and guard.should_requeue\n"
        "os.kill(os.getpid(), signal.SIGUSR1)\n"          # after the loop
        "print('alive')\n"
    )
    proc = subprocess.run([PY, "-c", code], env=base_env(), capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and proc.stdout == "alive\n", (proc.returncode, proc.stderr)
