"""``hvdkit run``: start N local ranks with horovodrun or mpirun (``--dry-run`` prints the line)."""

from __future__ import annotations

import ast
import dataclasses
import importlib.util
import os
import re
import sys
import tempfile
from pathlib import Path
from typing import Any

import click

from ..advice import MEASURED
from ..backends.traits import DEFAULT_BACKEND, LAUNCHABLE
from ..environments import check_network_interface
from ..errors import ConfigError, LauncherEnvError
from ..fileio import write_text_atomic
from ..launch.discovery import DEFAULT_ELASTIC_TIMEOUT, discover, elastic_interface
from ..launch.local import (
    CONTROLLERS,
    LocalLaunch,
    build_local_command,
    format_command,
    horovod_controller,
    local_launcher,
    render_discovery_script,
    render_launch_script,
    resolve_launcher,
    training_program,
)
from ..launch.output import run_with_log
from ..launch.vocabulary import (
    BACKEND_VAR,
    CONSOLE_TTY_VAR,
    IFACE_VAR,
    STOP_FILE_VAR,
    check_iface_name,
    iface_env,
    train_env_var,
)
from ..log import debug, diag
from .common import (
    RAY_OPTIONS,
    config_option,
    ray_options,
    ray_spec,
    refuse_unused,
    translate_errors,
    usable_output,
)
from .validate import check_program, check_train_args, is_program


def horovodrun_option_names() -> set[str]:
    """Long options horovodrun's own argparse knows (it also accepts any unique prefix).

    Read from the source of ``horovod.runner.launch.parse_args`` without importing
    horovod: ``hvdkit run --dry-run`` must stay light.
    """
    spec = importlib.util.find_spec("horovod")  # a top-level find_spec imports nothing
    if spec is None or not spec.submodule_search_locations:
        return set()
    source = Path(next(iter(spec.submodule_search_locations)), "runner", "launch.py")
    try:
        tree = ast.parse(source.read_text())
    except (OSError, SyntaxError):
        return set()
    func = next((n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "parse_args"), None)
    if func is None:
        return set()
    return {n.value for n in ast.walk(func) if isinstance(n, ast.Constant) and isinstance(n.value, str)
            and re.fullmatch(r"--[a-zA-Z][\w-]*", n.value)}


def shield_from_horovodrun(args: tuple[str, ...]) -> tuple[list[str], dict[str, str]]:
    """Move 'hvdkit train' options that horovodrun would swallow into HVDKIT_TRAIN_* variables.

    horovodrun parses options anywhere on its command line and accepts abbreviations, so
    ``--timeline`` (a prefix of its ``--timeline-filename``), ``--elastic``, ``--config``,
    ``--fusion-threshold-mb`` ... never reached the training script. click reads the same
    values from the environment (auto_envvar_prefix), and horovodrun forwards it.
    """
    from .train_cmd import train_command

    theirs = horovodrun_option_names()
    params = {opt: p for p in train_command.params for opt in (*p.opts, *p.secondary_opts)}
    kept: list[str] = []
    env: dict[str, str] = {}
    items = list(args)
    while items:
        arg = items.pop(0)
        name, eq, inline = arg.partition("=")
        param = params.get(name)
        if param is None or not any(h.startswith(name) for h in theirs):
            kept.append(arg)
            continue
        key = train_env_var(param.name)
        if getattr(param, "is_flag", False):
            env[key] = "0" if name in param.secondary_opts else "1"
        else:
            env[key] = inline if eq else (items.pop(0) if items else "")
    return kept, env


# the options only --elastic reads
ELASTIC_ONLY = ("min_np", "max_np", "host_discovery_script", "blacklist_cooldown_range", "elastic_timeout")


@click.command("run", context_settings={"ignore_unknown_options": True, "allow_interspersed_args": False})
@config_option
@click.option("-np", "--np", "np", type=click.IntRange(min=1), default=2, show_default=True,
              help="Number of ranks.")
@click.option("--backend", type=click.Choice(LAUNCHABLE), default=DEFAULT_BACKEND, show_default=True)
@click.option("--launcher", type=click.Choice(["auto", "horovodrun", "mpirun", "ray"]), default="auto",
              show_default=True, help="auto: horovodrun for Horovod, mpirun for DDP; ray: one rank per Ray "
                                      "worker (docs/ray.md).")
