"""hvdkit doctor reports this machine truthfully and names fixes for what is missing."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from conftest import base_env


def doctor(env):
    return subprocess.run([sys.executable, "-m", "hvdkit", "doctor"], env=env, capture_output=True,
                          text=True, timeout=120)


def test_doctor_on_the_set_up_machine():
    proc = doctor(base_env())
    assert proc.returncode == 0, proc.stdout
    out = proc.stdout
    assert "[ok  ] torch       2.13.0" in out
    assert "[ok  ] horovod     0.28.1 with PyTorch" in out and "gloo yes" in out and "mpi yes" in out
    assert "controllers MPI, Gloo" in out
    assert "[ok  ] mpirun      mpirun (Open MPI) 4.1" in out
    assert "[ok  ] slurm" in out and "pmix" in out
    assert "verdict: ready:" in out and "Slurm submission" in out


def test_doctor_names_the_fix_for_missing_pieces(tmp_path):
    env = base_env()
    env["PATH"] = str(Path(sys.executable).parent)  # the venv only: no mpirun, no Slurm, no shellcheck
    proc = doctor(env)
    out = proc.stdout
    assert "[FAIL] mpirun      not on PATH" in out and "fix: apt-get install openmpi-bin" in out
    assert "[FAIL] slurm       missing: sbatch, srun, scontrol, sinfo" in out
    assert "not ready: " in out and "Slurm submission" in out.split("not ready: ")[1]
    assert proc.returncode == 0  # torch + Horovod/Gloo still usable locally
