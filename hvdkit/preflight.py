"""The memory preflight (issue #43): before step 1, each rank's peak is estimated and a run that
cannot fit is refused in one line that names a sharding mode that would, instead of being found
by the kernel's OOM killer minutes (or, behind a queue, hours) later.

A rank's peak under a mode is

    runtime + max(parameters + gradients + optimizer state + in flight + activations,
                  parameters + optimizer state + checkpoint buffer)

* **runtime**: measured, this process's own resident memory (anonymous and shared) before the
  first batch, less the parameters it holds (torch itself, the data, what building the model left);
* parameters, gradients, optimizer state, in flight: by the mode's own rule
  (:mod:`hvdkit.backends.footprint`), the optimizer's bytes per parameter measured by stepping
  it once on a small tensor;
* **activations**: measured on the first batch (the data check's forward, before any step):
  every leaf module's output, except where it is its input's storage (in place, a view); under
  ``--activation-checkpointing`` only the recomputed blocks' outputs and the largest block's insides;
* **checkpoint buffer** (with ``--checkpoint-dir``): what a save holds beyond the state,
  max(256 MiB, 2x the largest tensor) (hvdkit's checkpoints stream, issue #42); gradients are
  freed by then.

What a rank may use: the node's memory (``MemTotal``), its memory cgroup's limit (v1 or v2, the
tightest up its path), and the Slurm job's ``--mem``, each shared by the ranks that share it (the
ranks on one host; those in one cgroup). The estimate leaves out what it cannot see (the
allocator's fragmentation, torch's temporaries), so it refuses only a run whose estimate is over
a limit, and the mode it names instead is one whose estimate leaves a fifth of the limit free
where there is one; ``--no-memory-check`` skips it. Not estimated: elastic runs (a newcomer
checks alone) and GPU runs (the state is in device memory, which this does not count).
"""

from __future__ import annotations

import dataclasses
import functools
import os
import socket
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from .backends.footprint import ModelSizes, Needs, model_sizes, needs
from .blocks import recomputed_blocks
from .config import SHARD_MODES, TrainConfig
from .environments import slurm_job_memory
from .errors import ConfigError
from .h5tree import tree_leaves
from .log import debug, diag
from .sizes import nbytes

if TYPE_CHECKING:
    from .backends.base import Backend

__all__ = ["Limit", "ActivationMeter", "checkpoint_buffer", "current_rss", "memory_limits", "optimizer_ratio",
           "peak", "preflight"]

MIN_CHECKPOINT_BUFFER = 256 << 20
NAMED_SHARE = 0.8  # a mode named instead is one whose estimate is at most this share of the limit
TIGHT = 0.5  # an estimate that fits is said (not only logged at DEBUG) from this share of a limit
_UNLIMITED = 1 << 60  # a cgroup's "no limit" is a huge number (v1: 2^63 rounded to pages)


@dataclass(frozen=True)
class Limit:
    """Memory that the ranks with the same ``key`` share: ``what`` names it for a person."""

    what: str
    key: str
    bytes: int


def current_rss() -> int:
    """This process's own resident memory now, in bytes: anonymous and shared-memory pages
    (``RssAnon + RssShmem``). The mapped files (torch's libraries) are left out: their pages are
    shared by the ranks, charged to whichever cgroup read them first, and dropped under pressure."""
    try:
        fields = dict(line.split(":", 1) for line in Path("/proc/self/status").read_text().splitlines() if ":" in line)
        return sum(int(fields[key].split()[0]) << 10 for key in ("RssAnon", "RssShmem"))
    except (OSError, ValueError, KeyError):  # not Linux: the peak so far, an over-estimate
        from .memory import peak_rss

        return peak_rss()


def _read_limit(path: Path) -> int | None:
    try:
        raw = path.read_text().strip()
    except OSError:
        return None
    if not raw.isdigit() or int(raw) >= _UNLIMITED:
        return None  # "max" (v2), or v1's unlimited
    return int(raw)


