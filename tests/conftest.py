"""Shared helpers: launch real multi-process jobs with the launchers hvdkit supports."""

from __future__ import annotations

import os
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


def launch(kind: str, np: int, program: Sequence[str], timeout: float = 180,
           env: dict[str, str] | None = None, cwd: Path | None = None) -> subprocess.CompletedProcess:
    """Run ``program`` on ``np`` ranks with launcher ``kind`` and return the finished process.

    ``slurm-sim`` starts the ranks as plain processes with the variables srun
    would set (SLURM_PROCID, SLURM_NTASKS, SLURM_LOCALID, SLURM_JOB_NODELIST...).
    """
    full_env = base_env(**(env or {}))
    if kind == "slurm-sim":
        procs = []
        for rank in range(np):
            rank_env = dict(full_env, SLURM_JOB_ID="4242", SLURM_STEP_ID="0", SLURM_PROCID=str(rank),
                            SLURM_NTASKS=str(np), SLURM_LOCALID=str(rank),
                            SLURM_JOB_NODELIST="localhost", SLURM_NODEID="0")
            procs.append(subprocess.Popen(list(program), env=rank_env, cwd=cwd, text=True,
                                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT))
        outputs, codes = [], []
        for p in procs:
            try:
                out, _ = p.communicate(timeout=timeout)
            except subprocess.TimeoutExpired:
                for q in procs:
                    q.kill()
                raise
            outputs.append(out)
            codes.append(p.returncode)
        return subprocess.CompletedProcess(list(program), max(codes, key=abs), "".join(outputs), "")
    launcher, controller = {"hvd-gloo": ("horovodrun", "gloo"), "hvd-mpi": ("horovodrun", "mpi"),
                            "mpirun": ("mpirun", "gloo")}[kind]
    argv, extra = build_local_command(LocalLaunch(np=np, launcher=launcher, controller=controller),
                                      program, full_env)
    full_env.update(extra)
    return subprocess.run(argv, env=full_env, cwd=cwd, text=True, timeout=timeout,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT)


def check(proc: subprocess.CompletedProcess) -> str:
    """Assert success, showing the job's output when it failed."""
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout[-6000:]}"
    return proc.stdout


@pytest.fixture
def launcher():
    return launch
