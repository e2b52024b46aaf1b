"""Resume on every rank: bitwise-equal continuation, crash-safe writes, only rank 0 writes."""

from __future__ import annotations

import os
import re
import select
import signal
import subprocess
import time
from pathlib import Path

import pytest

from helpers import HVDKIT, PY, WORKERS, assert_tree_equal, base_env, check, launch, launch_metrics, read_metrics
from hvdkit.checkpoint import read_checkpoint, verify_checkpoint
from hvdkit.launch.local import MPIRUN_BASE

TRAIN = ["train", "--model", "mlp", "--epochs", "2", "--steps-per-epoch", "6", "--num-samples", "512",
         "--optimizer", "adam", "--batch-size", "16"]
BACKENDS = [("horovod", "hvd-gloo"), ("ddp", "mpirun")]


@pytest.mark.mp
@pytest.mark.timeout(400)  # measured 21 s (2 cores, loaded)
@pytest.mark.parametrize("backend,kind", BACKENDS)
def test_interrupted_run_equals_uninterrupted_bitwise(tmp_path, backend, kind):
    args = [*HVDKIT, *TRAIN, "--backend", backend]
    straight, _ = launch_metrics(kind, 2, [*args, "--checkpoint-dir", str(tmp_path / "a")], tmp_path / "a.json")
    first = check(launch(kind, 2, [*args, "--checkpoint-dir", str(tmp_path / "b"), "--max-steps", "4"]))
    assert "stopped at max_steps=4" in first
    second, _ = launch_metrics(kind, 2, [*args, "--checkpoint-dir", str(tmp_path / "b")], tmp_path / "b.json")
    assert second["start_step"] == 4 and second["resumed_from"] == str(tmp_path / "b" / "ckpt-000000004.h5")
    assert straight["final_loss"] == second["final_loss"] and second["global_step"] == 12
    a = read_checkpoint(tmp_path / "a" / "ckpt-000000012.h5")
    b = read_checkpoint(tmp_path / "b" / "ckpt-000000012.h5")
    assert_tree_equal(a["model"], b["model"])            # parameters bitwise equal
    assert_tree_equal(a["optimizer"], b["optimizer"])    # Adam moments and step counts too
    assert_tree_equal(a["scheduler"], b["scheduler"])
    timing = ("samples_per_sec", "comm_wait")  # measured, so they differ; everything else is the same
    for loop in (a["loop"], b["loop"]):
        loop["history"] = [{k: v for k, v in r.items() if k not in timing} for r in loop["history"]]
    assert a["loop"] == b["loop"]


@pytest.mark.mp
@pytest.mark.timeout(300)  # measured 16 s (2 cores, loaded)
def test_resume_with_a_different_world_size(tmp_path):
    ckpt = str(tmp_path / "c")
    args = [*HVDKIT, "train", "--model", "mlp", "--epochs", "2", "--num-samples", "1024",
            "--batch-size", "32", "--checkpoint-dir", ckpt]
    check(launch("mpirun", 2, [*args, "--backend", "ddp", "--max-steps", "4"]))
    # 4 steps at np=2 consumed 256 samples of epoch 0; at np=1 the rest of epoch 0 is
    # (1024-256)/32 = 24 steps, epoch 1 is 32: 60 steps in all.
    metrics = tmp_path / "one.json"
    proc = subprocess.run([*args, "--backend", "local", "--metrics-file", str(metrics)], env=base_env(),
                          capture_output=True, text=True, timeout=200)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    one = read_metrics(metrics)
    assert one["start_step"] == 4 and one["global_step"] == 60 and one["world_size"] == 1


def mpmd(program: list[str], dirs: list[Path]) -> list[str]:
    """mpirun with one working directory per rank: rank r runs in dirs[r]."""
    argv = ["mpirun", *MPIRUN_BASE, "-x", "PYTHONPATH", "-x", "PATH"]
    for i, d in enumerate(dirs):
        argv += (([":"] if i else []) + ["-np", "1", "-wdir", str(d), *program])
    return argv


