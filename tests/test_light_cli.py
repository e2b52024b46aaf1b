"""The commands a login node runs never import torch or horovod (seconds on a busy node)."""

from __future__ import annotations

import subprocess

import pytest

from helpers import HVDKIT, ROOT, base_env

HEAVY = ("torch", "horovod", "mpi4py")

COMMANDS = [
    "--help",
    "slurm -o job.sbatch --nodes 2 -- --model mlp --epochs 3",
    "slurm -o job.sbatch --nodes 2 --mem 4G -- --model mlp --epochs 3",  # sizes the model in a child
    "slurm -o job.sbatch --backend ddp --launcher mpirun -- --epochs 1",
    "slurm -o job.sbatch --elastic --nodes 2 -- --epochs 1",
    "run --dry-run -np 2 -- --epochs 1 --timeline t.json",
    "run --dry-run -np 2 --backend ddp -- --epochs 1",
    "ckpt show c.h5",
    "ckpt verify c.h5",
    "train --help",
]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    from hvdkit.checkpoint import Snapshot, write_checkpoint
    from hvdkit.models import build_model

    d = tmp_path_factory.mktemp("light")
    write_checkpoint(d / "c.h5", Snapshot(states={"model": build_model("tiny").state_dict()}))
    return d


@pytest.mark.timeout(60)  # measured 1 s (2 cores, loaded)
@pytest.mark.parametrize("command", COMMANDS)
def test_command_imports_no_torch_or_horovod(checkpoint, command):
    proc = subprocess.run([*HVDKIT[:1], "-X", "importtime", *HVDKIT[1:], *command.split()], cwd=checkpoint,
                          env=base_env(), capture_output=True, text=True, timeout=50)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    modules = {line.split("|")[-1].strip() for line in proc.stderr.splitlines() if line.startswith("import time:")}
    assert "hvdkit.cli" in modules  # the import log is really there
    heavy = sorted(m for m in modules if m.split(".")[0] in HEAVY)
    assert not heavy, f"'hvdkit {command}' imported {heavy[:5]}"


def test_the_command_reference_is_current():
    """docs/cli.md is the commands' own --help: regenerate it when an option changes."""
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "scripts/cli_docs.py", "--check"], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
