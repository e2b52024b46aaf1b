"""Shared helpers: launch real multi-process jobs with the launchers hvdkit supports."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

import pytest

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


@pytest.fixture
def launcher():
    return launch


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    """One loud line when the multi-node tests could not run (no namespaces on this machine)."""
    skipped = terminalreporter.stats.get("skipped", [])
    reasons = {str(r.longrepr[-1]) for r in skipped
               if isinstance(r.longrepr, tuple) and "multi-node tests skipped" in str(r.longrepr[-1])}
    for reason in sorted(reasons):
        terminalreporter.write_line(f"!!! {reason.removeprefix('Skipped: ')} !!!", red=True, bold=True)