def _cgroup_limit(proc: Path = Path("/proc/self/cgroup"),
                  root: Path = Path("/sys/fs/cgroup")) -> tuple[str, int] | None:
    """The tightest memory limit up this process's cgroup path: (that cgroup's path, bytes)."""
    try:
        lines = proc.read_text().splitlines()
    except OSError:
        return None
    where: tuple[Path, str, str] | None = None
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if "memory" in controllers.split(","):  # v1
            where = (root / "memory", path, "memory.limit_in_bytes")
        elif controllers == "" and where is None and (root / "cgroup.controllers").exists():  # v2
            where = (root, path, "memory.max")
    if where is None:
        return None
    base, path, name = where
    parts = [p for p in path.split("/") if p]
    found = []
    for k in range(len(parts), -1, -1):  # a container may see its own cgroup as the root: both tried
        at = "/" + "/".join(parts[:k])
        limit = _read_limit(base / at.lstrip("/") / name)
        if limit is not None:
            found.append((at, limit))
    return min(found, key=lambda f: f[1]) if found else None


def memory_limits(host: str | None = None) -> list[Limit]:
    """What this rank may use: the node's memory, its cgroup's limit, the Slurm job's ``--mem``."""
    host = host or socket.gethostname()
    limits = []
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                limits.append(Limit(f"node {host}", f"node:{host}", int(line.split()[1]) << 10))
    except OSError:
        pass
    cgroup = _cgroup_limit()
    if cgroup is not None:
        limits.append(Limit(f"memory cgroup {cgroup[0]} on {host}", f"cgroup:{host}:{cgroup[0]}", cgroup[1]))
    job = slurm_job_memory()
    if job is not None:
        limits.append(Limit(f"the Slurm job's --mem on {host}", f"slurm:{host}:{os.environ.get('SLURM_JOB_ID')}", job))
    return limits


def optimizer_ratio(cfg: TrainConfig) -> float | None:
    """Bytes of optimizer state per byte of trainable parameter: the optimizer ``cfg`` names,
    stepped once on a 64x64 tensor (AdamW: 2.0; SGD with momentum: 1.0). None where that fails
    (an optimizer that needs more than a plain parameter group)."""
    from .optim import make_optimizer

    p = nn.Parameter(torch.zeros(64, 64))
    try:
        optimizer = make_optimizer(cfg, [p], cfg.lr)
        p.grad = torch.full_like(p, 1e-3)
        optimizer.step()
    except Exception:  # whatever the user's optimizer does with it: no estimate, said by the caller
        return None
    state = optimizer.state.get(p, {})
    return nbytes(state.values()) / nbytes([p])


class ActivationMeter:
    """Counts what backward would keep of one forward of ``module``: each leaf module's output
    (not where it is its input's storage: an in-place activation, a view, an identity). With
    ``recomputed`` blocks (``--activation-checkpointing``), what is inside a block is kept only
    while that block is recomputed: the blocks' outputs, plus the largest block's insides."""

    def __init__(self, module: nn.Module, recomputed: list[nn.Module]) -> None:
        self.module = module
        self.blocks = recomputed
        self._block_of = {id(m): i for i, b in enumerate(recomputed) for m in b.modules() if m is not b}
        self._inside = [0] * len(recomputed)
        self._outputs = [0] * len(recomputed)
        self._outside = 0

    @staticmethod
    def _new_bytes(args: Any, output: Any) -> int:
        """Bytes of ``output`` not in a storage of ``args`` (an in-place op, a view of its input)."""
        inputs = {t.untyped_storage().data_ptr() for t in _tensors(args)}
        seen: set[int] = set()
        total = 0
        for t in _tensors(output):
            ptr = t.untyped_storage().data_ptr()
            if ptr not in inputs and ptr not in seen:
                seen.add(ptr)
                total += nbytes([t])
        return total

    def _leaf(self, module: nn.Module, args: Any, output: Any) -> None:
        added = self._new_bytes(args, output)
        block = self._block_of.get(id(module))
        if block is None:
            self._outside += added
        else:
            self._inside[block] += added

    def _block(self, index: int, _module: nn.Module, _args: Any, output: Any) -> None:
        self._outputs[index] += nbytes(_tensors(output))

    @contextmanager
    def counting(self) -> Iterator[ActivationMeter]:
        """Hooks on while the block runs one forward."""
        leaves = [m for m in self.module.modules() if next(m.children(), None) is None]
        handles = [m.register_forward_hook(self._leaf) for m in leaves]
        handles += [b.register_forward_hook(functools.partial(self._block, i)) for i, b in enumerate(self.blocks)]
        try:
            yield self
        finally:
            for handle in handles:
                handle.remove()

    @property
    def bytes(self) -> int:
        """The estimate, in bytes."""
        if not self.blocks:
            return self._outside + sum(self._inside)
        return self._outside + sum(self._outputs) + max(self._inside, default=0)


