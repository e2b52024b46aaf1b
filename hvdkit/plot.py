"""``hvdkit plot``: the curves of one or more runs from their metrics files, side by side.

Left: the training loss per epoch (solid) and the validation loss (dashed) of every run;
right: the other held-out metrics (accuracy, perplexity, yours), one panel each, at most
three. Each run is labelled by its file name, backend and world size. matplotlib draws it
(``pip install 'hvdkit[plots]'``).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from .errors import HvdkitError

__all__ = ["load_runs", "plot_runs"]


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
        label = f"{path.stem} ({data.get('backend', '?')}, {data.get('world_size', '?')} ranks)"
        runs.append((label, data))
    return runs


def plot_runs(runs: list[tuple[str, dict[str, Any]]], out: str | Path, x: str = "epoch") -> Path:
    """Write the figure to ``out`` (PNG, SVG or PDF by its suffix)."""
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
        xs = [r["step"] if x == "step" else r["epoch"] + 1 for r in hist]
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
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out