@click.option("--controller", type=click.Choice(CONTROLLERS), default="auto", show_default=True,
              help="horovodrun's controller. auto: MPI when Open MPI and an MPI-built Horovod are here "
                   "(the faster), Gloo for --elastic or without them; across several hosts, Gloo where this "
                   "cluster's network bench measured it clearly faster (docs/launching.md).")
@click.option("-H", "--hosts", default=None, help="host:slots,... (default localhost:NP).")
@click.option("--oversubscribe/--no-oversubscribe", default=None,
              help="Allow more ranks than cores (default: automatic).")
@click.option("--elastic", is_flag=True, help="Horovod Elastic: horovodrun --min-np/--max-np + discovery.")
@click.option("--min-np", type=click.IntRange(min=1), default=None, help="Elastic: fewest ranks to keep going.")
@click.option("--max-np", type=click.IntRange(min=1), default=None, help="Elastic: most ranks to grow to.")
@click.option("--host-discovery-script", type=click.Path(dir_okay=False), default=None,
              help="Elastic: executable printing host:slots lines.")
@click.option("--blacklist-cooldown-range", type=(click.IntRange(min=1), click.IntRange(min=1)),
              default=None, help="Elastic: seconds (MIN MAX) a host whose worker failed is kept out; "
                                 "without it, it never rejoins (Horovod's default).")
@click.option("--elastic-timeout", type=click.IntRange(min=1), default=DEFAULT_ELASTIC_TIMEOUT, show_default=True,
              help="Elastic: seconds horovodrun waits for --min-np slots before it fails (its own "
                   "default, 600, looks like a hang).")
@click.option("--write-discovery-script", type=click.Path(dir_okay=False), default=None,
              help="Write a discovery script for Slurm allocations (slurm/discover_hosts.sh) and exit.")
@click.option("--slots", type=click.IntRange(min=1), default=1, show_default=True,
              help="Slots per host in the written discovery script.")
@click.option("--iface", default=None,
              help="Network interface for all traffic (Gloo, NCCL, Open MPI), e.g. ib0; must exist "
                   "on this host and on every host of -H.")
@click.option("--dry-run", is_flag=True, help="Print the command instead of running it.")
@click.option("--log-dir", type=click.Path(file_okay=False, exists=True), default=None,
              help="Where a failed run leaves its full launcher output (default: the temp dir).")
@click.option("--write-script", type=click.Path(dir_okay=False), default=None,
              help="Write a standalone launch script (from slurm/mpirun.sh) instead of running.")
