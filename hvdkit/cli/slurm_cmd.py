"""``hvdkit slurm``: render (and optionally submit) an sbatch script from slurm/ templates."""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path
from typing import Any

import click
import yaml

from ..backends.traits import DEFAULT_BACKEND, LAUNCHABLE
from ..config import HorovodOptions
from ..errors import ConfigError
from ..fileio import write_text_atomic
from ..launch.local import training_program
from ..launch.slurm import RAY_ENGINE, SLURM_LAUNCHERS, SRUN_MPI, SlurmJob, render_sbatch, submit
from ..launch.vocabulary import BACKEND_VAR, ELASTIC_LAUNCHER, iface_env
from .common import FiniteFloat, config_option, translate_errors, usable_output
from .validate import check_array_params, check_job_memory, check_program, check_train_args, is_program

# every default below is SlurmJob's own (tests/test_config.py checks that none drifts)
JOB = {f.name: f.default for f in dataclasses.fields(SlurmJob) if f.default is not dataclasses.MISSING}


def _pairs(values: tuple[str, ...], what: str) -> tuple[tuple[str, str], ...]:
    out = []
    for item in values:
        key, sep, value = item.partition("=")
        if not sep:
            raise click.BadParameter(f"{item!r} is not NAME=VALUE", param_hint=what)
        out.append((key, value))
    return tuple(out)


def build_job(o: dict[str, Any]) -> SlurmJob:
    """Translate parsed ``hvdkit slurm`` options into a :class:`SlurmJob` (pure)."""
    env = list(_pairs(tuple(o["env"]), "--env"))
    hvd = HorovodOptions(fusion_threshold_mb=o["fusion_threshold_mb"], cycle_time_ms=o["cycle_time_ms"])
    env += sorted(hvd.env_vars().items())  # the one HOROVOD_* mapping (config.HorovodOptions)
    if o["iface"]:
        env += sorted(iface_env(o["iface"]).items())
    if is_program(tuple(o["args"])):  # a program of your own: BackendConfig() follows --backend
        env.append((BACKEND_VAR, o["backend"]))
    python = "python" if (o["venv"] or o["conda_env"]) else sys.executable
    args = tuple(o["args"])
    if (not o["requeue"] or o["launcher"] == RAY_ENGINE) and not (args and not args[0].startswith("-")):
        # hvdkit train must not 'scontrol requeue' itself: not asked for, or (Ray) the batch
        # shell requeues once the ranks exited 75 and their last lines reached the log
        args += ("--no-requeue",)
    return SlurmJob(
        program=tuple(training_program(o["backend"], args, python)),
        backend=o["backend"], job_name=o["job_name"], nodes=o["nodes"],
        tasks_per_node=o["tasks_per_node"], gpus_per_node=o["gpus_per_node"],
        gpus_per_task=o["gpus_per_task"], cpus_per_task=o["cpus_per_task"], mem=o["mem"],
        time=o["time"], partition=o["partition"], account=o["account"], qos=o["qos"],
        constraint=o["constraint"], output=o["output"], error=o["error"],
        modules=tuple(o["module"]), venv=o["venv"], conda_env=o["conda_env"], workdir=o["workdir"],
        extra_sbatch=tuple(o["sbatch"]), env=tuple(env), launcher=o["launcher"],
        srun_mpi=o["srun_mpi"], signal=o["signal"],
        signal_seconds=o["signal_seconds"] or None, requeue=o["requeue"], array=o["array"],
        array_params=o["array_params"], results_dir=o["results_dir"],
        checkpoint_dir=o["checkpoint_dir"], process_group=o["process_group"],
        elastic_min_nodes=(o["min_nodes"] or o["nodes"]) if o["elastic"] else None,
        blacklist_cooldown=tuple(o["blacklist_cooldown_range"] or JOB["blacklist_cooldown"]),
        elastic_timeout=o["elastic_timeout"],
    )


def _print_template_dir(ctx: click.Context) -> None:
    from ..launch.templates import template_dir

    click.echo(template_dir())
    ctx.exit(0)


