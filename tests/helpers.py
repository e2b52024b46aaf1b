"""Everything tests share, in one importable module (``from helpers import ...``).

Process launching with every launcher hvdkit supports, data and checkpoint helpers, and
the Slurm helpers for the real local cluster. Test groups are pytest markers: unmarked
tests are unit tests (``pytest -m "not mp and not slurm"``, a few minutes: some
run the CLI as a subprocess), ``mp``
launches real multi-process jobs, ``slurm`` submits to the local cluster, ``multinode``
runs across its namespaced nodes.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from click.testing import CliRunner

from hvdkit import build_model
from hvdkit.cli import cli
from hvdkit.launch.local import LocalLaunch, build_local_command, root_mpi_env

ROOT = Path(__file__).resolve().parents[1]
WORKERS = Path(__file__).resolve().parent / "workers"
PY = sys.executable
HVDKIT = [PY, "-m", "hvdkit"]

LAUNCH_KINDS = ("hvd-gloo", "hvd-mpi", "mpirun", "slurm-sim")


def base_env(**extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env.update(root_mpi_env())
    env["PYTHONUNBUFFERED"] = "1"
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    for var in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK"):
        env.pop(var, None)
    for var in [k for k in env if k.startswith(("SLURM_", "OMPI_COMM_WORLD", "PMI_", "HOROVOD_"))]:
        env.pop(var)
    env.update(extra)
    return env


def _run_group(argvs: list[list[str]], envs: list[dict[str, str]], timeout: float,
               cwd: Path | None) -> subprocess.CompletedProcess:
    """Start each argv in its own process group; on timeout kill the groups (no orphans)."""
    procs = [subprocess.Popen(a, env=e, cwd=cwd, text=True, start_new_session=True,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
             for a, e in zip(argvs, envs)]
    outputs, codes = [], []
    try:
        for p in procs:
            out, _ = p.communicate(timeout=timeout)
            outputs.append(out)
            codes.append(p.returncode)
    finally:
        for p in procs:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    code = next((c for c in codes if c != 0), 0)
    return subprocess.CompletedProcess(argvs[0], code, "".join(outputs), "")


def launch(kind: str, np: int, program: Sequence[str], timeout: float = 180,
           env: dict[str, str] | None = None, cwd: Path | None = None) -> subprocess.CompletedProcess:
    """Run ``program`` on ``np`` ranks with launcher ``kind`` and return the finished process.

    ``slurm-sim`` starts the ranks as plain processes with the variables srun
    would set (SLURM_PROCID, SLURM_NTASKS, SLURM_LOCALID, SLURM_JOB_NODELIST...).
    Every launch runs in its own process group, killed whole when the test ends.
    """
    full_env = base_env(**(env or {}))
    if kind == "slurm-sim":
        envs = [dict(full_env, SLURM_JOB_ID="4242", SLURM_STEP_ID="0", SLURM_PROCID=str(rank),
                     SLURM_NTASKS=str(np), SLURM_LOCALID=str(rank),
                     SLURM_JOB_NODELIST="localhost", SLURM_NODEID="0") for rank in range(np)]
        return _run_group([list(program)] * np, envs, timeout, cwd)
    launcher, controller = {"hvd-gloo": ("horovodrun", "gloo"), "hvd-mpi": ("horovodrun", "mpi"),
                            "mpirun": ("mpirun", "gloo")}[kind]
    argv, extra = build_local_command(LocalLaunch(np=np, launcher=launcher, controller=controller),
                                      program, full_env)
    full_env.update(extra)
    return _run_group([argv], [full_env], timeout, cwd)


def check(proc: subprocess.CompletedProcess) -> str:
    """Assert success, showing the job's output when it failed."""
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout[-6000:]}"
    return proc.stdout


def bit_rotten_dataset(path: Path, bad_sample: int, num_samples: int = 256) -> Path:
    """A 'tiny' dataset whose sample ``bad_sample`` fails its Fletcher-32 check when read.

    Everything else reads fine and the up-front data check (keys, shapes, labels)
    passes, so the one rank whose shard holds that sample fails mid-training.
    """
    import h5py

    from hvdkit.data import make_synthetic_h5

    clean = make_synthetic_h5(path.with_suffix(".clean.h5"), "tiny", num_samples)
    with h5py.File(clean, "r") as src, h5py.File(path, "w") as dst:
        dst.create_dataset("x", data=src["x"][()], chunks=(1, 8), fletcher32=True)
        dst["y"] = src["y"][()]
    clean.unlink()
    with h5py.File(path, "r") as f:
        offset = f["x"].id.get_chunk_info_by_coord((bad_sample, 0)).byte_offset + 5
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x10
    path.write_bytes(bytes(data))
    return path


