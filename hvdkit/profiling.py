"""``--timeline PATH``: Horovod's timeline, or a torch profiler trace for DDP/local.

Horovod writes its timeline itself (``HOROVOD_TIMELINE``, coordinator rank
only). For the other backends rank 0 records a few steps with
``torch.profiler`` and exports a Chrome trace. Open either in
chrome://tracing or https://ui.perfetto.dev.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from .log import diag

__all__ = ["step_profiler"]


class _NoProfiler:
    def step(self) -> None:
        return None


@contextlib.contextmanager
def step_profiler(path: str | None, active: bool, steps: int = 5) -> Iterator[Any]:
    """Yield an object with ``step()``; records ``steps`` steps after one warm-up into ``path``."""
    if not path or not active:
        yield _NoProfiler()
        return
    from torch.profiler import ProfilerActivity, profile, schedule

    activities = [ProfilerActivity.CPU]
    import torch

    if torch.cuda.is_available():
        activities.append(ProfilerActivity.CUDA)

    def export(prof: Any) -> None:
        prof.export_chrome_trace(path)
        diag(f"wrote profiler trace {path} (open in chrome://tracing or ui.perfetto.dev)")

    with profile(activities=activities, schedule=schedule(wait=1, warmup=1, active=steps, repeat=1),
                 on_trace_ready=export, record_shapes=False) as prof:
        yield prof
