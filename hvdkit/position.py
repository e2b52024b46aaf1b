"""Where a training run is: the one loop-state object, saved in checkpoints and elastic commits.

:class:`LoopPosition` is a *Stateful* (``state_dict``/``load_state_dict``), so it travels in the
run's states dict like the model and the optimizer: one serialisation for disk and memory.
Everything in it is small, plain and independent of the world size.
"""

from __future__ import annotations

import copy
from dataclasses import asdict, dataclass, field, fields
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

    from .backends.base import Backend

__all__ = ["LoopPosition", "RunningLoss"]


@dataclass
class LoopPosition:
    """The loop's position and what it has measured so far."""

    epoch: int = 0
    global_step: int = 0
    samples_seen: int = 0
    samples_in_epoch: int = 0      # global samples of this epoch's order already trained on
    steps_in_epoch: int = 0
    # The epoch's running training loss, kept here because it is checkpointed with the
    # position; every rule about it is RunningLoss's (below), nothing else touches these.
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
        fresh = LoopPosition()
        for name in known:
            setattr(self, name, copy.deepcopy(state.get(name, getattr(fresh, name))))

    @property
    def epoch_losses(self) -> list[float]:
        return [float(r["loss"]) for r in self.history]


class RunningLoss:
    """The epoch's training loss, every rule of it in one place.

    The epoch loss is the mean of its step losses: the sum already folded over ranks
    (``LoopPosition.loss_committed``) plus each rank's running sum since the last fold, a 0-d
    float64 tensor on the device (:attr:`local`: adding a step's loss does not wait for the
    device). Folding happens at the same steps in every mode, so the epoch loss is the same
    bits in elastic and plain runs. What survives a stop lives in the :class:`LoopPosition` it is
    given (checkpointed with the position): every rank's running sum at a checkpoint
    (``loss_sums``), and this rank's own at an elastic commit (``loss_pending``).
    """

    def __init__(self, progress: LoopPosition, device: torch.device) -> None:
        import torch

        self.progress = progress
        self.local = torch.zeros((), dtype=torch.float64, device=device)

    def add(self, loss: torch.Tensor) -> None:
        """One step's loss (this rank's mean over its batch)."""
        self.local += loss

    def fold(self, backend: Backend) -> None:
        """Collective: move every rank's running sum into the folded sum."""
        self.progress.loss_committed += backend.allreduce_metric(self.local)
        self.local.zero_()

    def mean(self, backend: Backend) -> float:
        """Collective: the epoch's loss so far (mean over its steps), folding nothing."""
        p = self.progress
        return (p.loss_committed + backend.allreduce_metric(self.local)) / max(p.steps_in_epoch, 1)

    def end_epoch(self) -> None:
        """The next epoch starts from zero."""
        self.local.zero_()
        self.progress.loss_committed = 0.0

    # -- across a stop: a checkpoint, an elastic commit, a roll-back, a sync ------------------
    def before_commit(self) -> None:
        """Local (a commit must not talk): this rank's running sum into the state."""
        self.progress.loss_pending = float(self.local)

    def before_save(self, backend: Backend) -> None:
        """Collective: every rank's running sum into the state, for a checkpoint."""
        self.before_commit()
        self.progress.loss_sums = backend.gather_objects(float(self.local))

    def pending(self) -> float:
        """This rank's running sum, which an elastic sync must account for."""
        return float(self.local)

    def rolled_back(self) -> None:
        """After a roll-back to this rank's own commit: its running sum at that commit."""
        self.local.fill_(self.progress.loss_pending)

    def synced(self, held: list[tuple[int, float]], rank: int) -> None:
        """After an elastic sync (``held``: every rank's commit step, -1 for none, and running
        sum before it): this rank's own when every rank held the newest commit; else the
        holders' sums are folded (a newcomer has none) and every rank starts from zero."""
        newest = max(step for step, _ in held)
        if all(step == newest for step, _ in held):
            self.local.fill_(held[rank][1])
        else:
            holders = [v for step, v in held if step == newest]
            self.progress.loss_committed += sum(holders) / len(holders)
            self.local.zero_()

    def restored(self, rank: int, size: int) -> None:
        """After a restore from disk: this rank's saved sum, or their mean when the world
        size changed (0 from a checkpoint without any)."""
        sums = self.progress.loss_sums
        self.local.fill_(float(sums[rank]) if len(sums) == size else (sum(sums) / len(sums) if sums else 0.0))
