"""What a person watches while training runs: a progress bar and TensorBoard, on rank 0.

* ``--tensorboard DIR``: ``torch.utils.tensorboard.SummaryWriter`` (the ``tensorboard``
  package, ``pip install 'hvdkit[tensorboard]'``). Tags: ``train/loss`` and ``train/lr`` per
  step; ``train/epoch_loss``, ``train/samples_per_sec`` and ``train/comm_wait`` per epoch;
  ``val/<metric>`` at every evaluation. The x axis is the optimizer step.
* ``--progress auto|bar|lines``: a ``tqdm`` bar of the epoch's steps when the console is a
  terminal, and nothing but the usual lines in a batch log. Under ``hvdkit run`` the ranks'
  output is a pipe, so rank 0 sends throttled ``[hvdkit-progress]`` lines instead and
  ``hvdkit run`` draws the bar on its own terminal (:class:`ProgressRelay`).
"""

from __future__ import annotations

import os
import sys
import time
from typing import TYPE_CHECKING, Any

from .launch.vocabulary import CONSOLE_TTY_VAR

if TYPE_CHECKING:
    import torch

    from .config import TrainConfig

__all__ = ["Observers", "ProgressRelay", "PROGRESS_TAG", "CONSOLE_TTY_VAR", "EPOCH_TAG", "EPOCH_EVENTS_VAR"]

PROGRESS_TAG = "[hvdkit-progress]"
# rank 0's record of each finished epoch, after its checkpoint, for a driver that reports to a
# scheduler (hvdkit.rayrun.tune: Ray Tune); printed only where EPOCH_EVENTS_VAR is "1"
EPOCH_TAG = "[hvdkit-epoch]"
EPOCH_EVENTS_VAR = "HVDKIT_EPOCH_EVENTS"
_EVENT_EVERY_S = 0.2


def _progress_mode(cfg: TrainConfig) -> str:
    """``bar`` (tqdm here), ``events`` (lines for hvdkit run to draw), or ``none``."""
    if cfg.progress == "lines":
        return "none"
    if os.environ.get(CONSOLE_TTY_VAR) == "1":
        return "events"
    if cfg.progress == "bar" or sys.stderr.isatty():
        return "bar"
    return "none"


class Observers:
    """Rank 0's progress bar and TensorBoard writer; every method is a no-op elsewhere."""

    def __init__(self, cfg: TrainConfig, master: bool) -> None:
        self.active = master
        self.mode = _progress_mode(cfg) if master else "none"
        self._bar: Any = None
        self._bar_epoch = -1
        self._last_event = 0.0
        self._writer: Any = None
        if master and cfg.tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError:
                from .errors import ConfigError

                raise ConfigError("--tensorboard needs the tensorboard package",
                                  "pip install 'hvdkit[tensorboard]'") from None
            self._writer = SummaryWriter(log_dir=cfg.tensorboard)

    # -- the loop's events ------------------------------------------------------------------
    def step(self, run: Any, loss: torch.Tensor) -> None:
        """After every optimizer step (rank 0 pulls the loss to the host only if watched)."""
        if not self.active or (self.mode == "none" and self._writer is None):
            return
        p, value = run.progress, float(loss)
        lr = float(run.optimizer.param_groups[0]["lr"])
        if self._writer is not None:
            self._writer.add_scalar("train/loss", value, p.global_step)
            self._writer.add_scalar("train/lr", lr, p.global_step)
        total = run.geo.steps_per_epoch
        done = p.steps_in_epoch
        if self.mode == "bar":
            self._draw(p.epoch, done, total, value)
        elif self.mode == "events":
            now = time.monotonic()
            if now - self._last_event >= _EVENT_EVERY_S or done >= total:
                self._last_event = now
                print(f"{PROGRESS_TAG} epoch={p.epoch} step={done} total={total} loss={value:.6g}",
                      flush=True)

    def saved(self, run: Any, record: dict[str, Any], checkpoint: str | None) -> None:
        """After an epoch's checkpoint: one ``[hvdkit-epoch] {json}`` line where asked for."""
        if self.active and os.environ.get(EPOCH_EVENTS_VAR) == "1":
            import json

            event = {k: v for k, v in record.items() if isinstance(v, (int, float, str))}
            print(f"{EPOCH_TAG} {json.dumps({**event, 'checkpoint': checkpoint})}", flush=True)

    def evaluated(self, run: Any, metrics: dict[str, float]) -> None:
        if self.active and self._writer is not None:
            for name, value in metrics.items():
                if name != "count":
                    self._writer.add_scalar(f"val/{name}", value, run.progress.global_step)
            self._writer.flush()

    def epoch(self, run: Any, record: dict[str, Any]) -> None:
        if not self.active:
            return
        if self._bar is not None:
            self._bar.close()
            self._bar = None
        if self._writer is not None:
            step = run.progress.global_step
            self._writer.add_scalar("train/epoch_loss", record["loss"], step)
            self._writer.add_scalar("train/samples_per_sec", record["samples_per_sec"], step)
            if "comm_wait" in record:
                self._writer.add_scalar("train/comm_wait", record["comm_wait"], step)
            self._writer.flush()

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None
        if self._writer is not None:
            self._writer.close()
            self._writer = None

    def _draw(self, epoch: int, done: int, total: int, loss: float) -> None:
        from tqdm import tqdm

        if self._bar is None or self._bar_epoch != epoch:
            if self._bar is not None:
                self._bar.close()
            self._bar = tqdm(total=total, initial=done - 1, desc=f"epoch {epoch}", unit="step",
                             leave=False, dynamic_ncols=True)
            self._bar_epoch = epoch
        self._bar.set_postfix(loss=f"{loss:.4g}", refresh=False)
        self._bar.update(done - self._bar.n)


class ProgressRelay:
    """``hvdkit run``'s side: turns rank 0's ``[hvdkit-progress]`` lines into a tqdm bar on
    this terminal; other lines are printed above the bar (``tqdm.write``)."""

    def __init__(self) -> None:
        self._bar: Any = None
        self._epoch: str | None = None

    def feed(self, text: str) -> bool:
        """Draw ``text`` if it is a progress line; returns False for any other line."""
        at = text.find(PROGRESS_TAG)
        if at < 0:
            return False
        from tqdm import tqdm

        fields = dict(item.split("=", 1) for item in text[at + len(PROGRESS_TAG):].split() if "=" in item)
        try:
            epoch, done, total = fields["epoch"], int(fields["step"]), int(fields["total"])
        except (KeyError, ValueError):
            return True
        if self._bar is None or self._epoch != epoch:
            self.close()
            self._bar = tqdm(total=total, desc=f"epoch {epoch}", unit="step", leave=False,
                             dynamic_ncols=True, file=sys.stderr)
            self._epoch = epoch
        self._bar.set_postfix(loss=fields.get("loss", "?"), refresh=False)
        self._bar.update(max(0, done - self._bar.n))
        return True

    def write(self, text: str, stream: Any) -> None:
        """Print a normal line without tearing the bar."""
        if self._bar is None:
            stream.write(text)
            stream.flush()
            return
        from tqdm import tqdm

        tqdm.write(text.rstrip("\n"), file=stream)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None
