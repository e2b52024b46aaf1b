"""Notice the first non-finite loss on any rank, without a host sync per step.

Each rank keeps, on its device, the first step whose loss was NaN or inf. The
flag "some step was non-finite" rides in the per-step agreement the loop already
makes (with preemption), so it costs no extra collective; it lags one step, which
is why :meth:`NonFiniteWatch.check_now` runs a blocking check before every save.
"""

from __future__ import annotations

import torch

from .backends import Backend
from .errors import EXIT_NONFINITE, HvdkitError

__all__ = ["NonFiniteWatch", "NonFiniteLoss", "MODES"]

MODES = ("stop", "warn")
_NEVER = torch.iinfo(torch.int64).max


class NonFiniteLoss(HvdkitError):
    """The loss became NaN or inf and ``--on-nonfinite stop`` ended the run (exit 65)."""

    exit_code = EXIT_NONFINITE


class NonFiniteWatch:
    """First non-finite step per rank, kept on the device; collective queries."""

    def __init__(self, backend: Backend, mode: str = "stop") -> None:
        if mode not in MODES:
            raise ValueError(f"on_nonfinite must be one of {MODES}, got {mode!r}")
        self.backend, self.mode, self.warned = backend, mode, False
        self.warned_eval = False  # a non-finite validation metric was reported (hvdkit.loop)
        self._first = torch.full((), _NEVER, dtype=torch.int64, device=backend.device)

    def record(self, loss: torch.Tensor, step: int) -> None:
        """Remember ``step`` if ``loss`` is not finite and no earlier step was (device ops only)."""
        bad = ~torch.isfinite(loss)
        self._first = torch.where(bad, torch.clamp(self._first, max=step), self._first)

    def flag(self) -> torch.Tensor:
        """0-d bool tensor on the device: was any recorded loss non-finite on this rank?"""
        return self._first < _NEVER

    def check_now(self) -> bool:
        """Collective and blocking: was any loss non-finite on any rank, up to this step?"""
        return self.backend.any_true(bool(self.flag()))

    def first_bad(self) -> tuple[int, list[int]]:
        """Collective: the first non-finite step over all ranks, and the ranks that saw it then."""
        firsts = self.backend.gather_objects(int(self._first))
        step = min(firsts)
        return step, [rank for rank, first in enumerate(firsts) if first == step]

    def handle(self, current_step: int, last_checkpoint: str | None, log) -> None:
        """Collective: raise :class:`NonFiniteLoss` (stop) or warn once on rank 0 (warn)."""
        step, ranks = self.first_bad()
        where = f"at step {step} on rank{'s' if len(ranks) > 1 else ''} {','.join(map(str, ranks))}"
        if self.mode == "stop":
            kept = f"the last checkpoint ({last_checkpoint}) is from before it" if last_checkpoint \
                else "no checkpoint was written"
            err = NonFiniteLoss(
                f"loss became NaN/inf {where}; stopped at step {current_step}; {kept}",
                "lower --lr, check the data for NaN/inf ('hvdkit data check'), "
                "or pass --on-nonfinite warn to keep going")
            err.echo = self.backend.is_master  # every rank raises it; one prints it
            raise err
        if not self.warned and self.backend.is_master:
            log(f"WARNING: loss became NaN/inf {where}; continuing (--on-nonfinite warn); "
                "checkpoints with NaN/inf weights are not written")
        self.warned = True
