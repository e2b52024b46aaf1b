"""``hvdkit bench``: run the benchmark suite and write JSON, PNG plots and markdown tables."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import click

from .common import FiniteFloat, config_option, translate_errors, usable_output


def _numbers(text: str | None, option: str, kind: type) -> tuple[Any, ...] | None:
    """``1,2,4`` as numbers of ``kind`` (a whole float such as 1e6 is an int); one-line error."""
    if text is None:
        return None
    out = []
    for item in text.split(","):
        try:
            value = float(item)
            if kind is int:
                if not value.is_integer():
                    raise ValueError
                value = int(value)
        except (ValueError, OverflowError):
            what = "whole numbers" if kind is int else "numbers"
            raise click.BadParameter(f"{item.strip()!r} in {text!r} is not a number: a comma list of {what}",
                                     param_hint=option) from None
        out.append(value)
    return tuple(out)


@click.command("bench")
@config_option
@click.option("--quick", is_flag=True, help="The default Horovod path against DDP and the floor (mlp): under "
                                           "a minute on 2 cores.")
@click.option("--out-dir", "--out", "out", type=click.Path(file_okay=False), default="bench-results",
              show_default=True, help="Directory for the JSON, tables and figures.")
@click.option("--only", default=None,
              help="Comma list of: paths,reducer,ab,fusion,scaling,allreduce,ckpt,overhead,model.")
@click.option("--models", default=None, help="Comma list of example models (default cnn,mlp; paths: "
                                             "mlp,cnn,gpt,resnet18).")
@click.option("--paths", "launch_paths", default=None,
              help="Comma list of launch paths for 'paths' (default: all; mpirun ddp always).")
@click.option("--slurm", is_flag=True, help="paths: also srun on the cluster this machine submits to.")
@click.option("-np", "--np", "np", type=click.IntRange(min=2), default=2, show_default=True)
@click.option("-H", "--hosts", default=None,
              help="Cross-node mode: mpirun -H hosts for the reducer and allreduce runs (e.g. "
                   "node1:1,node2:1); run it on one of them.")
@click.option("--steps", type=click.IntRange(min=2), default=None, help="Timed steps per block.")
@click.option("--rounds", type=click.IntRange(min=1), default=None, help="A/B rounds.")
@click.option("--sizes", default=None, help="Allreduce sizes in bytes, comma list.")
@click.option("--world-sizes", default=None, help="Scaling world sizes, comma list (default 1,2,4).")
@click.option("--fusion-mb", default=None, help="Fusion thresholds to sweep (MB).")
@click.option("--bucket-mb", default=None, help="DDP bucket sizes to sweep (MB).")
@click.option("--cycle-ms", default=None, help="Horovod cycle times to sweep (ms).")
@click.option("--ckpt-params-m", type=FiniteFloat(min=0.01), default=None, help="Checkpoint size, M params.")
@click.option("--overhead-epochs", type=click.IntRange(min=2), default=None)
@translate_errors
def bench_command(quick: bool, out: str, only: str | None, models: str | None, **o: Any) -> None:
    """Horovod vs DDP, fusion sweep, scaling, allreduce bandwidth, checkpoint I/O, cost model."""
    from ..bench.suite import EXPERIMENTS, BenchConfig, run_suite

    overrides: dict[str, Any] = {"out": Path(out), "np": o["np"], "hosts": o["hosts"]}
    if only:
        overrides["only"] = tuple(x.strip() for x in only.split(","))
        bad = set(overrides["only"]) - set(EXPERIMENTS)
        if bad:
            raise click.BadParameter(f"unknown: {', '.join(sorted(bad))}", param_hint="--only")
    if models:
        overrides["models"] = tuple(x.strip() for x in models.split(","))
        overrides["path_models"] = overrides["models"]
    if o["launch_paths"]:
        from ..bench.paths import PATHS

        overrides["paths"] = tuple(x.strip() for x in o["launch_paths"].split(","))
        bad = set(overrides["paths"]) - set(PATHS)
        if bad:
            raise click.BadParameter(f"unknown: {', '.join(sorted(bad))}; use {', '.join(PATHS)}",
                                     param_hint="--paths")
    overrides["slurm"] = o["slurm"]
    for key, kind in (("sizes", int), ("world_sizes", int), ("fusion_mb", float), ("bucket_mb", float),
                      ("cycle_ms", float)):
        value = _numbers(o[key], "--" + key.replace("_", "-"), kind)
        if value is not None:
            overrides[key] = value
    for key in ("steps", "rounds", "ckpt_params_m", "overhead_epochs"):
        if o[key] is not None:
            overrides[key] = o[key]
    for key in ("steps", "rounds"):  # the reducer's and the paths' blocks too, when given
        if o[key] is not None:
            overrides[f"reducer_{key}"] = o[key]
            overrides[f"path_{key}"] = o[key]
    from ..errors import ConfigError

    try:  # every value checked before anything is measured or written: a usage error (exit 2)
        cfg = BenchConfig.quick(**overrides) if quick else BenchConfig(**overrides)
    except ConfigError as exc:
        raise click.UsageError(str(exc)) from None
    usable_output(out, "--out-dir", directory=True)
    run_suite(cfg, log=click.echo)
