"""``hvdkit plot``: the curves of one or more runs from their metrics files, side by side.

Left: the training loss per epoch (solid) and the validation loss (dashed) of every run;
right: the other held-out metrics (accuracy, perplexity, yours), one panel each, at most
three. Each run is labelled by its file name, backend, world size and shard mode (when sharded). matplotlib draws it
(``pip install 'hvdkit[plots]'``).
"""

from __future__ import annotations

import io
import json
import math
from pathlib import Path
from typing import Any

from .errors import HvdkitError
from .fileio import check_output_path, write_bytes_atomic

__all__ = ["load_runs", "plot_runs", "check_out", "FORMATS"]


def load_runs(paths: list[str]) -> list[tuple[str, dict[str, Any]]]:
    """(label, metrics) of each metrics file; one-line errors for a missing or foreign file."""
    runs = []
    for path in map(Path, paths):
        try:
            data = json.loads(path.read_text())
        except OSError as exc:
            raise HvdkitError(f"cannot read {path}: {exc.strerror}", "pass files written by --metrics-file") from None
        except ValueError:
            raise HvdkitError(f"{path} is not JSON", "pass files written by --metrics-file") from None
        if not isinstance(data, dict) or not isinstance(data.get("history"), list):
            raise HvdkitError(f"{path} holds no training history", "pass files written by hvdkit train --metrics-file")
        if not data["history"]:
            raise HvdkitError(f"{path} holds no finished epoch: the run ended before its first one",
                              "plot it once an epoch has finished")
        for n, record in enumerate(data["history"]):
            bad = next((k for k in ("epoch", "step", "loss") if not _number(record.get(k) if isinstance(
                record, dict) else None)), None)
            if bad is not None:
                raise HvdkitError(f"{path}: history record {n} has no numeric {bad!r}",
                                  "pass files written by hvdkit train --metrics-file, unedited")
        if not any(math.isfinite(record["loss"]) for record in data["history"]):
            raise HvdkitError(f"{path}: every epoch's loss is nan or infinite, so there is nothing to draw",
                              "the run diverged: rerun it with a lower --lr, then plot it")
        shard = data.get("shard", "none")
        label = f"{path.stem} ({data.get('backend', '?')}, {data.get('world_size', '?')} ranks" \
                f"{'' if shard == 'none' else f', --shard {shard}'})"
        runs.append((label, data))
    return runs


FORMATS = (".png", ".svg", ".pdf")


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def check_out(out: str | Path) -> Path:
    """``out`` names a figure hvdkit can write: a known suffix, in a directory that exists."""
    path = Path(out)
    if path.suffix.lower() not in FORMATS:
        raise HvdkitError(f"-o {out}: the figure's format comes from its suffix, and {path.suffix or 'none'} is "
                          f"not one of {', '.join(FORMATS)}", f"e.g. -o {path.with_suffix('.png').name}")
    return check_output_path(path, "-o")


def plot_runs(runs: list[tuple[str, dict[str, Any]]], out: str | Path, x: str = "epoch") -> Path:
    """Write the figure to ``out`` (PNG, SVG or PDF by its suffix), atomically."""
    out = check_out(out)
    try:
        import matplotlib
    except ImportError:
        raise HvdkitError("hvdkit plot needs matplotlib", "pip install 'hvdkit[plots]'") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    extra = []
    for _, data in runs:
        for record in data["history"]:
            for key in record:
                if key.startswith("val_") and key not in ("val_loss", "val_count") and key not in extra:
                    extra.append(key)
    extra = extra[:3]
    from matplotlib.ticker import MaxNLocator

    fig, axes = plt.subplots(1, 1 + len(extra), figsize=(5.2 * (1 + len(extra)), 3.8), squeeze=False)
    loss_ax = axes[0][0]
    for i, (label, data) in enumerate(runs):
        color = f"C{i % 10}"
        hist = data["history"]
        xs = [r["step"] if x == "step" else r["epoch"] for r in hist]  # epochs from 0, as the log counts
        loss_ax.plot(xs, [r["loss"] for r in hist], "-o", color=color, ms=3, label=f"{label} train")
        val = [(xv, r["val_loss"]) for xv, r in zip(xs, hist) if "val_loss" in r]
        if val:
            loss_ax.plot(*zip(*val), "--s", color=color, ms=3, label=f"{label} val")
        for ax, key in zip(axes[0][1:], extra):
            points = [(xv, r[key]) for xv, r in zip(xs, hist) if key in r]
            if points:
                ax.plot(*zip(*points), "--s", color=color, ms=3, label=label)
    loss_ax.set_title("loss (solid: training, dashed: validation)")
    loss_ax.set_ylabel("loss")
    values = [v for line in loss_ax.lines for v in line.get_ydata() if v > 0]
    if values and max(values) / min(values) > 20:  # the first epochs would flatten the rest
        loss_ax.set_yscale("log")
    for ax, key in zip(axes[0][1:], extra):
        ax.set_title(key)
    for ax in axes[0]:
        ax.set_xlabel("optimizer step" if x == "step" else "epoch")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # no epoch 2.5
        ax.grid(alpha=0.3)
        if ax.lines:
            ax.legend(fontsize=7)
    fig.tight_layout()
    figure = io.BytesIO()
    fig.savefig(figure, dpi=110, format=out.suffix.lower()[1:])
    plt.close(fig)
    try:
        return write_bytes_atomic(out, figure.getvalue())  # never a half-written figure
    except OSError as exc:
        raise HvdkitError(f"cannot write {out}: {exc.strerror or exc}", "choose another -o path") from None
