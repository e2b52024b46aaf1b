"""``hvdkit plot``: loss and validation curves of runs, from their metrics files."""

from __future__ import annotations

import click

from .common import translate_errors


@click.command("plot")
@click.argument("metrics", nargs=-1, required=True, type=click.Path(dir_okay=False))
@click.option("-o", "--out", default="curves.png", show_default=True, type=click.Path(dir_okay=False),
              help="The figure to write (.png, .svg, .pdf).")
@click.option("--x", "x_axis", type=click.Choice(["epoch", "step"]), default="epoch", show_default=True,
              help="Epochs, or optimizer steps (to compare runs of different batch sizes).")
@translate_errors
def plot_command(metrics: tuple[str, ...], out: str, x_axis: str) -> None:
    """Training and validation curves of one or more runs (their --metrics-file), side by side."""
    from ..plot import check_out, load_runs, plot_runs

    check_out(out)  # before reading anything: a wrong -o is found first
    path = plot_runs(load_runs(list(metrics)), out, x_axis)
    click.echo(f"wrote {path}", err=True)
