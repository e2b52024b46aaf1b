"""``hvdkit sweep``: hyperparameter search, locally N at a time or as a Slurm job array."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click

from ..backends.traits import BACKENDS, DEFAULT_BACKEND, traits
from ..errors import ConfigError
from ..sweep import SCHEDULERS
from .common import (
    RAY_OPTIONS,
    config_option,
    ray_options,
    ray_spec,
    refuse_unused,
    translate_errors,
    usable_output,
)

if TYPE_CHECKING:
    from ..rayrun.cluster import RaySpec
    from ..sweep import SweepSpec


# the options only --slurm reads
SLURM_ONLY = ("venv", "time_limit", "partition", "max_parallel", "wait")


def _wait_for_array(job_id: str, timeout_s: float) -> None:
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        proc = subprocess.run(["squeue", "-h", "-j", job_id], capture_output=True, text=True)
        if proc.returncode == 0 and not proc.stdout.strip():
            return
        time.sleep(2)
    raise click.ClickException(f"job array {job_id} still running after {timeout_s:.0f}s; "
                               f"collect later with: hvdkit sweep SPACE --out-dir DIR --collect")


class _RunByDefault(click.Group):
    """``hvdkit sweep SPACE ...`` means ``hvdkit sweep run SPACE ...``; ``status`` is a subcommand."""

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        if not args or (args[0] not in self.commands and args[0] not in ("--help", "-h")):
            args = ["run", *args]
        return super().parse_args(ctx, args)


@click.group("sweep", cls=_RunByDefault)
def sweep_group() -> None:
    """Hyperparameter search (grid/random, optionally ASHA), locally or as a Slurm job array.

    'hvdkit sweep SPACE' runs it (see 'hvdkit sweep run --help'); 'hvdkit sweep status DIR'
    shows the progress of one that is running.
    """


@sweep_group.command("status")
@click.argument("directory", type=click.Path(exists=True, file_okay=False))
@translate_errors
def sweep_status_command(directory: str) -> None:
    """Progress of the sweep in DIRECTORY (its --out): each trial's status, epochs, rungs."""
    from ..sweep import sweep_status

    click.echo(sweep_status(Path(directory)), nl=False)


@sweep_group.command("run")
@config_option
@click.argument("space", type=click.Path(exists=True, dir_okay=False))
@click.option("--scheduler", type=click.Choice(list(SCHEDULERS)), default=None,
              help="Override the space file's scheduler: asha stops bad trials at rungs; pbt (--engine ray) "
                   "copies good trials' checkpoints and perturbs their hyperparameters.")
@click.option("--engine", type=click.Choice(["local", "ray"]), default="local", show_default=True,
              help="local: trials as local processes (or --slurm: a job array); ray: a Ray Tune experiment, "
                   "each trial -np ranks on Ray workers (docs/ray.md).")
@click.option("--resume", "resume", type=click.Path(file_okay=False, exists=True), default=None,
              help="Ray: continue the interrupted experiment in this --out directory (Tuner.restore).")
@click.option("--max-failures", type=click.IntRange(min=0), default=2, show_default=True,
              help="Ray: restarts of a failed trial, each from its last checkpoint.")
@ray_options
@click.option("--eta", type=click.IntRange(min=2), default=None, help="ASHA: keep the best 1/eta per rung (3).")
@click.option("--grace", type=click.IntRange(min=1), default=None, help="ASHA: first rung, in epochs (1).")
@click.option("--out-dir", "--out", "out", type=click.Path(file_okay=False), default="sweep", show_default=True,
              help="Directory for the trials, results and ASHA state.")
@click.option("--backend", type=click.Choice(BACKENDS), default=DEFAULT_BACKEND, show_default=True,
              help="Each trial's backend (local: one plain process, -np 1, not with --slurm).")
@click.option("-np", "--np", "np", type=click.IntRange(min=1), default=1, show_default=True, help="Ranks per trial.")
@click.option("--parallel", type=click.IntRange(min=1), default=2, show_default=True,
              help="Local trials at a time (Ray: the cluster's resources decide, -c/--gpus-per-task; "
                   "with --slurm the job is sized for this many).")
