"""Which samples each step trained on, as the ranks really read them (``--sample-log FILE``).

Each rank notes the indices its data loader reads; at every commit, checkpoint and epoch
end the ranks gather them and rank 0 appends one JSON line per record::

    {"epoch": 0, "step": 12, "world": 2, "ids": [...]}

``ids`` are the samples read since the previous record, by all ranks. Only steps that
count are kept: after an elastic roll-back the ranks drop what they read since the last
commit, and every sync (also a resume from a checkpoint) removes the records of steps
after the step it continues from, because those steps are run again. So, per epoch, the
ids of all records are the samples that epoch trained on, each once; an audit of the
data order, and the proof the elastic tests use.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from torch.utils.data import Dataset

from .backends import Backend
from .fileio import write_text_atomic

__all__ = ["SampleLog", "read_sample_log"]


class _Watched(Dataset):
    """A dataset that notes every index read from it."""

    def __init__(self, inner: Dataset, seen: list[int]) -> None:
        self.inner, self.seen = inner, seen

    def __len__(self) -> int:
        return len(self.inner)  # type: ignore[arg-type]

    def __getitem__(self, index: int) -> Any:
        self.seen.append(int(index))
        return self.inner[index]


class SampleLog:
    """Collective record of the sample ids each rank read; rank 0 owns the file."""

    def __init__(self, path: str, backend: Backend) -> None:
        self.path, self.backend = Path(path), backend
        self.seen: list[int] = []

    def watch(self, dataset: Dataset) -> Dataset:
        """``dataset``, noting each index read (the loop reads in its own process)."""
        return _Watched(dataset, self.seen)

    def record(self, epoch: int, step: int) -> None:
        """Collective: every rank's ids since the last record; rank 0 appends them."""
        ids = [i for rank_ids in self.backend.gather_objects(list(self.seen)) for i in rank_ids]
        self.seen.clear()
        if self.backend.is_master and ids:
            with self.path.open("a") as f:
                f.write(json.dumps({"epoch": epoch, "step": step, "world": self.backend.size,
                                    "ids": ids}) + "\n")

    def discard(self) -> None:
        """After a roll-back: what was read since the last commit is read again."""
        self.seen.clear()

    def truncate(self, step: int) -> None:
        """Rank 0: drop the records of steps after ``step`` (the run continues from there)."""
        self.seen.clear()
        if not self.backend.is_master:
            return
        keep = [r for r in read_sample_log(self.path) if r["step"] <= step]
        write_text_atomic(self.path, "".join(json.dumps(r) + "\n" for r in keep))


def read_sample_log(path: str | Path) -> list[dict[str, Any]]:
    """The records of a sample log (none if the file does not exist)."""
    path = Path(path)
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
