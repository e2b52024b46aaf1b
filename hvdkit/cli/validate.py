"""Checks made when a launch line or job script is generated, so mistakes never wait in a queue.

Everything here is torch-free and fast: the training options are parsed by ``hvdkit train``'s
own click parser and typed config, the program after ``--`` is looked up, and array
specifications and their parameter files are checked against each other. The one exception,
only with ``hvdkit slurm --mem``: the model is sized on the meta device in a child process
(:mod:`hvdkit.cli.jobmem`, a few seconds), never in this one.
"""

from __future__ import annotations

import difflib
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click

from ..config import TrainConfig
from ..errors import ConfigError
from ..launch.slurm import array_indices, mem_bytes

if TYPE_CHECKING:
    from ..sweep import SweepSpec

__all__ = ["check_program", "check_train_args", "check_sweep_trials", "check_array_params", "check_import_paths",
           "check_job_memory", "is_program"]

# Slurm's own spellings that users type after '--' out of habit: where they belong instead
SLURM_SPELLINGS = {
    "--ntasks-per-node": "--tasks-per-node", "--ntasks": "-N and --tasks-per-node",
    "--nodes": "-N/--nodes", "--gres": "--gpus-per-node", "--gpus": "--gpus-per-node",
    "--cpus-per-task": "-c/--cpus-per-task", "--partition": "-p/--partition",
    "--account": "-A/--account", "--time": "-t/--time", "--mem": "--mem",
}


def is_program(args: Sequence[str]) -> bool:
    """True when ``args`` name a program of the user's (not options for ``hvdkit train``)."""
    return bool(args) and not args[0].startswith("-")


def check_train_args(args: Sequence[str], where: str = "after '--'", backend: str | None = None) -> TrainConfig:
    """Parse ``args`` exactly as ``hvdkit train`` will on the nodes (after ``--backend backend``,
    as the launched command has it); raise a UsageError now. Returns the run's config."""
    from .train_cmd import build_train_config, check_given_options, train_command

    for arg in args:
        name = arg.split("=", 1)[0]
        if name in SLURM_SPELLINGS:
            raise click.UsageError(
                f"{name} {where} would be passed to training, which has no such option. "
                f"HINT: it is a scheduler option: use hvdkit's {SLURM_SPELLINGS[name]} before '--'")
    try:
        given = ["--backend", backend, *args] if backend else list(args)
        # the ranks read HVDKIT_TRAIN_* too (the group's auto_envvar_prefix): so does this check
        from ..launch.vocabulary import TRAIN_ENV_PREFIX

        ctx = train_command.make_context("hvdkit train", given, resilient_parsing=False,
                                         auto_envvar_prefix=TRAIN_ENV_PREFIX)
        check_given_options(ctx)
        cfg = build_train_config(ctx.params)
        check_import_paths(cfg)
        cfg.check_outputs()
        return cfg
    except click.NoSuchOption as exc:
        raise click.UsageError(_unknown_option(exc, where)) from None
    except click.UsageError as exc:
        raise click.UsageError(f"training option {where}{_from_environment(exc)}: "
                               f"{exc.format_message().rstrip('.')}. HINT: see 'hvdkit train --help'") from None
    except ConfigError as exc:
        raise click.UsageError(f"training option {where}{_from_environment(exc)}: {exc}") from None



def check_sweep_trials(spec: SweepSpec, trials: list[dict[str, Any]], backend: str) -> None:
    """Every trial of a sweep parses and passes ``hvdkit train``'s checks, and reports the
    sweep's metric, before the first one runs (both engines, and a Slurm array); so does every
    value a random space could draw or PBT could move to (each choice and both bounds)."""
    from ..sweep import probe_trials, trial_args

    metric = "loss" if spec.metric == "final_loss" else spec.metric
    seen: set[tuple[str, ...]] = set()
    for label, params in probe_trials(spec, trials):
        args = trial_args({**spec.fixed, **params})
        if tuple(args) in seen:
            continue
        seen.add(tuple(args))
        cfg = check_train_args(args, where=f"in {label}", backend=backend)
        known = cfg.epoch_metrics()
        if metric.startswith("val_") and not cfg.has_validation:
            raise click.UsageError(f"metric {spec.metric} needs validation data, which {label} has none of. "
                                   "HINT: add val_fraction: 0.1 or val_data: FILE to fixed:")
        if known is not None and metric not in known:
            raise click.UsageError(f"metric {spec.metric} is never reported: {label} reports "
                                   f"{', '.join(k for k in known if k != 'samples_per_sec')}. "
                                   "HINT: name one of them, or final_loss")


def _from_environment(exc: Exception) -> str:
    """' (or HVDKIT_TRAIN_X in the environment)' when such variables are set: a value the
    command line does not show may be the one refused."""
    import os

    from ..launch.vocabulary import TRAIN_ENV_PREFIX, train_env_var

    param = getattr(exc, "param", None)
    named = train_env_var(param.name) if param is not None and param.name else None
    if named and named in os.environ:
        return f" (from {named}={os.environ[named]!r} in the environment)"
    found = sorted(k for k in os.environ if k.startswith(TRAIN_ENV_PREFIX + "_"))
    return f" (or the environment's {', '.join(found[:3])})" if found else ""


def check_import_paths(cfg: TrainConfig) -> None:
    """Models, datasets, tasks and optimizers named by import path exist, and their arguments
    are ones they take, as far as can be seen without importing them (no torch here)."""
    from ..factories import check_static

    for value, args, what, skip in cfg.import_paths():
        check_static(value, args, what=what, skip=skip)


