"""The ``hvdkit`` command line. Each subcommand translates flags into library dataclasses."""

from __future__ import annotations

import sys

import click

from .. import __version__
from .bench_cmd import bench_command
from .ckpt_cmd import ckpt_group, data_group
from .doctor_cmd import doctor_command
from .plot_cmd import plot_command
from .run_cmd import run_command
from .slurm_cmd import slurm_command
from .sweep_cmd import sweep_group
from .train_cmd import train_command

__all__ = ["main", "cli"]


@click.group(context_settings={"help_option_names": ["-h", "--help"], "auto_envvar_prefix": "HVDKIT"})
@click.version_option(__version__, prog_name="hvdkit")
def cli() -> None:
    """hvdkit: data-parallel PyTorch training with Horovod or native DDP, on Slurm or locally.

    \b
    Conventions of every command:
      -np/--np N      number of ranks (run, sweep, bench)
      -o FILE         a file to write (slurm; run writes one with --write-script FILE)
      --out-dir DIR   a directory to write (sweep, bench)
      --config FILE   option defaults from YAML/TOML/JSON; flags win
    \b
    Exit status: 0 done; 2 usage error (found before anything ran, one line);
    1 failure while running (one line, the cause); 75 preempted, not requeued.
    """


cli.add_command(train_command)
cli.add_command(run_command)
cli.add_command(slurm_command)
cli.add_command(ckpt_group)
cli.add_command(data_group)
cli.add_command(doctor_command)
cli.add_command(bench_command)
cli.add_command(sweep_group)
cli.add_command(plot_command)


def main(argv: list[str] | None = None) -> None:
    """Console-script entry point: one line per error; exit 2 for usage, 1 for runtime errors."""
    from ..log import install_console

    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] in (["run"], ["train"]):
        # a preemption signal (USR1/USR2) from here on is remembered, never fatal: the launcher
        # then starts no ranks, a rank stops at its first step (hvdkit.preemption)
        from ..preemption import catch_early

        catch_early()
    install_console()  # the command is an application: hvdkit's lines go to this console
    try:
        code = cli.main(args=argv, prog_name="hvdkit", standalone_mode=False)
    except click.UsageError as exc:  # click's default adds a Usage: block and a blank line
        where = exc.ctx.command_path if exc.ctx is not None else "hvdkit"
        message = exc.format_message()
        hint = "" if "HINT:" in message else f" (see '{where} --help')"
        click.echo(f"Error: {message}{hint}", err=True)
        sys.exit(exc.exit_code)
    except click.ClickException as exc:
        exc.show()
        sys.exit(exc.exit_code)
    except click.Abort:
        click.echo("Aborted.", err=True)
        sys.exit(1)
    sys.exit(code if isinstance(code, int) else 0)
