"""``hvdkit run``: start N local ranks with horovodrun or mpirun (``--dry-run`` prints the line)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import click

from ..launch.local import (
    LocalLaunch,
    build_local_command,
    format_command,
    render_launch_script,
    training_program,
)
from .common import config_option, translate_errors


@click.command("run", context_settings={"ignore_unknown_options": True, "allow_interspersed_args": False})
@config_option
@click.option("-np", "--np", "np", type=click.IntRange(min=1), default=2, show_default=True,
              help="Number of ranks.")
@click.option("--backend", type=click.Choice(["horovod", "ddp"]), default="horovod", show_default=True)
@click.option("--launcher", type=click.Choice(["auto", "horovodrun", "mpirun"]), default="auto",
              show_default=True, help="auto: horovodrun for Horovod, mpirun for DDP.")
@click.option("--controller", type=click.Choice(["gloo", "mpi"]), default="gloo", show_default=True,
              help="horovodrun controller.")
@click.option("-H", "--hosts", default=None, help="host:slots,... (default localhost:NP).")
@click.option("--oversubscribe/--no-oversubscribe", default=None,
              help="Allow more ranks than cores (default: automatic).")
@click.option("--dry-run", is_flag=True, help="Print the command instead of running it.")
@click.option("--write-script", type=click.Path(dir_okay=False), default=None,
              help="Write a standalone launch script (from slurm/mpirun.sh) instead of running.")
@click.argument("args", nargs=-1, type=click.UNPROCESSED)
@translate_errors
def run_command(np: int, backend: str, launcher: str, controller: str, hosts: str | None,
                oversubscribe: bool | None, dry_run: bool, write_script: str | None,
                args: tuple[str, ...], **_: Any) -> None:
    """Run training on NP local ranks.

    ARGS are 'hvdkit train' options (e.g. --model mlp --epochs 3), or after
    '--' a program of your own (e.g. -- python my_train.py).
    """
    chosen = launcher if launcher != "auto" else ("horovodrun" if backend == "horovod" else "mpirun")
    spec = LocalLaunch(np=np, launcher=chosen, controller=controller, hosts=hosts,
                       oversubscribe=oversubscribe)
    argv, env = build_local_command(spec, training_program(backend, args))
    if dry_run:
        click.echo(format_command(argv, env))
        return
    if write_script:
        path = Path(write_script)
        path.write_text(render_launch_script(argv, env, np))
        path.chmod(0o755)
        click.echo(f"wrote {path}", err=True)
        return
    try:
        code = subprocess.call(argv, env={**os.environ, **env})
    except FileNotFoundError:
        raise click.ClickException(
            f"{argv[0]} not found. HINT: run ./scripts/setup.sh (installs Open MPI and Horovod) "
            "and activate .venv") from None
    sys.exit(code)
