"""Where a training run is: the one loop-state object, saved in checkpoints and elastic commits.

:class:`Progress` is a *Stateful* (``state_dict``/``load_state_dict``), so it travels in the
run's states dict like the model and the optimizer: one serialisation for disk and memory.
Everything in it is small, plain and independent of the world size.
"""

from __future__ import annotations

import copy
from dataclasses import asdict, dataclass, field, fields
from typing import Any

__all__ = ["Progress"]


@dataclass
class Progress:
    """The loop's position and what it has measured so far."""

    epoch: int = 0
    global_step: int = 0
    samples_seen: int = 0
    samples_in_epoch: int = 0      # global samples of this epoch's order already trained on
    steps_in_epoch: int = 0
    # The epoch's training loss is the mean of its step losses: the sum folded over ranks at
    # every commit (loss_committed), plus each rank's running sum since: gathered into
    # loss_sums for a checkpoint (a rank resumes its own when the world is the same size,
    # the mean of them otherwise), this rank's alone in loss_pending for an elastic commit.
    loss_committed: float = 0.0
    loss_sums: list[float] = field(default_factory=list)  # every rank's, at a checkpoint
    loss_pending: float = 0.0  # this rank's own, at an elastic commit (in checkpoints too, as the state is)
    history: list[dict[str, Any]] = field(default_factory=list)  # one record per finished epoch
    last_eval: dict[str, float] = field(default_factory=dict)    # the newest validation metrics

    def state_dict(self) -> dict[str, Any]:
        return copy.deepcopy(asdict(self))

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if "extra" in state:  # hvdkit 0.2's loop state (checkpoint format 2)
            extra = state["extra"]
            state = {"epoch": state["epoch"], "global_step": state["global_step"],
                     "samples_seen": state["samples_seen"], "samples_in_epoch": state["samples_in_epoch"],
                     "steps_in_epoch": extra.get("steps_in_epoch", 0),
                     "loss_committed": extra.get("loss_committed", 0.0),
                     "loss_sums": extra.get("loss_sums", []),
                     "history": [{"epoch": i, "loss": v} for i, v in enumerate(extra.get("epoch_losses", []))]}
        known = {f.name for f in fields(self)}
        fresh = Progress()
        for name in known:
            setattr(self, name, copy.deepcopy(state.get(name, getattr(fresh, name))))

    def loss_sum_for(self, rank: int, size: int) -> float:
        """This rank's running loss sum to resume with."""
        sums = self.loss_sums
        if len(sums) == size:
            return float(sums[rank])
        return sum(sums) / len(sums) if sums else 0.0

    @property
    def epoch_losses(self) -> list[float]:
        return [float(r["loss"]) for r in self.history]