@click.option("--slurm", is_flag=True, help="Run the trials as a Slurm job array instead of locally (--engine ray: "
              "one job that starts Ray on its nodes and runs the whole experiment, requeued on preemption).")
@click.option("-N", "--nodes", type=click.IntRange(min=1), default=1, show_default=True,
              help="Slurm with --engine ray: nodes of the job; it holds --parallel trials of -np ranks at once.")
@click.option("--venv", default=None, help="Slurm: virtualenv to activate on the nodes.")
@click.option("-t", "--time", "time_limit", default="01:00:00", show_default=True,
              help="Slurm: per-trial limit (--engine ray: the whole job's).")
@click.option("-p", "--partition", default=None)
@click.option("--max-parallel", type=click.IntRange(min=1), default=None, help="Slurm: %K array throttle.")
@click.option("--wait/--no-wait", default=True, show_default=True, help="Slurm: wait for the array, then collect.")
@click.option("--collect", is_flag=True, help="Only gather the results already in --out.")
@translate_errors
def sweep_command(space: str, scheduler: str | None, eta: int | None, grace: int | None, out: str,
                  backend: str, np: int, parallel: int, slurm: bool, venv: str | None,
                  time_limit: str, partition: str | None, max_parallel: int | None, wait: bool,
                  collect: bool, engine: str, resume: str | None, max_failures: int, ray_address: str | None,
                  ray_placement: str, cpus_per_task: int, gpus_per_task: int, nodes: int,
                  forward_env: tuple[str, ...] = ()) -> None:
    """Run the trials of the grid/random SPACE (YAML); print a results table and the best trial."""
    from ..launch.local import training_program
    from ..launch.slurm import SlurmJob, render_sbatch, submit
    from ..sweep import (
        best_trial,
        collect_results,
        load_space,
        plot_results,
        read_spec,
        results_table,
        run_local,
        write_trials,
    )

    ctx = click.get_current_context()
    # options that the engine, --slurm or the scheduler chosen would ignore: refused
    if engine == "local":
        refuse_unused(ctx, (*RAY_OPTIONS, "max_failures"), "is an option of --engine ray", "add --engine ray, "
                      "or drop {flag}")
    refuse_unused(ctx, SLURM_ONLY if not slurm else (), "is an option of --slurm", "add --slurm, or drop {flag}")
    refuse_unused(ctx, ("max_parallel",) if engine == "ray" else (), "throttles a job array; --engine ray --slurm "
                  "runs one job", "size it with --parallel and --nodes, and drop {flag}")
    try:  # before anything is written: every mistake in the space is a usage error
        if slurm or np > 1:
            traits(backend, launched=True)
        spec = load_space(space)
        overrides = {k: v for k, v in (("scheduler", scheduler), ("eta", eta), ("grace", grace)) if v is not None}
        if overrides:
            spec = dataclasses.replace(spec, **overrides)  # type: ignore[arg-type]  # validated again
        refuse_unused(ctx, ("eta", "grace") if spec.scheduler == "none" else ("eta",) if spec.scheduler == "pbt"
                      else (), f"is an option of scheduler: asha; this sweep's scheduler is {spec.scheduler}",
                      "add --scheduler asha (or scheduler: asha in the space), or drop {flag}")
        from ..sweep import expand_trials
        from .validate import check_sweep_trials

        # every trial (and every value a random space could draw) as hvdkit train will parse
        # and check it: a bad value is one line now, not a failed trial in the results table
        check_sweep_trials(spec, expand_trials(spec), backend)
        if engine == "ray":
            from ..rayrun.tune import check_ray_sweep
            from ..rayrun.workers import ray_backend

            if slurm and (ray_address or resume):
                raise ConfigError(f"--slurm starts Ray inside the job, and a requeued job resumes by itself: "
                                  f"{'--ray-address' if ray_address else '--resume'} has no place there",
                                  "drop it, or drop --slurm to use a running cluster")
            ray_backend(backend)
            check_ray_sweep(spec)
        elif spec.scheduler == "pbt" or resume:
            raise ConfigError(f"{'scheduler: pbt' if spec.scheduler == 'pbt' else '--resume'} runs on Ray Tune",
                              "add --engine ray")
        if nodes > 1 and not (slurm and engine == "ray"):
            raise ConfigError("--nodes sizes the job of --engine ray --slurm", "add both, or drop --nodes")
    except ConfigError as exc:
        raise click.UsageError(str(exc)) from None
    usable_output(resume or out, "--resume" if resume else "--out", directory=True)
    out_dir = Path(resume or out).resolve()
    if collect:
        try:
            read_spec(out_dir)
        except ConfigError as exc:
            raise click.UsageError(f"--collect: {exc}") from None
    if engine == "ray" and slurm and not collect:
        job_id = _submit_ray_sweep(out_dir, Path(space).resolve(), overrides, backend, np, parallel, nodes,
                                   cpus_per_task, gpus_per_task, ray_placement, max_failures, time_limit,
                                   partition, venv, forward_env)
        if not wait:
            return
        _wait_for_array(job_id, timeout_s=24 * 3600)
    elif engine == "ray" and not collect:
        ray = ray_spec(np, ray_address, ray_placement, cpus_per_task, gpus_per_task, forward_env)
        _sweep_on_ray(out_dir, spec, backend, ray, bool(resume), max_failures)
    elif not collect:
        trials = write_trials(out_dir, spec)
        click.echo(f"{len(trials)} trials written to {out_dir / 'trials'}", err=True)
        if slurm:
            array = f"0-{len(trials) - 1}" + (f"%{max_parallel}" if max_parallel else "")
            python = "python" if venv else sys.executable
            try:
                job = SlurmJob(program=tuple(training_program(backend, [], python)),
                               backend=backend, job_name="hvdkit-sweep",
                               tasks_per_node=np, time=time_limit, partition=partition, venv=venv,
                               output=str(out_dir / "logs" / "%x-%A_%a.out"), array=array,
                               array_params=str(out_dir / "params.txt"), results_dir=str(out_dir / "results"),
                               signal_seconds=None, requeue=False)
            except ConfigError as exc:
                raise click.UsageError(str(exc)) from None
            (out_dir / "logs").mkdir(exist_ok=True)
            script = out_dir / "sweep.sbatch"
            script.write_text(render_sbatch(job))
            job_id = submit(script.read_text(), cwd=out_dir)
            click.echo(f"Submitted batch job {job_id} ({len(trials)} array tasks)")
            if not wait:
                return
            _wait_for_array(job_id, timeout_s=24 * 3600)
        else:
            codes = run_local(out_dir, spec, trials, backend, np, parallel)
            failed = [i for i, c in enumerate(codes) if c]
            if failed:
                click.echo(f"trials {failed} failed; logs in {out_dir / 'trials'}", err=True)
    rows = collect_results(out_dir, spec)
    table = results_table(rows, spec)
    (out_dir / "results.md").write_text(table)
    (out_dir / "results.json").write_text(json.dumps(rows, indent=2) + "\n")
    try:
        plot_results(rows, spec, out_dir / "results.png")
    except ImportError:
        click.echo("no results.png: matplotlib is missing (pip install 'hvdkit[plots]')", err=True)
    click.echo(table, nl=False)
    best = best_trial(rows, spec)
    if best is None:
        raise click.ClickException("no trial produced the metric; see the trial logs")
    click.echo(f"best: trial {best['trial']} {spec.metric}={best[spec.metric]:.6g} params={best['params']}")
    click.echo(f"wrote {out_dir / 'results.md'}, results.json, results.png", err=True)