@ray_options
@click.argument("args", nargs=-1, type=click.UNPROCESSED)
@translate_errors
def run_command(np: int, backend: str, launcher: str, controller: str, hosts: str | None,
                oversubscribe: bool | None, elastic: bool, min_np: int | None, max_np: int | None,
                host_discovery_script: str | None, write_discovery_script: str | None, slots: int,
                blacklist_cooldown_range: tuple[int, int] | None, iface: str | None, elastic_timeout: int,
                dry_run: bool, log_dir: str | None, write_script: str | None, args: tuple[str, ...],
                ray_address: str | None, ray_placement: str, cpus_per_task: int, gpus_per_task: int,
                forward_env: tuple[str, ...] = (), **_: Any) -> None:
    """Run training on NP local ranks.

    ARGS are 'hvdkit train' options (e.g. --model mlp --epochs 3), or after
    '--' a program of your own (e.g. -- python my_train.py).

    The console shows what the ranks print, without tracebacks or launcher
    banners; a failed run ends with one 'Error:' line naming the cause and the
    log file that holds the whole output.
    """
    ctx = click.get_current_context()
    # options that the other choices made here would ignore: refused, never silently dropped
    refuse_unused(ctx, ELASTIC_ONLY if not elastic else (), "is an option of --elastic",
                  "add --elastic, or drop {flag}")
    refuse_unused(ctx, ("slots",) if not write_discovery_script else (), "sizes the script of "
                  "--write-discovery-script", "drop {flag}, or add --write-discovery-script FILE")
    if launcher == "ray":
        refuse_unused(ctx, ("controller", "oversubscribe"), "is an option of horovodrun and mpirun; Ray starts "
                      "the ranks with --launcher ray", "drop {flag}")
    else:
        refuse_unused(ctx, RAY_OPTIONS, "places ranks on Ray", "add --launcher ray, or drop {flag}")
    if log_dir:
        usable_output(log_dir, "--log-dir", directory=True)
    if write_discovery_script:
        usable_output(write_discovery_script, "--write-discovery-script")
        path = write_text_atomic(write_discovery_script, render_discovery_script(slots), executable=True)
        click.echo(f"wrote {path}", err=True)
        return
    if elastic and launcher != "ray" and not host_discovery_script:  # (Ray: refused by run_on_ray)
        raise click.UsageError("--elastic needs --host-discovery-script (write one with --write-discovery-script)")
    if write_script:
        usable_output(write_script, "--write-script")
    # a terminal here: hvdkit train's ranks send their progress, and this process draws it as a bar
    tty = sys.stderr.isatty() and not is_program(args) and not (dry_run or write_script)
    if launcher == "ray":
        run_on_ray(np, backend, args, ray_address, ray_placement, cpus_per_task, gpus_per_task, elastic, hosts,
                   dry_run or bool(write_script), log_dir, tty, iface, forward_env)
        return
    try:  # every mistake in the launch itself is a usage error, found before anything starts
        chosen = local_launcher(backend, launcher)
        if chosen == "horovodrun":
            controller, why = horovod_controller(controller, elastic, hosts=hosts)
            # a default that a measurement chose is said aloud; the built-in one only in DEBUG
            (diag if why.startswith(MEASURED) else debug)(f"horovodrun controller: {controller} ({why})")
        else:
            refuse_unused(ctx, ("controller",), "chooses horovodrun's controller; mpirun is MPI",
                          "drop {flag}, or use --launcher horovodrun")
            controller = "mpi"  # mpirun is MPI: there is no controller to choose
        nic = None
        if elastic:
            assert host_discovery_script is not None
            lo = min_np or 1
            if not lo <= np <= (max_np or np):
                raise ConfigError(f"need --min-np ({lo}) <= -np ({np}) <= --max-np ({max_np or np})",
                                  "pick bounds around -np")
            nic = elastic_interface(discover(host_discovery_script), lo, host_discovery_script, iface)
            debug(f"elastic: horovodrun --network-interface {nic or '(found by horovodrun)'}")
        spec = LocalLaunch(np=np, launcher=chosen, controller=controller, hosts=hosts,
                           env={BACKEND_VAR: backend, **({CONSOLE_TTY_VAR: "1"} if tty else {})},
                           oversubscribe=oversubscribe, iface=iface,
                           min_np=(min_np or 1) if elastic else None, max_np=(max_np or np) if elastic else None,
                           # horovodrun runs it through a shell: a bare relative name is not found
                           discovery_script=str(Path(host_discovery_script).resolve())
                           if elastic and host_discovery_script else None,
                           blacklist_cooldown=blacklist_cooldown_range if elastic else None,
                           elastic_nic=nic, elastic_timeout=elastic_timeout if elastic else None)
    except ConfigError as exc:
        raise click.UsageError(str(exc)) from None
    if iface:  # the launcher itself talks over it too: catch a wrong name before anything starts
        _check_iface(iface)
    if is_program(args):
        check_program(args)
    else:
        check_train_args(args, backend=backend)  # before anything starts: horovodrun would only wait on it
    if elastic and (not args or args[0].startswith("-")):
        args = (*args, "--elastic")
    shielded: dict[str, str] = {}
    if chosen == "horovodrun" and (not args or args[0].startswith("-")):
        args_list, shielded = shield_from_horovodrun(args)
        args = tuple(args_list)
    argv, env = build_local_command(spec, training_program(backend, args))
    env.update(shielded)
    if dry_run:
        click.echo(format_command(argv, env))
        return
    if write_script:
        path = write_text_atomic(write_script, render_launch_script(argv, env, np), executable=True)
        click.echo(f"wrote {path}", err=True)
        return
    argv[0] = resolve_launcher(argv[0])
    # hvdkit train's ranks on this machine take a preemption as a file they look for at each
    # step: a rank still starting up has no handler yet, and a signal would kill it (#44)
    stop_file = None
    if not is_program(args) and _all_local(hosts):
        stop_file = os.environ.get(STOP_FILE_VAR) or str(Path(log_dir or tempfile.gettempdir()) /
                                                         f"hvdkit-stop-{os.getpid()}")
        env[STOP_FILE_VAR] = stop_file
        if chosen == "mpirun":
            argv[1:1] = ["-x", STOP_FILE_VAR]
    try:
        outcome = run_with_log(argv, {**os.environ, **env}, log_dir=log_dir, progress=tty, stop_file=stop_file)
    except FileNotFoundError:
        raise click.ClickException(
            f"{argv[0]} not found. HINT: run ./scripts/setup.sh (installs Open MPI and Horovod) "
            "and activate .venv") from None
    if outcome.returncode != 0:
        click.echo(outcome.closing_line(), err=True)
    sys.exit(outcome.returncode)


