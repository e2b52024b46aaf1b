"""Elastic training's state protocol over a run's states dict: commit, roll back, sync.

Horovod Elastic keeps going when workers are lost or added: every ``--commit-every`` steps
the state is copied to host memory (a *commit*); a collective that fails (a worker died)
rolls every survivor back to its last commit; after the world is re-formed every rank takes
the newest state any rank holds (a *sync*) and training goes on. :class:`ElasticMemory` does
this for any loop through :func:`hvdkit.state.capture`/``apply``/``broadcast``, the same
serialisation the checkpoint files use; the loop itself only says what its states are and
what to do around a load (:class:`Resumable`). :class:`LoopStates` is that for hvdkit's own
loop: what lives beside its states (the running loss, the sample log) follows every load.
"""

from __future__ import annotations

import copy
import os
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

from . import state as states_mod
from .log import debug, diag

if TYPE_CHECKING:
    from .backends.base import Backend
    from .position import LoopPosition, RunningLoss
    from .samplelog import SampleLog

__all__ = ["Resumable", "ElasticMemory", "LoopStates"]


class Resumable(Protocol):
    """What a training loop tells :class:`ElasticMemory`."""

    @property
    def states(self) -> dict[str, Any]:
        """The states committed, rolled back and synced."""

    @property
    def step(self) -> int:
        """The optimizer step the states are at."""

    def before_capture(self) -> None:
        """Local: put anything kept elsewhere (a running loss on the device) into the states."""

    def pending(self) -> float:
        """This rank's running value that a sync must account for (the loss since the last fold)."""

    def start_fresh(self) -> None:
        """Collective: no rank holds a commit: restore the newest checkpoint, or take rank 0's
        fresh states."""

    def loaded(self, rolled_back_from: int | None = None, held: list[tuple[int, float]] | None = None) -> None:
        """After states were loaded: by a roll-back from step ``rolled_back_from``, by a sync
        (``held``: every rank's commit step, -1 for none, and :meth:`pending` before it), or
        by a fresh start (neither)."""

    def on_reset(self) -> None:
        """The world changed (called before :meth:`ElasticMemory.sync`)."""


class ElasticMemory:
    """Host-memory commits of a :class:`Resumable` loop; the ``ElasticLoop`` a backend runs."""

    def __init__(self, backend: Backend, loop: Resumable) -> None:
        self.backend, self.loop = backend, loop
        self.memory: tuple[int, dict[str, Any]] | None = None

    def commit_to_memory(self) -> None:
        """Copy the states to host memory (what a roll-back returns to). Local: Horovod runs it
        before its own check for host changes, and a commit that talked to a dead peer
        would be lost."""
        self.loop.before_capture()
        self.memory = (self.loop.step, states_mod.capture(self.loop.states, self.backend, copy_=True))

    def roll_back(self) -> None:
        """After a collective failed: back to the last commit; later steps are redone."""
        if self.memory is None:  # failed before the first commit: the next sync starts afresh
            return
        lost = self.loop.step
        # a deep copy: load_state_dict may keep the tensors it is given, and training would
        # then change the commit a second roll-back returns to
        states_mod.apply(self.loop.states, copy.deepcopy(self.memory[1]), self.backend)
        self.loop.loaded(rolled_back_from=lost)

    def sync(self) -> None:
        """Collective: every rank takes the newest state any rank holds.

        At the start of a job no rank holds any: the loop starts fresh (a checkpoint, or rank
        0's weights). After a reset the survivors hold their last commit and a new worker
        holds nothing; the state comes from the lowest rank with the newest commit (not
        blindly rank 0, which may be the newcomer).
        """
        held = self.backend.gather_objects((self.memory[0] if self.memory is not None else -1,
                                            self.loop.pending()))
        steps = [step for step, _ in held]
        newest = max(steps)
        if newest < 0:
            self.loop.start_fresh()
            self.loop.loaded()
        else:
            src = steps.index(newest)
            debug(f"sync: state of step {newest} from rank {src} (steps held: {steps})")
            states_mod.broadcast(self.loop.states, self.backend, root=src)
            self.loop.loaded(held=held)
        self.commit_to_memory()

    def on_reset(self) -> None:
        self.loop.on_reset()


class LoopStates:
    """hvdkit's own loop as a :class:`Resumable`, for every run (a plain run's start is a load
    too): its states, and the running loss and the sample log, which follow each load.

    ``start`` is the loop's own fresh start (the newest checkpoint, or rank 0's weights).
    """

    def __init__(self, states: dict[str, Any], progress: LoopPosition, loss: RunningLoss,
                 samples: SampleLog | None, backend: Backend, start: Callable[[], None]) -> None:
        self.states, self.progress, self.loss, self.samples = states, progress, loss, samples
        self.backend, self._start = backend, start
        self.replay = ""  # after a roll-back: which steps are recomputed (said at the reset)

    @property
    def step(self) -> int:
        return self.progress.global_step

    def before_capture(self) -> None:
        """This rank's running loss goes into the loop state (local: a commit must not talk)."""
        self.loss.before_commit()

    def pending(self) -> float:
        return self.loss.pending()

    def start_fresh(self) -> None:
        self._start()

    def loaded(self, rolled_back_from: int | None = None,
               held: list[tuple[int, float]] | None = None) -> None:
        """After a restore, a sync or a roll-back (:class:`~hvdkit.position.RunningLoss` says
        what each does to the running loss); the sample log drops what is done again."""
        if rolled_back_from is not None:
            self.loss.rolled_back()
            if self.samples is not None:
                self.samples.discard()
            if rolled_back_from > self.step:
                self.replay = f"; steps {self.step + 1}..{rolled_back_from} are done again"
            return
        if held is not None:
            self.loss.synced(held, self.backend.rank)
        else:
            self.loss.restored(self.backend.rank, self.backend.size)
        if self.samples is not None:
            self.samples.truncate(self.step)  # records of steps run again go

    def on_reset(self) -> None:
        """The world changed (after the backend re-formed it, before the sync)."""
        p, b = self.progress, self.backend
        diag(f"reset: rank {b.rank} of {b.size} (host {b.slot_host()}, pid {os.getpid()}), continuing from "
             f"committed step {p.global_step} at sample {p.samples_in_epoch} of epoch {p.epoch}'s order"
             f"{self.replay}", every_rank=True)
        self.replay = ""