@click.command("slurm", context_settings={"ignore_unknown_options": True, "allow_interspersed_args": False})
@config_option
@click.option("--backend", type=click.Choice(LAUNCHABLE), default=DEFAULT_BACKEND, show_default=True)
@click.option("-J", "--job-name", default=JOB["job_name"], show_default=True)
@click.option("-N", "--nodes", type=click.IntRange(min=1), default=JOB["nodes"], show_default=True)
@click.option("--tasks-per-node", type=click.IntRange(min=1), default=JOB["tasks_per_node"], show_default=True,
              help="Ranks per node (= GPUs per node on GPU machines).")
@click.option("--gpus-per-node", type=click.IntRange(min=0), default=JOB["gpus_per_node"], show_default=True)
@click.option("--gpus-per-task", type=click.IntRange(min=1), default=None)
@click.option("-c", "--cpus-per-task", type=click.IntRange(min=1), default=JOB["cpus_per_task"], show_default=True)
@click.option("--mem", default=None, help="Memory per node, e.g. 64G; a job whose ranks cannot fit it (the model's "
              "state, sized on the meta device) is refused now.")
@click.option("-t", "--time", default=JOB["time"], show_default=True, help="Time limit (Slurm formats).")
@click.option("-p", "--partition", default=None)
@click.option("-A", "--account", default=None)
@click.option("--qos", default=None)
@click.option("-C", "--constraint", default=None)
@click.option("--output", default=None, help="stdout path [default: %x-%j.out, arrays %x-%A_%a.out].")
@click.option("--error", default=None, help="stderr path (default: same as --output).")
@click.option("--module", multiple=True, help="'module load' this (repeatable).")
@click.option("--venv", default=None, help="Virtualenv to activate on the nodes.")
@click.option("--conda-env", default=None, help="Conda env to activate on the nodes.")
@click.option("--workdir", default=None, help="cd here before running.")
@click.option("--sbatch", multiple=True, help="Extra #SBATCH option, e.g. --sbatch=--exclusive (repeatable).")
@click.option("--env", multiple=True, help="NAME=VALUE to export (repeatable).")
@click.option("--fusion-threshold-mb", type=FiniteFloat(min=0), default=None, help="HOROVOD_FUSION_THRESHOLD.")
@click.option("--cycle-time-ms", type=FiniteFloat(min=0, min_open=True), default=None, help="HOROVOD_CYCLE_TIME.")
@click.option("--iface", default=None, help="Network interface for NCCL/Gloo/Horovod (e.g. ib0).")
@click.option("--engine", type=click.Choice(["launcher", "ray"]), default="launcher", show_default=True,
              help="launcher: the ranks are started by --launcher; ray: Ray is started inside the allocation "
                   "(head on the first node) and hvdkit run --launcher ray places the ranks (docs/ray.md).")
@click.option("--launcher", type=click.Choice(SLURM_LAUNCHERS), default=None,
              help="How the step starts the ranks [default: srun; horovodrun with --elastic].")
@click.option("--elastic", is_flag=True,
              help="Horovod Elastic over the allocation (horovodrun, --no-kill): training goes on "
                   "when nodes fail and takes them back when they return.")
@click.option("--min-nodes", type=click.IntRange(min=1), default=None,
              help="--elastic: keep training down to this many nodes [default: --nodes].")
@click.option("--blacklist-cooldown-range", nargs=2, type=click.IntRange(min=1), default=None,
              help="--elastic: seconds (MIN MAX) before a failed node may rejoin "
                   f"[default: {' '.join(map(str, JOB['blacklist_cooldown']))}].")
@click.option("--elastic-timeout", type=click.IntRange(min=1), default=JOB["elastic_timeout"], show_default=True,
              help="--elastic: seconds horovodrun waits for --min-nodes before the job fails.")
@click.option("--srun-mpi", type=click.Choice(SRUN_MPI), default=None,
              help="srun --mpi plugin for Horovod [default: pmix]; DDP needs none.")
@click.option("--process-group", type=click.Choice(["gloo", "nccl"]), default=None,
              help="Only to validate DDP GPU requests; the training picks it automatically.")
@click.option("--signal", default=JOB["signal"], show_default=True, help="Signal sent before the time limit.")
@click.option("--signal-seconds", type=click.IntRange(min=0), default=JOB["signal_seconds"], show_default=True,
              help="How early (0 = no signal).")