def _all_local(hosts: str | None) -> bool:
    """Every rank runs on this machine (no -H, or only this host in it)."""
    import socket

    here = {"localhost", "127.0.0.1", socket.gethostname(), socket.gethostname().split(".")[0]}
    return hosts is None or all(h.split(":")[0] in here for h in hosts.split(",") if h)


def _check_iface(iface: str) -> None:
    """--iface names an interface this host has: a usage error (exit 2) otherwise."""
    try:
        check_network_interface({IFACE_VAR: check_iface_name(iface)})
    except (ConfigError, LauncherEnvError) as exc:
        raise click.UsageError(str(exc)) from None


def run_on_ray(np: int, backend: str, args: tuple[str, ...], address: str | None, placement: str, cpus: int,
               gpus: int, elastic: bool, hosts: str | None, dry_run: bool, log_dir: str | None, tty: bool,
               iface: str | None, forward: tuple[str, ...] = ()) -> None:
    """``hvdkit run --launcher ray``: every check before Ray starts, then the ranks on Ray workers."""
    from ..launch.output import ConsoleLog
    from ..rayrun.cluster import check_fits, connect, worker_env
    from ..rayrun.workers import PYTHON, ray_backend, run_job

    for flag, on in (("--elastic", elastic), ("-H", hosts), ("--dry-run/--write-script", dry_run)):
        if on:
            raise click.UsageError(f"{flag} cannot be combined with --launcher ray. HINT: Ray places the ranks "
                                   "itself (--ray-placement); use horovodrun or mpirun for that")
    try:
        ray_backend(backend)
    except ConfigError as exc:
        raise click.UsageError(str(exc)) from None
    if iface:  # before Ray starts: a wrong name would fail every rank after it did
        _check_iface(iface)
    if is_program(args):
        check_program(args)
        program = list(args)
    else:
        if check_train_args(args, backend=backend).elastic:
            raise click.UsageError("training's --elastic needs Horovod Elastic's driver (horovodrun), and Ray "
                                   "starts these ranks. HINT: drop --elastic, or use hvdkit run --elastic "
                                   "without --launcher ray")
        program = [PYTHON, "-m", "hvdkit", "train", "--backend", backend, *args]
    spec = dataclasses.replace(ray_spec(np, address, placement, cpus, gpus, forward),
                               iface=check_iface_name(iface) if iface else None)
    env = worker_env({BACKEND_VAR: backend, **({CONSOLE_TTY_VAR: "1"} if tty else {}),
                      **(iface_env(iface) if iface else {})}, forward=spec.forward)
    console = ConsoleLog(log_dir, progress=tty)
    code = 1
    try:
        with connect(spec):
            check_fits(spec, f"-np {np}")
            code = run_job(spec, backend, program, env, console)
    except ConfigError as exc:
        console.close(2)
        raise click.UsageError(str(exc)) from None
    outcome = console.close(code)
    if code != 0:
        click.echo(outcome.closing_line(), err=True)
    sys.exit(code)