# -- checkpoints ---------------------------------------------------------------------
def trained_state():
    torch.manual_seed(0)
    model = build_model("mlp")
    opt = torch.optim.Adam(model.parameters(), lr=1e-3, betas=(0.8, 0.99))
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    for _ in range(3):
        model(torch.randn(4, 64)).sum().backward()
        opt.step()
        opt.zero_grad()
        sched.step()
    return model, opt, sched


def write_v3_checkpoint(path: Path, states: dict, step: int = 0, kinds: dict | None = None,
                        rng: list | None = None) -> Path:
    """A format 3 checkpoint, as hvdkit 0.4 wrote it (the whole file built in memory, sealed
    with the 'hvdkit-checkpoint 2' header): what a user's old runs left, to read back."""
    import io
    import json

    import h5py

    from hvdkit.checkpoint.integrity import USERBLOCK, content_checksum
    from hvdkit.h5tree import write_tree

    buffer = io.BytesIO()
    with h5py.File(buffer, "w", track_order=True, userblock_size=USERBLOCK) as f:
        f.attrs.update({"format": "hvdkit-checkpoint", "format_version": 3, "step": step, "hvdkit_version": "0.4.0",
                        "torch_version": str(torch.__version__), "created": "2026-12-04T00:00:00+0000",
                        "world_size": 1, "backend": "local",
                        "states": json.dumps(kinds or {k: "value" for k in states}), "metrics": json.dumps({})})
        for key, value in states.items():
            write_tree(f, key, value)
        if rng:
            write_tree(f, "rng", {str(i): r for i, r in enumerate(rng)})
        f.attrs["checksum"] = content_checksum(f, data_bytes=True)
    Path(path).write_bytes(seal_in_memory(bytearray(buffer.getvalue())))
    return Path(path)


def seal_in_memory(data: bytearray) -> bytes:
    """The 'hvdkit-checkpoint 2' header (formats 2 and 3) written into a file built in memory."""
    import hashlib

    from hvdkit.checkpoint.integrity import MAGIC, USERBLOCK

    body = bytes(data[USERBLOCK:])
    header = MAGIC + f"size {len(body)}\nsha256 {hashlib.sha256(body).hexdigest()}\n".encode()
    data[:len(header)] = header
    return bytes(data)


def flip_tensor_bit(path: Path, dataset: str = "model/0.weight") -> None:
    """Flip one bit inside a checkpoint dataset's bytes: only its CRC (checked as it is read,
    or by a verifying pass) sees it; the metadata stays intact."""
    import h5py

    with h5py.File(path, "r") as f:
        offset = f[dataset].id.get_offset() + 5
    with open(path, "r+b") as fh:
        fh.seek(offset)
        byte = fh.read(1)
        fh.seek(offset)
        fh.write(bytes([byte[0] ^ 0x04]))


def assert_tree_equal(a, b, path="root"):
    assert type(a) is type(b), f"{path}: {type(a)} != {type(b)}"
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape, path
        assert torch.equal(a, b), path
    elif isinstance(a, dict):
        assert list(a) == list(b), path
        for k in a:
            assert_tree_equal(a[k], b[k], f"{path}.{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b)):
            assert_tree_equal(x, y, f"{path}[{i}]")
    elif isinstance(a, np.ndarray):
        assert np.array_equal(a, b), path
    else:
        assert a == b, path


# -- the local Slurm cluster (scripts/local-cluster.sh) -------------------------------
CLUSTER = ROOT / "scripts" / "local-cluster.sh"
CLUSTER_STATE = Path("/run/hvdkit-cluster")
VENV = sys.prefix
DONE_STATES = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "PREEMPTED")


def cluster_mode() -> tuple[str, int]:
    """('multi'|'single'|'none', node count) of the local cluster scripts/local-cluster.sh made."""
    try:
        return (CLUSTER_STATE / "mode").read_text().strip(), int((CLUSTER_STATE / "nodes").read_text())
    except (OSError, ValueError):
        return "none", 0