@click.option("--requeue/--no-requeue", default=JOB["requeue"], show_default=True)
@click.option("--array", default=None, help="Job array spec, e.g. 0-2 or 0-15%4.")
@click.option("--array-params", default=None, help="File: line i+1 = training options of array task i.")
@click.option("--results-dir", default=None, help="Each task writes its metrics JSON here.")
@click.option("--checkpoint-dir", default=None, help="Checkpoints (per array task when --array).")
@click.option("--template-dir", type=click.Path(file_okay=False), default=None,
              help="Your adapted copy of the templates (see --print-template-dir).")
@click.option("--print-template-dir", is_flag=True, is_eager=True, expose_value=False,
              callback=lambda ctx, _p, v: _print_template_dir(ctx) if v else None,
              help="Print where hvdkit's own templates are (to copy them) and exit.")
@click.option("-o", "--out", "out", type=click.Path(dir_okay=False), default=None, help="Write the script here.")
@click.option("--submit", is_flag=True, help="Submit with sbatch and print the job id.")
@click.option("--print-config", is_flag=True, help="Print the merged options (config file + flags) and exit.")
@click.argument("args", nargs=-1, type=click.UNPROCESSED)
@translate_errors
def slurm_command(**o: Any) -> None:
    """Generate an sbatch script for N nodes x tasks-per-node ranks.

    ARGS are 'hvdkit train' options, or after '--' a program of your own.
    """
    if o["print_config"]:
        shown = {k: (list(v) if isinstance(v, tuple) else v) for k, v in o.items()
                 if k not in ("print_config", "submit", "out")}
        click.echo(yaml.safe_dump(shown, sort_keys=True), nl=False)
        return
    if o["engine"] == "ray":
        if o["launcher"] is not None:
            raise click.UsageError("--launcher cannot be combined with --engine ray. HINT: Ray starts the ranks; "
                                   "drop --launcher")
        o["launcher"] = RAY_ENGINE
    if o["launcher"] is None:
        o["launcher"] = ELASTIC_LAUNCHER if o["elastic"] else "srun"
    if not o["elastic"] and (o["min_nodes"] or o["blacklist_cooldown_range"]):
        raise click.UsageError("--min-nodes and --blacklist-cooldown-range go with --elastic. "
                               "HINT: add --elastic, or drop them")
    args = tuple(o["args"])
    if o["out"]:
        usable_output(o["out"], "-o")
    # everything the nodes would trip over, checked now: nothing is written when one fails
    if is_program(args):
        check_program(args, o["venv"], o["workdir"])
    else:
        cfg = check_train_args(args, backend=o["backend"])
        if cfg.elastic and o["engine"] == "ray":
            raise click.UsageError("training's --elastic needs Horovod Elastic's driver (horovodrun), and Ray "
                                   "starts these ranks. HINT: use hvdkit slurm --elastic without --engine ray")
        # the node's memory against the model, before the job waits in a queue; not for GPU jobs (the
        # state is in device memory) or arrays (each task's options differ)
        if o["mem"] and cfg.checks_memory and not o["gpus_per_node"] and not o["array"]:
            check_job_memory(args, o["backend"], o["nodes"], o["tasks_per_node"], o["mem"], o["workdir"])
    try:
        if o["array"] and o["array_params"]:
            check_array_params(o["array"], o["array_params"], train_options=not is_program(args))
        job = build_job(o)
        text = render_sbatch(job, Path(o["template_dir"]) if o["template_dir"] else None)
    except ConfigError as exc:
        raise click.UsageError(str(exc)) from None
    if o["venv"] and not (Path(o["venv"]) / "bin" / "activate").is_file():
        # a warning, not an error: a cluster's file system may differ from this node's
        click.echo(f"Warning: --venv {o['venv']} has no bin/activate on this machine; the job fails at its "
                   "'source' line unless the nodes have it (their file system may differ from this one's)",
                   err=True)
    if o["out"]:
        write_text_atomic(o["out"], text, executable=True)
        click.echo(f"wrote {o['out']}", err=True)
    elif not o["submit"]:
        click.echo(text, nl=False)
    if o["submit"]:
        job_id = submit(text)
        click.echo(f"Submitted batch job {job_id}")