def _submit_ray_sweep(out_dir: Path, space: Path, overrides: dict[str, Any], backend: str, np: int, parallel: int,
                      nodes: int, cpus: int, gpus: int, placement: str, max_failures: int, time_limit: str,
                      partition: str | None, venv: str | None, forward: tuple[str, ...] = ()) -> str:
    """One Slurm job that starts Ray on its nodes and runs this sweep's Tune driver in it
    (slurm/ray.sbatch); requeued on preemption, it continues the experiment. Returns the job id."""
    from ..launch.slurm import RAY_ENGINE, SlurmJob, render_sbatch, submit
    from ..rayrun.cluster import require_ray

    if parallel * np % nodes:
        raise click.UsageError(f"--parallel {parallel} trials of -np {np} ranks do not fill --nodes {nodes} evenly. "
                               f"HINT: make --parallel x -np a multiple of --nodes")
    python = "python" if venv else sys.executable
    driver = [python, "-m", "hvdkit", "sweep", "run", str(space), "--engine", "ray", "--out", str(out_dir),
              "--backend", backend, "-np", str(np), "-c", str(cpus), "--gpus-per-task", str(gpus),
              "--ray-placement", placement, "--max-failures", str(max_failures)]
    for key, value in overrides.items():
        driver += [f"--{key}", str(value)]
    for name in forward:  # sbatch exports this shell's variables to the job; the driver passes them on
        driver += ["-x", name]
    try:
        require_ray()
        job = SlurmJob(program=tuple(driver), backend=backend, job_name="hvdkit-sweep", nodes=nodes,
                       tasks_per_node=parallel * np // nodes, cpus_per_task=cpus,
                       gpus_per_node=gpus * parallel * np // nodes, time=time_limit, partition=partition,
                       venv=venv, output=str(out_dir / "logs" / "%x-%j.out"), launcher=RAY_ENGINE,
                       requeue=True, ray_sweep_dir=str(out_dir))
        text = render_sbatch(job)
    except ConfigError as exc:
        raise click.UsageError(str(exc)) from None
    (out_dir / "logs").mkdir(parents=True, exist_ok=True)
    script = out_dir / "sweep-ray.sbatch"
    script.write_text(text)
    job_id = submit(text, cwd=out_dir)
    click.echo(f"Submitted batch job {job_id} (Ray on {nodes} node(s), {parallel} trial(s) of {np} rank(s) at once; "
               f"log {out_dir / 'logs'})")
    return job_id