@pytest.mark.mp
@pytest.mark.timeout(300)  # measured 5 s (2 cores, loaded)
@pytest.mark.parametrize("backend", ["horovod", "ddp"])
def test_only_rank_zero_creates_files(tmp_path, backend):
    dirs = [tmp_path / "rank0", tmp_path / "rank1"]
    for d in dirs:
        d.mkdir()
    # relative paths: whatever a rank writes lands in its own working directory
    program = [*HVDKIT, "train", "--backend", backend, "--model", "tiny", "--epochs", "2",
               "--num-samples", "256", "--checkpoint-dir", "ckpt", "--checkpoint-every", "3",
               "--metrics-file", "metrics.json"]
    proc = subprocess.run(mpmd(program, dirs), env=base_env(), capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert read_metrics(dirs[0] / "metrics.json")["params_identical"] is True
    made = sorted(str(p.relative_to(dirs[0])) for p in dirs[0].rglob("*"))
    assert "metrics.json" in made and "ckpt/latest" in made
    assert any(m.startswith("ckpt/ckpt-") for m in made)
    assert list(dirs[1].rglob("*")) == [], "rank 1 created files"


def _read_until_holding(proc: subprocess.Popen, seconds: float) -> tuple[int, int]:
    """Rank 0's PID and the last step it saved, once it holds half-way through writing the
    next checkpoint (``HVDKIT_HOLD=checkpoint-write:2``, hvdkit.faults), read within ``seconds``.

    The output is searched, not split into lines: mpirun forwards each rank's output as it
    comes, so one rank's line can run into another's ("rank 1 pid 7rank 0 pid 6"). select()
    keeps the deadline even while the job prints nothing.
    """
    seen = ""
    deadline = time.monotonic() + seconds
    fd = proc.stdout.fileno()
    while True:
        pid, saved = re.search(r"rank 0 pid (\d+)", seen), re.findall(r"saved (\d+)", seen)
        if pid and saved and "holding at checkpoint-write 2 " in seen:
            return int(pid.group(1)), int(saved[-1])
        left = deadline - time.monotonic()
        assert left > 0, f"writer did not hold in its second save within {seconds:.0f} s:\n{seen}"
        if select.select([fd], [], [], min(left, 1.0))[0]:
            chunk = os.read(fd, 65536)
            assert chunk, f"writer exited before holding (rc={proc.wait()}):\n{seen}"
            seen += chunk.decode(errors="replace")


@pytest.mark.mp
@pytest.mark.timeout(400)  # measured 25 s (2 cores, loaded)
def test_sigkill_rank0_mid_write_never_loses_the_previous_checkpoint(tmp_path):
    """Rank 0 is killed while half of a checkpoint's bytes are written, twice in a row: the
    fault lands mid-write by construction (a hold point), not by a timer's luck."""
    directory = tmp_path / "ck"
    env = {**base_env(), "HVDKIT_HOLD": "checkpoint-write:2"}  # no release: held until killed
    for _ in range(2):
        argv = ["mpirun", "-np", "2", *MPIRUN_BASE, "-x", "PYTHONPATH", "-x", "HVDKIT_HOLD", PY,
                str(WORKERS / "ckpt_writer.py"), "ddp", str(directory), "save"]
        proc = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                start_new_session=True)
        try:
            rank0_pid, last_saved = _read_until_holding(proc, 150)
            partial = list(directory.glob(f".ckpt-*.tmp{rank0_pid}"))  # this writer's, half written
            assert len(partial) == 1 and partial[0].stat().st_size > 0, list(directory.iterdir())
            os.kill(rank0_pid, signal.SIGKILL)
        finally:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)
        # every complete-named file is valid, and there is at least the one we saw saved
        complete = sorted(directory.glob("ckpt-*.h5"))
        assert complete, "no checkpoint survived"
        for path in complete:
            assert verify_checkpoint(path)[0], path
        assert int(complete[-1].name[5:14]) == last_saved  # the half-written one never counts
    # and a 2-rank job resumes from the newest valid one on every rank
    out = check(launch("mpirun", 2, [PY, str(WORKERS / "ckpt_writer.py"), "ddp", str(directory), "restore"]))
    # searched, not split into lines: the two ranks' lines may run into each other
    steps = re.findall(r"rank (\d) restored step (\d+) value (\d+\.\d+)", out)
    assert len(steps) == 2 and steps[0][1:] == steps[1][1:], out
    assert float(steps[0][2]) == float(steps[0][1]), out  # weights match the step they were saved at


def test_a_step_is_checkpointed_once_when_an_epoch_ends_on_checkpoint_every(tmp_path, monkeypatch):
    """6 steps per epoch, --checkpoint-every 3: steps 3, 6, 9, 12 are each written once."""
    import hvdkit.checkpoint.manager as ckmod
    from hvdkit.cli.train_cmd import build_train_config, train_command
    from hvdkit.loop import train

    written: list[str] = []
    real = ckmod.write_checkpoint
    monkeypatch.setattr(ckmod, "write_checkpoint",
                        lambda path, snap, **kw: written.append(path.name) or real(path, snap, **kw))
    ctx = train_command.make_context("train", ["--backend", "local", "--model", "tiny", "--epochs", "2",
                                               "--steps-per-epoch", "6",
                                               "--num-samples", "256", "--batch-size", "8",
                                               "--checkpoint-dir", str(tmp_path), "--checkpoint-every", "3",
                                               "--keep-checkpoints", "10"])
    result = train(build_train_config(ctx.params))
    assert result.global_step == 12
    assert written == [f"ckpt-{s:09d}.h5" for s in (3, 6, 9, 12)]
    loop = read_checkpoint(tmp_path / "ckpt-000000006.h5")["loop"]  # the epoch-end one
    assert (loop["epoch"], loop["samples_in_epoch"]) == (1, 0)
