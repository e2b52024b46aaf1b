"""Advice from a measurement: when communication shows in the step time, the knob that the
network bench measured to help on this cluster's link, once per run, or nothing.

``benchmarks/network.py`` measures every knob over the cluster's link and saves its result
(``network.json``) where this module looks: ``$HVDKIT_NETWORK_BENCH``, else
``$XDG_CACHE_HOME/hvdkit/network.json`` (``~/.cache/...``); ``HVDKIT_NETWORK_BENCH=`` (empty)
turns it off. When an epoch's communication
wait is at least :data:`WAIT_SHARE` of its time, the loop asks :func:`advise` once. It
answers only from that file: the variant of the run's own backend that was clearly faster
than the backend's default (its upper quartile below the default's lower quartile) and that
the run does not use already. No file, no clear winner: no advice. Nothing is guessed.
"""

from __future__ import annotations

import json
import math
import os
import stat
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .log import warn

if TYPE_CHECKING:
    from .config import TrainConfig

__all__ = ["MEASURED", "WAIT_SHARE", "bench_file", "knobs_of", "advise", "measured_controller"]

MEASURED = "measured"  # how a choice made from the bench's file begins its reason
WAIT_SHARE = 0.25  # an epoch that waits this much of its time for gradients is worth a line


def bench_file() -> Path | None:
    """Where the network bench's result is looked for (it may not exist); set and empty
    ``HVDKIT_NETWORK_BENCH=`` turns the advice off (None)."""
    if "HVDKIT_NETWORK_BENCH" in os.environ:
        explicit = os.environ["HVDKIT_NETWORK_BENCH"]
        return Path(explicit) if explicit else None
    return _default_file()


def _default_file() -> Path:
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return cache / "hvdkit" / "network.json"


def knobs_of(cfg: TrainConfig) -> dict[str, str]:
    """The run's values of the options the network bench varies."""
    b = cfg.backend
    hvd = b.horovod
    return {"--compression": b.compression.kind, "--bucket-cap-mb": str(b.bucket_cap_mb),
            "--fusion-threshold-mb": "" if hvd.fusion_threshold_mb is None else str(hvd.fusion_threshold_mb),
            "--cycle-time-ms": "" if hvd.cycle_time_ms is None else str(hvd.cycle_time_ms)}


def _same(a: str, b: str) -> bool:
    try:
        return float(a) == float(b)
    except ValueError:
        return a.split(":")[0] == b.split(":")[0]  # powersgd:rank=4 is powersgd


def _uses(knobs: dict[str, str], options: list[str]) -> bool:
    """Whether the run already has each option and value of a variant (e.g. --compression powersgd)."""
    return all(_same(knobs.get(flag, ""), value) for flag, value in zip(options[::2], options[1::2]))


MAX_BYTES = 64 << 20  # a bench file is kilobytes; anything near this is not one
_warned: set[str] = set()


