"""``hvdkit doctor``."""

from __future__ import annotations

import sys

import click


@click.command("doctor")
def doctor_command() -> None:
    """Check torch, Horovod, MPI, mpi4py, Slurm and GPUs, and say how to fix what is missing."""
    from ..doctor import run_checks, verdict

    checks = run_checks()
    for c in checks:
        mark = "ok  " if c.ok else "FAIL"
        click.echo(f"[{mark}] {c.name:<11} {c.detail}")
        if not c.ok and c.fix:
            click.echo(f"       {'':<11} fix: {c.fix}")
    core, line = verdict(checks)
    click.echo(f"verdict: {line}")
    sys.exit(0 if core else 1)
