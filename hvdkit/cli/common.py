"""Shared click plumbing: config files as defaults, and one-line errors."""

from __future__ import annotations

import functools
import json
import math
import os
import sys
import tomllib
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import click

from ..errors import HvdkitError, first_line

__all__ = ["config_option", "load_config_file", "translate_errors", "ray_options", "ray_spec", "FiniteFloat"]


def load_config_file(path: str | Path) -> dict[str, Any]:
    """Read a YAML (.yaml/.yml), TOML (.toml) or JSON file into a flat dict of option defaults.

    Keys may use dashes or underscores (``--tasks-per-node`` == ``tasks_per_node``).
    """
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as exc:
        raise click.BadParameter(f"cannot read {path}: {exc.strerror}", param_hint="--config") from None
    try:
        if path.suffix == ".toml":
            data = tomllib.loads(text)
        elif path.suffix == ".json":
            data = json.loads(text)
        else:
            import yaml

            data = yaml.safe_load(text) or {}
    except Exception as exc:  # any parser error is the user's file
        first = first_line(exc, limit=None)
        raise click.BadParameter(f"{path} is not valid: {first}", param_hint="--config") from None
    if not isinstance(data, dict):
        raise click.BadParameter(f"{path} must hold a mapping of option: value", param_hint="--config")
    return {str(k).replace("-", "_"): v for k, v in data.items()}


def _apply_config(ctx: click.Context, param: click.Parameter, value: str | None) -> str | None:
    if value:
        data = load_config_file(value)
        known = {p.name for p in ctx.command.params if p.name}
        unknown = sorted(set(data) - known)
        if unknown:
            raise click.BadParameter(
                f"unknown key(s) in {value}: {', '.join(unknown)}", param_hint="--config"
            )
        ctx.default_map = {**(ctx.default_map or {}), **data}
    return value


def usable_output(path: str | Path, flag: str, directory: bool = False) -> None:
    """A file (or, with ``directory``, a directory) the command will write: writable, its
    directory existing (a directory may be created under the nearest existing one), else a
    usage error (exit 2) naming ``flag``, before anything is rendered or started."""
    from ..errors import ConfigError
    from ..fileio import check_output_path, check_writable

    try:
        if directory:
            check_writable(path, flag, directory=True)
        else:
            check_output_path(path, flag)
    except ConfigError as exc:
        raise click.UsageError(str(exc)) from None


def config_option(f: Callable[..., Any]) -> Callable[..., Any]:
    """``--config FILE``: option defaults from YAML/TOML/JSON; flags on the command line win."""
    return click.option(
        "--config",
        type=click.Path(dir_okay=False),
        is_eager=True,
        expose_value=False,
        callback=_apply_config,
        help="YAML/TOML/JSON file of option defaults; command-line flags override it.",
    )(f)


def translate_errors(f: Callable[..., Any]) -> Callable[..., Any]:
    """Turn :class:`HvdkitError` into a one-line ``Error: ...`` and its exit status (1, or the
    error's own: 65 for a non-finite loss)."""

    @functools.wraps(f)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return f(*args, **kwargs)
        except HvdkitError as exc:
            if not exc.echo:  # the same error is printed by rank 0
                sys.exit(exc.exit_code)
            # click's exit status is a class attribute: a subclass carries the error's own
            failure = type("HvdkitFailure", (click.ClickException,), {"exit_code": exc.exit_code})
            raise failure(str(exc)) from None

    return wrapper



def given_options(ctx: click.Context) -> dict[str, click.Parameter]:
    """The options the user gave, on the command line or in ``--config``, by name: not
    defaults, and not the environment (a RAY_ADDRESS set for other work is not a mistake)."""
    from click.core import ParameterSource

    return {p.name: p for p in ctx.command.params if p.name and ctx.get_parameter_source(p.name)
            in (ParameterSource.COMMANDLINE, ParameterSource.DEFAULT_MAP)}


