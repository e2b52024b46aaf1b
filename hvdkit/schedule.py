"""The learning-rate schedule: linear warm-up from the unscaled LR, then constant, cosine or step.

All of it is one multiplier of the (world-scaled) base LR, a pure function of the optimizer
step, so a ``LambdaLR`` carries it and its state (the step count) goes into every checkpoint:
a resume continues the schedule exactly. It is re-derived from the config and the current
world size at every start and after every elastic reset (the steps per epoch change with it).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

__all__ = ["warmup_factor", "LrPlan"]


def warmup_factor(step: int, warmup_steps: int, scale: float) -> float:
    """LR multiplier: ramps from 1/scale (the unscaled LR) to 1 over ``warmup_steps`` (Goyal et al.)."""
    if warmup_steps <= 0 or step >= warmup_steps:
        return 1.0
    start = 1.0 / scale
    return start + (1.0 - start) * step / warmup_steps


@dataclass
class LrPlan:
    """What the schedule depends on in the current world; :meth:`factor` is the LambdaLR lambda."""

    scale: float = 1.0           # world size x accumulation (with --scale-lr): bigger batch, bigger LR
    warmup_steps: int = 0
    total_steps: int = 1         # the run's steps at the current world size
    kind: str = "constant"       # after the warm-up: constant | cosine | step
    min_ratio: float = 0.0       # cosine ends at this fraction of the LR
    step_every: int = 1          # step: multiply by gamma every this many steps
    gamma: float = 0.1

    def factor(self, step: int) -> float:
        if step < self.warmup_steps:
            return warmup_factor(step, self.warmup_steps, self.scale)
        after = step - self.warmup_steps
        if self.kind == "cosine":
            span = max(1, self.total_steps - self.warmup_steps)
            progress = min(1.0, after / span)
            return self.min_ratio + (1.0 - self.min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))
        if self.kind == "step":
            return float(self.gamma ** (after // max(1, self.step_every)))
        return 1.0