def _sweep_on_ray(out_dir: Path, spec: SweepSpec, backend: str, ray: RaySpec, resume: bool,
                  max_failures: int) -> None:
    """The trials as one Ray Tune experiment (hvdkit.rayrun.tune); resumed from out_dir with ``resume``.
    Preempted (USR1): exits 75 once every running trial has checkpointed and the experiment is saved."""
    from ..preemption import EXIT_PREEMPTED
    from ..rayrun.cluster import check_fits, connect
    from ..rayrun.layout import EXPERIMENT, TUNE_DIR, TUNER_STATE
    from ..rayrun.tune import run_tune
    from ..sweep import expand_trials, read_spec, write_trials

    if resume:
        if not (out_dir / TUNE_DIR / EXPERIMENT / TUNER_STATE).is_file():
            raise click.UsageError(f"{out_dir} holds no Ray sweep to resume (no {TUNE_DIR}/{EXPERIMENT}/"
                                   f"{TUNER_STATE}). HINT: pass the --out of an earlier 'hvdkit sweep --engine ray'")
        try:
            spec = read_spec(out_dir)
        except ConfigError as exc:
            raise click.UsageError(f"--resume: {exc}") from None
    started = time.monotonic()
    try:
        with connect(ray):
            check_fits(ray, "a trial")  # GPUs, spread: refused before a trial is written to --out
            if resume:
                trials = expand_trials(spec)
            else:
                trials = write_trials(out_dir, spec)
                click.echo(f"{len(trials)} trials written to {out_dir / 'trials'}", err=True)
            summary = run_tune(out_dir, spec, trials, backend, ray, resume=resume, max_failures=max_failures)
    except ConfigError as exc:
        raise click.UsageError(str(exc)) from None
    if summary["preempted"]:
        click.echo(f"preempted (exit {EXIT_PREEMPTED}): the running trials checkpointed and the experiment is saved "
                   f"in {out_dir / 'tune'}; continue it with: hvdkit sweep run SPACE --engine ray --resume {out_dir}",
                   err=True)
        sys.exit(EXIT_PREEMPTED)
    summary["wall_s"] = round(time.monotonic() - started, 1)
    (out_dir / "tune-summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    for e in summary["exploits"]:
        click.echo(f"pbt: trial {e['trial']} exploited trial {e['from']}'s checkpoint at epoch {e['epoch']}")