def refuse_unused(ctx: click.Context, names: Iterable[str], why: str, fix: str) -> None:
    """One usage error naming the first option of ``names`` the user gave: with what else was
    chosen, it would do nothing (``why``: '... is an option of X'; ``fix``: the HINT)."""
    given = given_options(ctx)
    for name in names:
        if name in given:
            flag = given[name].opts[-1] if given[name].opts[-1].startswith("--") else given[name].opts[0]
            raise click.UsageError(f"{flag} {why}. HINT: {fix.replace('{flag}', flag)}")


# the options of ray_options(), by name: given without Ray they would do nothing
RAY_OPTIONS = ("ray_address", "ray_placement", "cpus_per_task", "gpus_per_task", "forward_env")


def ray_options(f: Callable[..., Any]) -> Callable[..., Any]:
    """Where ranks go on Ray (``hvdkit run --launcher ray``, ``hvdkit sweep --engine ray``)."""
    from ..rayrun.cluster import PLACEMENTS

    for option in reversed([
        click.option("--ray-address", default=None, envvar="RAY_ADDRESS",
                     help="Ray: join the cluster whose head is at host:port [env RAY_ADDRESS]; without it an "
                          "embedded Ray instance runs on this machine for the job."),
        click.option("--ray-placement", type=click.Choice(list(PLACEMENTS)), default="pack", show_default=True,
                     help="Ray: pack ranks onto few nodes, or spread them one per node."),
        click.option("-c", "--cpus-per-task", type=click.IntRange(min=1), default=1, show_default=True,
                     help="Ray: CPUs reserved for each rank (as hvdkit slurm's)."),
        click.option("--gpus-per-task", type=click.IntRange(min=0), default=0, show_default=True,
                     help="Ray: GPUs reserved for each rank."),
        click.option("-x", "forward_env", multiple=True, metavar="NAME",
                     help="Ray: pass this shell's variable NAME to the ranks too (repeatable; as mpirun -x). "
                          "By default they get PATH, PYTHONPATH, the thread, NCCL/Gloo/Horovod and HVDKIT_* ones."),
    ]):
        f = option(f)
    return f


def ray_spec(np: int, ray_address: str | None, ray_placement: str, cpus_per_task: int, gpus_per_task: int,
             forward_env: tuple[str, ...] = ()) -> Any:
    """The options of :func:`ray_options` as a checked :class:`hvdkit.rayrun.cluster.RaySpec`;
    Ray installed and the address answering, or a one-line usage error."""
    from click.core import ParameterSource

    from ..errors import ConfigError
    from ..rayrun.cluster import RaySpec, probe_address, require_ray

    ctx = click.get_current_context(silent=True)
    from_env = ctx is not None and ctx.get_parameter_source("ray_address") == ParameterSource.ENVIRONMENT
    try:
        from ..launch.templates import check_env_name

        for name in forward_env:
            check_env_name(name)
            if name not in os.environ:
                raise ConfigError(f"-x {name}: this shell has no variable {name} to pass on",
                                  f"export {name}=... first, or drop -x {name}")
        spec = RaySpec(np=np, address=ray_address or None, placement=ray_placement,
                       cpus_per_task=float(cpus_per_task), gpus_per_task=float(gpus_per_task),
                       forward=tuple(forward_env))
        require_ray()
        if spec.address:  # named as the user gave it: an exported RAY_ADDRESS is not an option they typed
            probe_address(spec.address, source="RAY_ADDRESS" if from_env else "--ray-address")
    except ConfigError as exc:
        raise click.UsageError(str(exc)) from None
    return spec


class FiniteFloat(click.FloatRange):
    """A float option's type: its range (if any), and never nan or inf. A range check alone lets
    nan through (every comparison with it is false), and no option of training means anything
    by nan or inf."""

    name = "float"

    def _describe_range(self) -> str:
        return "finite" if self.min is None and self.max is None else f"finite, {super()._describe_range()}"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        out = super().convert(value, param, ctx)
        if isinstance(out, float) and not math.isfinite(out):
            self.fail(f"{value!r} is not a finite number", param, ctx)
        return out