def _figure(value: Any, where: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise ValueError(f"{where} is {json.dumps(value)[:40]}, not a positive number of seconds")
    return float(value)


def _checked(report: Any) -> tuple[list[dict[str, Any]], dict[str, list[str]]]:
    """The report's rows and options, each field of the shape the bench writes; else a
    ValueError naming the first field that is not."""
    if not isinstance(report, dict) or not isinstance(report.get("rows"), list) \
            or not isinstance(report.get("options"), dict):
        raise ValueError("it has no 'rows' list and 'options' mapping")
    options = report["options"]
    for name, opts in options.items():
        if not isinstance(opts, list) or not all(isinstance(o, str) for o in opts):
            raise ValueError(f"options[{name!r}] is not a list of strings")
    for i, row in enumerate(report["rows"]):
        if not isinstance(row, dict) or not isinstance(row.get("variants"), dict) \
                or not isinstance(row.get("link"), str) or not isinstance(row.get("model"), str):
            raise ValueError(f"rows[{i}] has no 'link', 'model' and 'variants'")
        if max(len(row["link"]), len(row["model"]), *map(len, row["variants"])) > 200:
            raise ValueError(f"rows[{i}] has a name of over 200 characters")
        for name, v in row["variants"].items():
            if not isinstance(v, dict):
                raise ValueError(f"rows[{i}] variant {name!r} is not a mapping")
            for key in ("median_s", "p25_s", "p75_s"):
                _figure(v.get(key), f"rows[{i}] {name!r} {key}")
    return report["rows"], options


def _rows(path: Path | None) -> tuple[list[dict[str, Any]], dict[str, list[str]]] | None:
    """The bench file's rows and variant options, or None when there is nothing measured.

    Advice never fails a run: a file that cannot be used is one warning line (once per file),
    and the run goes on without advice. Only the default path may be missing without a word.
    """
    if path is None:
        return None
    try:
        info = path.stat()
        if not stat.S_ISREG(info.st_mode):  # a FIFO would block the read; a directory cannot be read
            raise ValueError("it is not a regular file")
        if info.st_size > MAX_BYTES:
            raise ValueError(f"it is over {MAX_BYTES >> 20} MiB, which no bench writes")
        return _checked(json.loads(path.read_text()))
    except FileNotFoundError:
        if path == _default_file():
            return None  # never measured here: nothing to say
        why = "it does not exist"
    except (OSError, ValueError, UnicodeDecodeError, RecursionError) as exc:
        why = getattr(exc, "strerror", None) or str(exc).splitlines()[0][:200]
    if str(path) not in _warned:
        _warned.add(str(path))
        warn(f"ignoring the network bench file {path}: {why}; the run goes on without its advice. "
             "HINT: run benchmarks/network.py again to rewrite it, or set HVDKIT_NETWORK_BENCH= to turn advice off")
    return None


def _listed(names: set[str], shown: int = 3) -> str:
    """At most ``shown`` names, then how many more: one readable line, whatever the file holds."""
    ordered = sorted(names)
    more = f" and {len(ordered) - shown} more" if len(ordered) > shown else ""
    return ", ".join(ordered[:shown]) + more


def _clearly_faster(v: dict[str, Any], base: dict[str, Any]) -> bool:
    return bool(v["p75_s"] < base["p25_s"])  # its upper quartile below the other's lower: not noise


def measured_controller(path: Path | None = None) -> tuple[str, str] | None:
    """horovodrun's Gloo controller and why, when the network bench measured it clearly faster
    than the default (MPI) controller on *every* model it ran across this cluster's link; else
    None. Only a run that crosses that link (several hosts) should ask."""
    path = path or bench_file()
    found = _rows(path)
    if found is None:
        return None
    ratios, links = [], set()
    for row in found[0]:
        v = row["variants"]
        if "horovod default" not in v or "horovod gloo" not in v:
            continue
        if not _clearly_faster(v["horovod gloo"], v["horovod default"]):
            return None
        ratios.append(v["horovod gloo"]["median_s"] / v["horovod default"]["median_s"])
        links.add(row["link"])
    if not ratios:
        return None
    return "gloo", (f"{MEASURED} on this cluster's link ({_listed(links)}): the network bench ran it at "
                    f"{min(ratios):.2f}-{max(ratios):.2f}x the MPI controller's step time, {path}; "
                    "--controller mpi overrides")


def advise(cfg: TrainConfig, wait_share: float, path: Path | None = None) -> str | None:
    """One line naming the measured knob for the run's backend on this cluster's link, or None."""
    path = path or bench_file()
    measured = _rows(path)
    if measured is None:
        return None
    rows, options = measured
    backend, knobs = cfg.backend.name, knobs_of(cfg)
    default = f"{backend} default"
    found: list[tuple[float, str, list[str], dict[str, Any]]] = []
    for row in rows:
        variants = row["variants"]
        if default not in variants:
            continue
        base = variants[default]
        for name, v in variants.items():
            opts = options.get(name, [])
            if not name.startswith(f"{backend} ") or name == default or not opts or _uses(knobs, opts):
                continue
            if _clearly_faster(v, base):
                found.append((v["median_s"] / base["median_s"], name, opts, row))
    if not found:
        return None
    ratio, name, opts, row = min(found, key=lambda f: f[0])
    return (f"communication wait is {wait_share:.0%} of the step time; on this cluster's link ({row['link']}), "
            f"the network bench measured {' '.join(opts)} at {ratio:.2f}x the step time of {default} on "
            f"{row['model']} ({path}); try it")