def cluster(*args: str, timeout: float = 120) -> str:
    """Run ``scripts/local-cluster.sh ARGS`` and return its stdout (asserting success)."""
    proc = subprocess.run([str(CLUSTER), *args], capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, f"local-cluster.sh {' '.join(args)}: {proc.stderr}{proc.stdout}"
    return proc.stdout


def job_state(job: str) -> str:
    out = subprocess.run(["scontrol", "show", "job", job], capture_output=True, text=True,
                         timeout=30).stdout
    m = re.search(r"JobState=(\w+)", out)
    return m.group(1) if m else "UNKNOWN"


def wait_done(job: str, timeout: float = 240, kick_requeued: bool = False) -> str:
    """Poll until the job ends. ``kick_requeued`` waives Slurm's ~2 min requeue delay.

    Not at once: slurmd refuses a job whose credential was revoked in the same second
    ("Killing non-startable batch job: Job credential revoked", the job then ends FAILED);
    times have one-second resolution. Slurm's own delay is there for this; 3 s is enough.
    """
    deadline = time.time() + timeout
    pending_since = None
    while time.time() < deadline:
        state = job_state(job)
        if state in DONE_STATES:
            return state
        pending_since = (pending_since or time.time()) if state == "PENDING" else None
        if kick_requeued and pending_since and time.time() - pending_since >= 3:
            subprocess.run(["scontrol", "update", f"JobId={job}", "StartTime=now"],
                           capture_output=True, timeout=30)
        time.sleep(1)
    subprocess.run(["scancel", job], timeout=30)
    raise AssertionError(f"job {job} still {job_state(job)} after {timeout}s")


def preempt_when_logged(job: str, log: Path, pattern: str, timeout: float) -> str:
    """Wait for ``pattern`` in the job's log (failing if the job leaves PENDING/RUNNING first),
    send it SIGUSR1 as Slurm's ``--signal`` would, wait for it to be requeued and complete;
    return the whole log."""
    deadline = time.time() + timeout
    while not re.search(pattern, log.read_text() if log.exists() else ""):
        assert time.time() < deadline and job_state(job) in ("PENDING", "RUNNING"), "job never trained"
        time.sleep(0.2)
    subprocess.run(["scancel", "--signal=USR1", job], check=True, timeout=30)
    assert wait_done(job, timeout=timeout + 160, kick_requeued=True) == "COMPLETED"
    return log.read_text()


def free_port() -> int:
    """A TCP port nobody listens on now (the kernel's pick), for a rendezvous of our own."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def stop_process_group(proc: subprocess.Popen, grace: float = 5.0, timeout: float = 30.0) -> None:
    """Stop the process group ``proc`` leads (started with ``start_new_session``): TERM, up to
    ``grace`` s for the leader, then KILL whatever of the group is left, and wait until it is
    empty (a daemon such as 'ray start --block' shuts its children down after the leader's TERM,
    and a check right after would still see them). A group already gone is no error."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=grace)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(timeout=timeout)

    def group_empty() -> bool:
        try:
            os.killpg(proc.pid, 0)
        except ProcessLookupError:
            return True
        return False

    wait_until(group_empty, timeout, f"process group {proc.pid} to end")


def wait_until(condition: Callable[[], bool], timeout: float, what: str) -> None:
    """Poll ``condition`` (an event: a file, a line) until true; fail naming ``what``."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"waited {timeout}s for {what}"
        time.sleep(0.05)


MEMORY_CGROUPS = Path("/sys/fs/cgroup/memory")  # cgroup v1's memory controller, where tests budget ranks


def run_in_budgets(tmp_path: Path, np: int, backend: str, budget: int,
                   train: Sequence[str]) -> tuple[subprocess.CompletedProcess, list[dict[str, int]]]:
    """'hvdkit run -np NP --launcher mpirun' of 'hvdkit train --backend BACKEND TRAIN...', each
    rank in a memory cgroup of its own limited to ``budget`` bytes (tests/workers/memory_budget.sh).
    Returns the run and every rank's cgroup figures (``peak``, ``oom_kill``); the cgroups are
    removed once their ranks have left (mpirun ends the others after one failed)."""
    import uuid

    tag = uuid.uuid4().hex[:8]
    (tmp_path / "logs").mkdir(exist_ok=True)
    proc = subprocess.run(
        [sys.executable, "-m", "hvdkit", "run", "-np", str(np), "--launcher", "mpirun", "--backend", backend,
         "--log-dir", str(tmp_path / "logs"), "--", str(ROOT / "tests" / "workers" / "memory_budget.sh"), str(budget),
         sys.executable, "-m", "hvdkit", "train", "--backend", backend, *train],
        env=base_env(HVDKIT_BUDGET_TAG=tag, MALLOC_MMAP_THRESHOLD_="131072"),  # freed tensors go back to the kernel
        capture_output=True, text=True, timeout=600)
    figures = []
    for cg in sorted(MEMORY_CGROUPS.glob(f"hvdkit-budget-{tag}-*")):
        oom = dict(line.split() for line in (cg / "memory.oom_control").read_text().splitlines())
        figures.append({"peak": int((cg / "memory.max_usage_in_bytes").read_text()),
                        "oom_kill": int(oom.get("oom_kill", 0))})
        wait_until(lambda cg=cg: not (cg / "cgroup.procs").read_text().strip(), 60, f"{cg.name} to empty")
        cg.rmdir()
    return proc, figures


def wait_for_text(path: Path, text: str, job: str, timeout: float = 120) -> None:
    """Wait until ``text`` appears in ``path`` while ``job`` has not ended.

    COMPLETING counts as not ended (a requeue passes through it), and the log is read once
    more after the job ends: slurmstepd can write a step's last lines after the state changed.
    """
    deadline = time.time() + timeout

    def seen() -> bool:
        return text in (path.read_text() if path.exists() else "")

    while not seen():
        state = job_state(job)
        if time.time() >= deadline or state in DONE_STATES:
            time.sleep(2)
            assert seen(), f"job {job} is {state} and never printed {text!r}:\n" + \
                (path.read_text()[-3000:] if path.exists() else "(no log)")
            return
        time.sleep(0.2)


def render(tmp_path: Path, name: str, *args: str) -> Path:
    """``hvdkit slurm ... -o SCRIPT`` with a 10-minute limit and per-job logs; lints the script."""
    script = tmp_path / f"{name}.sh"
    result = CliRunner().invoke(cli, ["slurm", "--venv", VENV, "--time", "10:00", "-J", name,
                                      "--output", str(tmp_path / f"{name}-%j.out"), "-o", str(script),
                                      *args])
    assert result.exit_code == 0, result.output
    lint = subprocess.run(["shellcheck", str(script)], capture_output=True, text=True, timeout=60)
    assert lint.returncode == 0, lint.stdout
    return script


def sbatch(script: Path, cwd: Path, *options: str) -> str:
    proc = subprocess.run(["sbatch", "--parsable", *options, str(script)], capture_output=True,
                          text=True, cwd=cwd, timeout=60)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.strip().split(";")[0]


def final_loss(log: str) -> float:
    return float(re.search(r"final_loss=(\S+)", log).group(1))


def read_metrics(path: Path) -> dict:
    """The metrics JSON rank 0 wrote with --metrics-file (what tests read instead of logs)."""
    return json.loads(path.read_text())


def launch_metrics(kind: str, np: int, program: Sequence[str], path: Path, **kw: Any) -> tuple[dict, str]:
    """Run an ``hvdkit train`` program like :func:`launch` with ``--metrics-file path``;
    assert success and return (the metrics rank 0 wrote, the console output)."""
    out = check(launch(kind, np, [*program, "--metrics-file", str(path)], **kw))
    return read_metrics(path), out


def spawn(argv: Sequence[str], env: dict[str, str] | None = None, cwd: Path | None = None) -> subprocess.Popen:
    """Start a job in the background (text stdout+stderr on one pipe, its own session);
    stop it with :func:`kill_job`."""
    return subprocess.Popen(list(argv), env=env or base_env(), cwd=cwd, text=True, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, start_new_session=True)


def descendants(pid: int) -> list[int]:
    """Every live process below ``pid``, read from /proc (horovodrun puts its workers in
    process groups of their own, so a process-group kill misses them)."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def kill_job(proc: subprocess.Popen, wait: bool = True) -> None:
    """SIGKILL a job's launcher and everything it started, each by PID; then reap it."""
    for pid in [proc.pid, *descendants(proc.pid)]:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    if wait:
        proc.wait(timeout=30)


def elastic_one_host(tmp_path: Path, host: str, prefix: Sequence[str] = (), env: dict[str, str] | None = None,
                     deadline_s: float = 240, epochs: int = 8) -> tuple[str, list[tuple[int, int]], float]:
    """Horovod Elastic on ONE host with 2 slots (discovery ``host:2``): it must start at once;
    a killed worker in a slot still listed is replaced (reset at world 2: the host is not
    blacklisted for one worker's death); unlisting slot 1 shrinks the job to 1 worker, listing
    it again grows it back to 2. Every step waits on a line of the job's output. Returns (the
    whole output, the resets as (world, committed step), seconds until the first worker
    started). ``prefix`` runs it elsewhere (a cluster node)."""
    from hvdkit.data import make_synthetic_h5

    data = make_synthetic_h5(tmp_path / "train.h5", "mlp", 2048, seed=5)
    listing = tmp_path / "hosts"
    listing.write_text(f"{host}:2\n")
    script = tmp_path / "discover.sh"
    script.write_text(f"#!/bin/sh\ncat '{listing}'\n")
    script.chmod(0o755)
    argv = [*prefix, *HVDKIT, "run", "--elastic", "-np", "2", "--min-np", "1", "--max-np", "2",
            "--host-discovery-script", str(script), "--", "--commit-every", "4", "--model", "mlp",
            "--epochs", str(epochs), "--data", str(data), "--sample-log", str(tmp_path / "samples.jsonl"),
            "--log-every", "1"]
    started = time.monotonic()
    proc = spawn(argv, env=env, cwd=tmp_path)
    workers: dict[int, int] = {}  # local rank -> pid
    phase, first_worker = [0], [None]
    log: list[str] = []
    try:
        for line in proc.stdout:
            log.append(line)
            assert time.monotonic() - started < deadline_s, "".join(log)[-3000:]
            m = re.search(r"elastic worker rank \d+ of \d+ \(local (\d+)\) host \S+ pid (\d+)", line)
            if m:
                workers[int(m.group(1))] = int(m.group(2))
                first_worker[0] = first_worker[0] or time.monotonic() - started
            if phase[0] == 0 and "commit at step 12 " in line:
                os.kill(workers[1], signal.SIGKILL)        # slot 1's worker dies mid-epoch
                phase[0] = 1
            elif phase[0] == 1 and "reset: rank 0 of 2" in line:
                listing.write_text(f"{host}:1\n")          # replaced; now slot 1 goes away
                phase[0] = 2
            elif phase[0] == 2 and "reset: rank 0 of 1" in line:
                listing.write_text(f"{host}:2\n")          # and is listed again
                phase[0] = 3
        proc.wait(timeout=60)
    finally:
        kill_job(proc)
        (tmp_path / "run.log").write_text("".join(log))  # the whole story, for a failure
    text = "".join(log)
    assert proc.returncode == 0 and phase[0] == 3, f"see {tmp_path / 'run.log'}: " + text[-3000:]
    resets = [(int(w), int(s)) for w, s in re.findall(r"reset: rank 0 of (\d) .*?committed step (\d+)", text)]
    return text, resets, first_worker[0] or float("inf")


def start_up_preemption(tmp_path: Path, launcher: list[str], point: str,
                        env: dict[str, str] | None = None) -> tuple[int, str, Path]:
    """#44 class 10: USR1 to ``hvdkit run`` while the job starts. ``launch``: the launcher holds
    with its handlers in place and nothing started; ``setup``: both ranks hold before they meet
    (no preemption handler of their own yet). Returns (exit code, output, checkpoint dir)."""
    ck = tmp_path / "ck"
    # the ranks go on once the launcher has asked them to stop (the stop file they read)
    full = base_env(**(env or {}), HVDKIT_HOLD=point,
                    HVDKIT_HOLD_RELEASE="signal" if point == "launch" else "stop-file")
    proc = subprocess.Popen([*HVDKIT, "run", "-np", "2", *launcher, "--", "--model", "tiny", "--epochs", "1",
                             "--num-samples", "256", "--checkpoint-dir", str(ck)], env=full, cwd=tmp_path,
                            text=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(iter(proc.stdout.readline, "")), daemon=True)
    reader.start()
    try:
        holding = 1 if point == "launch" else 2
        wait_until(lambda: sum(f"holding at {point}" in ln for ln in lines) >= holding, 120, f"the {point} hold")
        proc.send_signal(signal.SIGUSR1)  # to the launcher, as Slurm's batch shell or a user does
        code = proc.wait(timeout=180)
        reader.join(timeout=30)
    finally:
        stop_process_group(proc)
    return code, "".join(lines), ck
