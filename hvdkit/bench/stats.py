"""Summary statistics, machine description and result files shared by all benchmarks."""

from __future__ import annotations

import importlib.metadata
import math
import os
import platform
import statistics
import time
from pathlib import Path
from typing import Any

from ..environments import usable_cores

__all__ = ["summarize", "ratio_ci", "environment", "Timer"]


def summarize(samples: list[float]) -> dict[str, float]:
    """median, p10/p90, mean and the 1.96-sigma half-width (Horovod's benchmark style)."""
    if not samples:
        raise ValueError("no samples")
    ordered = sorted(samples)

    def q(p: float) -> float:
        k = (len(ordered) - 1) * p
        lo, hi = math.floor(k), math.ceil(k)
        return ordered[lo] + (ordered[hi] - ordered[lo]) * (k - lo)

    mean = statistics.fmean(ordered)
    std = statistics.stdev(ordered) if len(ordered) > 1 else 0.0
    return {"median": q(0.5), "p10": q(0.1), "p25": q(0.25), "p75": q(0.75), "p90": q(0.9),
            "p95": q(0.95), "mean": mean,
            "ci95": 1.96 * std, "min": ordered[0], "max": ordered[-1], "n": len(ordered)}


def ratio_ci(a: list[list[float]], b: list[list[float]], resamples: int = 2000, seed: int = 0,
             level: float = 0.95) -> tuple[float, float, float]:
    """Ratio of median step times, A over B, with a paired block-bootstrap percentile interval.

    ``a[i]`` and ``b[i]`` are the step times of round ``i``'s block of each variant. Steps in
    one block share the machine's state (other load, caches, clock), so they are not
    independent: resampling single steps gives intervals far narrower than the run-to-run
    spread. Rounds are resampled instead, A's and B's block of a round together (they ran
    back to back), and each resample's ratio is that of the pooled medians.
    """
    import random

    if not a or len(a) != len(b) or not all(a) or not all(b):
        raise ValueError("need the same number of non-empty blocks on both sides")

    def pooled_ratio(rounds: list[int]) -> float:
        return (statistics.median(t for i in rounds for t in a[i])
                / statistics.median(t for i in rounds for t in b[i]))

    rng = random.Random(seed)
    n = len(a)
    point = pooled_ratio(list(range(n)))
    ratios = sorted(pooled_ratio(rng.choices(range(n), k=n)) for _ in range(resamples))
    lo = ratios[int((1 - level) / 2 * resamples)]
    hi = ratios[min(resamples - 1, int((1 + level) / 2 * resamples))]
    return point, lo, hi


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def environment(world_size: int | None = None) -> dict[str, Any]:
    """Versions and hardware, stored with every result."""
    import torch

    env: dict[str, Any] = {
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "host": platform.node(),
        "python": platform.python_version(), "torch": torch.__version__,
        "cpu": _cpu_model(), "cores": usable_cores(),
        "cuda": torch.cuda.is_available(),
        "gpus": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())],
        "world_size": world_size,
    }
    # the fabric's shaping on scripts/local-cluster.sh (its `link`): "1gbit", "off", or None
    # where no local cluster is up; the nodes see the state directory on the shared file system
    link = Path(os.environ.get("HVDKIT_CLUSTER_STATE", "/run/hvdkit-cluster")) / "link"
    env["local_cluster_link"] = link.read_text().strip() if link.is_file() else None
    try:  # the installed version, read without importing horovod
        env["horovod"] = importlib.metadata.version("horovod")
    except importlib.metadata.PackageNotFoundError:
        env["horovod"] = None
    return env


class Timer:
    """Wall-clock timer that synchronises CUDA first, so GPU work is really finished."""

    def __init__(self) -> None:
        import torch

        self._cuda = torch.cuda.is_available()
        self._torch = torch

    def now(self) -> float:
        if self._cuda:
            self._torch.cuda.synchronize()
        return time.perf_counter()