def _tensors(tree: Any) -> Iterator[torch.Tensor]:
    return (t for t in tree_leaves(tree) if isinstance(t, torch.Tensor))


def activation_meter(cfg: TrainConfig, model: nn.Module) -> ActivationMeter:
    """The meter for ``model`` under ``cfg`` (its recomputed blocks where activations are checkpointed)."""
    return ActivationMeter(model, recomputed_blocks(model) if cfg.backend.activation_checkpointing else [])


def checkpoint_buffer(sizes: ModelSizes) -> int:
    """What a streamed save holds beyond the training state (issue #42's bound)."""
    return max(MIN_CHECKPOINT_BUFFER, 2 * sizes.largest_tensor)


def peak(part: Needs, runtime: int, activations: int, checkpoint: int) -> int:
    """A rank's peak: training (everything plus activations) or a save (no gradients, the buffer)."""
    return runtime + max(part.state + part.in_flight + activations, part.params + part.optimizer + checkpoint)


def _size(n: float) -> str:
    return f"{n / 2**30:.1f} GiB" if n >= 2**30 else f"{n / 2**20:.0f} MiB"


def _allowed_modes(cfg: TrainConfig, world: int) -> list[str]:
    """The sharding modes this run could take instead (those its other options allow)."""
    if world == 1:
        return [cfg.backend.shard]
    allowed = []
    for mode in SHARD_MODES:
        try:
            dataclasses.replace(cfg, backend=dataclasses.replace(cfg.backend, shard=mode))
        except ConfigError:
            continue
        allowed.append(mode)
    return allowed


def _over(ranks: list[dict[str, Any]], mode: str, share: float = 1.0) -> tuple[float, dict[str, Any], int] | None:
    """The most over-committed limit under ``mode`` (over ``share`` of it): (needed/limit, the
    limit, ranks sharing it)."""
    shared: dict[str, tuple[str, int, list[dict[str, Any]]]] = {}  # key -> (what, bytes, its ranks)
    for rank in ranks:
        for what, key, limit in rank["limits"]:
            shared.setdefault(key, (what, limit, []))[2].append(rank)
    worst = None
    for what, limit, sharers in shared.values():
        total = sum(r["peaks"][mode] for r in sharers)
        if total > share * limit and (worst is None or total / limit > worst[0]):
            worst = (total / limit, {"what": what, "bytes": limit, "need": total}, len(sharers))
    return worst


def _instead(ranks: list[dict[str, Any]], mode: str, modes: list[str]) -> str | None:
    """The mode to name instead of ``mode``: the least sharded (``modes`` goes none, optimizer,
    full) whose estimate leaves room for what it does not see (measured: up to a quarter of the
    peak), else the one that fits with the most room; None if none fits."""
    fits = [m for m in modes if m != mode and _over(ranks, m) is None]
    roomy = [m for m in fits if _over(ranks, m, NAMED_SHARE) is None]
    ranked = roomy or sorted(fits, key=lambda m: max(r["peaks"][m] for r in ranks))
    return ranked[0] if ranked else None


def job_check(cfg: TrainConfig, model: nn.Module, nodes: int, per_node: int, mem: int) -> ConfigError | None:
    """Before a job is submitted (``hvdkit slurm --mem``): the least a rank needs under each mode,
    from ``model``'s sizes (built on the meta device), against the job's ``mem`` bytes a node
    shared by its ``per_node`` ranks. Activations and the runtime are left out (they are
    measured before step 1, by :func:`preflight`), so this refuses only what cannot fit: the
    refusal, naming the least sharded mode whose least fits, or None."""
    ratio = optimizer_ratio(cfg)
    if ratio is None:
        return None
    world = nodes * per_node
    from .optim import make_optimizer

    optimizer = make_optimizer(cfg, model, cfg.lr)
    sizes = model_sizes(model, [p for g in optimizer.param_groups for p in g["params"]], world,
                        cfg.backend.bucket_cap_mb)
    bucket = int(cfg.backend.bucket_cap_mb * 2**20)
    modes = _allowed_modes(cfg, world)
    parts = {m: needs(m, sizes, world, ratio, bucket, cfg.backend.name) for m in modes}
    peaks = {m: part.state + part.in_flight for m, part in parts.items()}
    ranks: list[dict[str, Any]] = [{"limits": [("job's --mem on a node", "node", mem)], "peaks": peaks}] * per_node
    mode = cfg.backend.shard
    if _over(ranks, mode) is None:
        return None
    part = parts[mode]
    message = (f"a rank needs at least ~{_size(peaks[mode])} under --shard {mode} (parameters "
               f"{_size(part.params)}, gradients {_size(part.grads)}, optimizer state {_size(part.optimizer)}, in "
               f"flight {_size(part.in_flight)}; activations and torch itself come on top), and the job's --mem "
               f"gives a node {_size(mem)} for its {per_node} rank{'s' if per_node > 1 else ''}")
    best = _instead(ranks, mode, modes)
    if best is not None:
        message += f"; --shard {best} needs at least ~{_size(peaks[best])}"
        hint = f"use --shard {best}, or a larger --mem"
    else:
        hint = "a larger --mem, fewer --tasks-per-node on more nodes, or a smaller model"
    return ConfigError(message, hint + " (--no-memory-check after '--' skips this check)")


