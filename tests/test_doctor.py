"""hvdkit doctor reports this machine truthfully and names fixes for what is missing."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from helpers import base_env


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
    assert "[ok  ] precision   cpu: bf16 " in out and ", fp16 " in out


def test_doctor_says_when_bf16_is_emulated():
    """oneDNN capped at AVX2 has no bf16/fp16 kernels on any x86 CPU: doctor says so, with the advice."""
    proc = doctor(base_env(ONEDNN_MAX_CPU_ISA="AVX2"))
    line = next(line for line in proc.stdout.splitlines() if line.startswith("[ok  ] precision"))
    assert "cpu: bf16 EMULATED, fp16 EMULATED (oneDNN's bf16 kernels need AVX-512" in line
    assert line.endswith("use --precision fp32 here)")


def test_doctor_names_the_fix_for_missing_pieces(tmp_path):
    env = base_env()
    env["PATH"] = str(Path(sys.executable).parent)  # the venv only: no mpirun, no Slurm, no shellcheck
    proc = doctor(env)
    out = proc.stdout
    assert "[FAIL] mpirun      not on PATH" in out and "fix: apt-get install openmpi-bin" in out
    assert "[FAIL] slurm       missing: sbatch, srun, scontrol, sinfo" in out
    assert "not ready: " in out and "Slurm submission" in out.split("not ready: ")[1]
    assert proc.returncode == 0  # torch + Horovod/Gloo still usable locally


def test_gpu_stack_verdict_names_what_is_missing():
    from hvdkit.doctor import gpu_stack_verdict

    assert gpu_stack_verdict(0, False, True).ok
    cpu_torch = gpu_stack_verdict(8, False, True)
    assert not cpu_torch.ok and "torch is a CPU build" in cpu_torch.detail and "HVDKIT_CUDA=auto" in cpu_torch.fix
    no_nccl = gpu_stack_verdict(1, True, False)
    assert not no_nccl.ok and "no NCCL ops" in no_nccl.detail and no_nccl.required_for == ("gpu",)
    good = gpu_stack_verdict(4, True, True)
    assert good.ok and "Horovod with NCCL ops" in good.detail
    assert gpu_stack_verdict(1, True, None).ok  # DDP alone needs no Horovod


def test_doctor_judges_horovodrun_the_way_hvdkit_run_finds_it():
    """.venv/bin/hvdkit doctor with the venv not activated: horovodrun is beside the interpreter,
    where 'hvdkit run' finds it, so it is not 'missing'."""
    env = base_env()
    env["PATH"] = "/usr/bin:/bin"  # no venv on PATH
    proc = subprocess.run([str(Path(sys.executable).parent / "hvdkit"), "doctor"], env=env, capture_output=True,
                          text=True, timeout=120)
    out = proc.stdout
    assert "[ok  ] horovodrun" in out and "controllers MPI, Gloo" in out, out
    assert "not ready: Horovod (horovodrun)" not in out and proc.returncode == 0, out