JOB_MEMORY_TIMEOUT_S = 300  # the child imports torch and builds the model on meta: seconds, measured


def check_job_memory(args: Sequence[str], backend: str, nodes: int, per_node: int, mem: str,
                     workdir: str | None = None) -> None:
    """A UsageError now when a node's ``--mem`` cannot hold what its ``per_node`` ranks need at
    the least (:func:`hvdkit.preflight.job_check`: parameters, gradients, optimizer state, in
    flight), naming a mode that fits; a warning line when the model could not be sized here."""
    try:
        limit = mem_bytes(mem)
    except ConfigError as exc:
        raise click.UsageError(str(exc)) from None
    if limit is None:  # --mem=0: the whole node, whose size is not known here
        return
    argv = [sys.executable, "-m", "hvdkit.cli.jobmem", str(nodes), str(per_node), str(limit), backend, "--", *args]
    where = workdir if workdir and Path(workdir).is_dir() else None  # relative import paths are the job's
    try:
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=JOB_MEMORY_TIMEOUT_S, cwd=where)
        verdict = (proc.stdout.strip().splitlines() or [""])[-1]
        why = proc.stderr.strip().splitlines()[-1:] or [f"exit {proc.returncode}"]
    except subprocess.TimeoutExpired:
        verdict, why = "", [f"sizing the model took over {JOB_MEMORY_TIMEOUT_S} s"]
    kind, _, text = verdict.partition(" ")
    if kind == "over":
        raise click.UsageError(f"--mem {mem}: {text}")
    if kind != "fits":
        click.echo(f"Warning: --mem {mem} was not checked against the model here ({text or why[0]}); the run "
                   "checks its memory before step 1", err=True)


def _unknown_option(exc: click.NoSuchOption, where: str) -> str:
    """'no such option' with the closest name among the outer command's and training's options."""
    from .train_cmd import train_command

    outer = click.get_current_context(silent=True)
    ours = [o for p in outer.command.params for o in (*p.opts, *p.secondary_opts)
            if o.startswith("--")] if outer is not None and outer.command is not train_command else []
    theirs = [o for p in train_command.params for o in (*p.opts, *p.secondary_opts) if o.startswith("--")]
    name = exc.option_name
    close = difflib.get_close_matches(name, ours + theirs, n=1, cutoff=0.75)
    prefix = [o for o in ours + theirs if o.startswith(name)]
    guess = prefix[0] if len(prefix) == 1 else (close[0] if close else None)
    if guess in ours and outer is not None:
        return (f"{name} is not a training option (it came {where}); did you mean "
                f"'{outer.command_path} {guess}' (before '--')? HINT: see '{outer.command_path} --help'")
    hint = f"did you mean {guess}? " if guess else ""
    return f"training option {where}: no such option {name}. HINT: {hint}see 'hvdkit train --help'"


_INTERPRETER = re.compile(r"^(python[\d.]*|bash|sh)$")


def check_program(args: Sequence[str], venv: str | None = None, workdir: str | None = None) -> None:
    """A program after ``--`` must exist and be runnable as written, here and so on the nodes;
    so must the script an interpreter is given (``python train.py``), relative to ``workdir``."""
    exe = args[0]
    if _INTERPRETER.match(Path(exe).name) and len(args) > 1 and not args[1].startswith("-"):
        script = Path(workdir or ".") / args[1] if not Path(args[1]).is_absolute() else Path(args[1])
        if not script.is_file():
            raise click.UsageError(f"{exe} would run {args[1]}, which does not exist (relative to "
                                   f"{workdir or os.getcwd()}). HINT: give a path the compute nodes can see")
    if "/" in exe or exe.endswith(".py"):
        path = Path(exe)
        if not path.exists():
            raise click.UsageError(f"program {exe} does not exist (relative to {os.getcwd()}). "
                                   "HINT: give a path the compute nodes can see")
        if not os.access(path, os.X_OK):
            raise click.UsageError(f"program {exe} is not executable. HINT: put the interpreter "
                                   f"in front (-- python {exe} ...) or chmod +x it")
        return
    found = shutil.which(exe) or (venv and (Path(venv) / "bin" / exe).is_file())
    if not found:
        raise click.UsageError(f"program {exe!r} is not on PATH here"
                               + (f" nor in {venv}/bin" if venv else "")
                               + ". HINT: give its full path, or load what provides it")


def check_array_params(spec: str, params_file: str, train_options: bool) -> list[str]:
    """The parameter file exists, has a line for every task index (line i+1 = task i) and
    no more, and, for ``hvdkit train``, every line parses as training options."""
    indices = array_indices(spec)
    path = Path(params_file)
    try:
        lines = path.read_text().splitlines()
    except OSError as exc:
        raise ConfigError(f"--array-params {params_file}: {exc.strerror}",
                          "give an existing file, one line of options per array task") from None
    if len(lines) != max(indices) + 1:
        raise ConfigError(f"--array-params {params_file} has {len(lines)} line(s) but --array {spec} "
                          f"needs {max(indices) + 1} (line i+1 holds task i's options)",
                          "make the file and the array agree")
    if train_options:
        import shlex

        for i in indices:
            check_train_args(shlex.split(lines[i]), where=f"on line {i + 1} of {params_file}")
    return lines