def preflight(cfg: TrainConfig, backend: Backend, sizes: ModelSizes, held_params: int, runtime: int,
              activations: int) -> None:
    """Collective: every rank's estimate and limits, gathered; refuses (every rank, one line from
    rank 0) when this run's mode does not fit, naming the least sharded mode that does. Says
    the estimate in one line where it fits."""
    if backend.device.type != "cpu":  # the state lives in the device's memory, not the host's
        if backend.is_master:
            debug(f"memory: not estimated on {backend.device.type} (the preflight counts host memory)")
        return
    ratio = optimizer_ratio(cfg)
    bucket = int(cfg.backend.bucket_cap_mb * 2**20)
    world = backend.size
    checkpoint = checkpoint_buffer(sizes) if cfg.checkpoint_dir else 0
    modes = _allowed_modes(cfg, world)
    mine: dict[str, int] = {}
    if ratio is not None:
        base = max(0, runtime - held_params)  # what is not the model: the parameters are counted by mode
        mine = {m: peak(needs(m, sizes, world, ratio, bucket, cfg.backend.name), base, activations, checkpoint)
                for m in modes}
        parts = needs(cfg.backend.shard, sizes, world, ratio, bucket, cfg.backend.name)
    limits = [dataclasses.astuple(limit) for limit in memory_limits()]
    ranks: list[dict[str, Any]] = backend.gather_objects({"limits": limits, "peaks": mine})
    if ratio is None:
        if backend.is_master:
            diag(f"memory: no estimate: --optimizer {cfg.optimizer} did not step a plain parameter")
        return
    mode = cfg.backend.shard
    worst = _over(ranks, mode)
    top = max(r["peaks"][mode] for r in ranks)
    said = (f"parameters {_size(parts.params)}, gradients {_size(parts.grads)}, optimizer state "
            f"{_size(parts.optimizer)}, in flight {_size(parts.in_flight)}, activations {_size(activations)}, "
            f"runtime {_size(base)}" + (f", checkpoint buffer {_size(checkpoint)}" if checkpoint else ""))
    if worst is None:
        if backend.is_master:  # said where it is tight; a small run's console stays as it was
            load, limit, sharers = _over(ranks, mode, share=0.0) or (0.0, {"what": "nothing"}, 0)
            (diag if load >= TIGHT else debug)(
                f"memory: a rank needs ~{_size(top)} at most under --shard {mode} ({said}); it fits, "
                f"{load:.0%} of the {limit['what']}" + (f" for its {sharers} ranks" if sharers > 1 else ""))
        return
    _, limit, sharers = worst
    best = _instead(ranks, mode, modes)
    share = f"for its {sharers} ranks" if sharers > 1 else "for it"
    message = (f"a rank needs ~{_size(top)} under --shard {mode} ({said}), and the {limit['what']} has "
               f"{_size(limit['bytes'])} {share}")
    if best is not None:
        message += f"; --shard {best} needs ~{_size(max(r['peaks'][best] for r in ranks))}"
        hint = f"use --shard {best}"
    else:
        sharded = modes[-1]
        if sharded != mode:
            message += f"; even --shard {sharded} needs ~{_size(max(r['peaks'][sharded] for r in ranks))}"
        hint = "run more ranks on more nodes, a smaller --batch-size, or --activation-checkpointing"
    refusal = ConfigError(message, hint + " (if the estimate is wrong for your model, --no-memory-check skips it)")
    refusal.echo = backend.is_master
    raise refusal
