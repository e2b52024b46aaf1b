"""PowerSGD gradient compression on both backends: one state, one checkpoint format.

PowerSGD (Vogels, Karimireddy and Jaggi, NeurIPS 2019) sends each gradient matrix M (n x m)
as two rank-r factors: P = M Q is averaged, orthogonalised, Q = M^T P is averaged, and the
update is P Q^T. What the factors miss is kept per rank and added to the next step's
gradient (*error feedback*); Q is reused from the previous step (*warm start*). Vectors and
matrices too small to gain (n m <= 2 (n + m) r) are averaged whole.

* :meth:`PowerSGD.start` is torch's ``powerSGD_hook``, step by step and in the same order
  (the same ``PowerSGDState``, orthogonalisation, tensor grouping and random draws), given
  the allreduce to use, in two parts: :meth:`_Bucket.send_q` (P is reduced: Q is computed
  and sent) and :meth:`_Bucket.finish` (the averaged gradient). Who calls them when is each
  backend's own, and this module schedules nothing: Horovod's reducer runs it as one more
  collective of hvdkit's bucket engine (:mod:`hvdkit.backends.hvd_reducer`), DDP as a comm
  hook on DDP's own buckets (``DDPReplicated`` in :mod:`hvdkit.backends.ddp`). Two ranks with
  the same buckets give torch's hook's update, bit for bit, on both backends
  (tests/test_compression.py).

The state is each rank's own (the error feedback), so a checkpoint gathers it from every
rank (:func:`gather_state`) and the broadcast after a load gives each rank its own
(:func:`apply_state`; ``Replicated`` in :mod:`hvdkit.backends.strategy` calls both). It is
stored per *parameter*, not per bucket, so it survives a change of buckets: DDP re-forms its
buckets in the first step of every process, which would otherwise misplace a resumed run's
error feedback.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch

from .comm import Communicator, Wait, to_cpu

if TYPE_CHECKING:
    from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import PowerSGDState

    from ...config import CompressionSpec

__all__ = ["wire_elements", "PowerSGD", "STATE_KEY", "gather_state", "apply_state"]

STATE_KEY = "powersgd"  # its entry in the optimizer's state dict (hvdkit's checkpoints)
MIN_COMPRESSION_RATE = 2  # torch's default: compress a matrix only if it shrinks more than 2x
AllreduceSum = Callable[[torch.Tensor, str], Wait]


def _matrices(shapes: Sequence[torch.Size], rank: int) -> list[tuple[int, int, int, int]]:
    """The compressed matrices of a bucket as torch's hook orders them: ``(position, n, m, r)``
    grouped by shape in first-seen order (its P and Q buffers and random draws follow it)."""
    groups: dict[tuple[int, int], list[tuple[int, int, int, int]]] = defaultdict(list)
    for i, shape in enumerate(shapes):
        n = shape[0] if len(shape) else 1
        m = max(1, int(torch.Size(shape).numel()) // max(n, 1))
        r = min(n, m, rank)
        if (n + m) * r * MIN_COMPRESSION_RATE < n * m:
            groups[(n, m)].append((i, n, m, r))
    return [entry for group in groups.values() for entry in group]


def wire_elements(shapes: Sequence[torch.Size], rank: int) -> dict[str, int]:
    """What PowerSGD sends for one bucket of parameters of ``shapes``, in elements: the
    uncompressed rest, P (n x r per matrix) and Q (m x r), and the products' size (sum of
    n·m·r) that measures its arithmetic. The cost model (:mod:`hvdkit.bench.costmodel`) uses it."""
    mats = _matrices(shapes, rank)
    compressed = {i for i, *_ in mats}
    plain = sum(int(torch.Size(s).numel()) for i, s in enumerate(shapes) if i not in compressed)
    return {"plain": plain, "p": sum(n * r for _, n, _, r in mats), "q": sum(m * r for _, _, m, r in mats),
            "products": sum(n * m * r for _, n, m, r in mats)}


def idle_reasons(spec: CompressionSpec, shapes: Sequence[torch.Size], steps: int, at_step: int) -> list[str]:
    """Why ``--compression powersgd`` would do nothing in a run of ``steps`` optimizer steps
    (now at ``at_step``) over parameters of ``shapes``: its start lies beyond the run, or its
    rank leaves no matrix worth compressing (each smaller than its factors). Empty: it works."""
    reasons = []
    if at_step < spec.start and spec.start >= steps:
        reasons.append(f"it starts at step {spec.start} and this run has {steps} optimizer steps, so every "
                       f"step sends plain gradients (train longer, or start earlier: powersgd:start=N, N >= 2)")
    if not _matrices(list(shapes), spec.rank):
        reasons.append(f"at rank {spec.rank} no parameter matrix is larger than its two factors, so nothing is "
                       "compressed (a lower powersgd:rank=R compresses)")
    return reasons


def _maybe(allreduce_sum: AllreduceSum, tensor: torch.Tensor, name: str) -> Wait:
    """Every rank has the same buckets, so an empty part is empty everywhere: nothing to send."""
    return allreduce_sum(tensor, name) if tensor.numel() else (lambda: tensor)


class PowerSGD:
    """PowerSGD's state for one process (torch's ``PowerSGDState``) and its bucket layouts.

    ``names`` maps a parameter to its name; the layouts (which parameters each bucket
    holds) are learned as buckets arrive, so DDP's and hvdkit's buckets both work.
    """

    def __init__(self, spec: CompressionSpec, names: dict[int, str]) -> None:
        from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import PowerSGDState

        self.state: PowerSGDState = PowerSGDState(
            process_group=None, matrix_approximation_rank=spec.rank, start_powerSGD_iter=spec.start,
            min_compression_rate=MIN_COMPRESSION_RATE, use_error_feedback=True, warm_start=True, random_seed=0)
        self._names = names
        self._layouts: dict[int, tuple[str, ...]] = {}
        self._shapes: dict[str, torch.Size] = {}
        self._device: dict[int, tuple[torch.device, torch.dtype]] = {}
        self._pending: dict[str, dict[str, torch.Tensor]] = {"error": {}, "q": {}}  # per parameter, to place

    # -- buckets ------------------------------------------------------------------------------
    def see_bucket(self, index: int, params: Sequence[torch.Tensor]) -> None:
        """Before a bucket is compressed: if the buckets changed, move the state to the new ones."""
        names = tuple(self._names[id(p)] for p in params)
        if self._layouts.get(index) == names:
            return
        elsewhere = any(set(names) & set(held) for i, held in self._layouts.items() if i != index)
        if index in self._layouts or elsewhere:  # re-formed buckets: every bucket's state back to parameters
            for name, part in self._per_parameter().items():
                self._pending[name].update(part)
            self.state.error_dict.clear()
            self.state.p_memory_dict.clear()
            self.state.q_memory_dict.clear()
            self._layouts.clear()
            self._device.clear()
        self._layouts[index] = names
        self._shapes.update((n, p.shape) for n, p in zip(names, params))
        self._device[index] = (params[0].device, params[0].dtype) if params else (torch.device("cpu"), torch.float32)
        self._place(index)

    def _place(self, index: int) -> None:
        """Put what a load or a re-forming left per parameter into bucket ``index``'s state."""
        names, st = self._layouts[index], self.state
        device, dtype = self._device[index]
        errors = self._pending["error"]
        if names and all(n in errors for n in names):
            st.error_dict[index] = torch.cat([errors.pop(n).reshape(-1) for n in names]).to(device, dtype)
        qs = self._pending["q"]
        mats = _matrices([self._shapes[n] for n in names], st.matrix_approximation_rank)
        if mats and all(names[i] in qs and tuple(qs[names[i]].shape) == (m, r) for i, _, m, r in mats):
            st.q_memory_dict[index] = torch.cat([qs.pop(names[i]).reshape(-1) for i, *_ in mats]).to(device, dtype)
            st.p_memory_dict[index] = torch.empty(sum(n * r for _, n, _, r in mats), device=device, dtype=dtype)

    def _per_parameter(self) -> dict[str, dict[str, torch.Tensor]]:
        """The bucket states cut into parameters: error feedback (flat) and Q (m x r)."""
        st = self.state
        out: dict[str, dict[str, torch.Tensor]] = {"error": {}, "q": {}}
        for index, names in self._layouts.items():
            shapes = [self._shapes[n] for n in names]
            if index in st.error_dict:
                at = 0
                for n, shape in zip(names, shapes):
                    size = int(torch.Size(shape).numel())
                    out["error"][n] = st.error_dict[index][at:at + size].detach().cpu().clone()
                    at += size
            if index in st.q_memory_dict:
                at = 0
                for i, _, m, r in _matrices(shapes, st.matrix_approximation_rank):
                    out["q"][names[i]] = st.q_memory_dict[index][at:at + m * r].detach().cpu().clone().view(m, r)
                    at += m * r
        return out

    def report(self) -> dict[str, Any]:
        """Its settings, the optimizer steps so far, and the gradient elements it sent per
        element it was given (over the compressed steps of this process)."""
        st = self.state
        before, after = st.total_numel_before_compression, st.total_numel_after_compression
        return {"kind": "powersgd", "rank": st.matrix_approximation_rank, "start": st.start_powerSGD_iter,
                "steps": int(st.iter), "sent_fraction": after / before if before else None}

    # -- checkpoints ----------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """This rank's state by parameter name: ``iter``, the random state, ``q`` (the same
        on every rank) and ``error`` (this rank's own)."""
        placed = self._per_parameter()
        rng: Any = self.state.rng.get_state()
        return {"iter": int(self.state.iter), "rng": [rng[0], rng[1].copy(), int(rng[2]), int(rng[3]), float(rng[4])],
                "q": {**self._pending["q"], **placed["q"]}, "error": {**self._pending["error"], **placed["error"]}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Take a state from :meth:`state_dict` (possibly another rank's, without ``error``:
        then the error feedback starts from zero); it reaches the buckets as they arrive."""
        st = self.state
        st.iter = int(state["iter"])
        st.rng.set_state(tuple(state["rng"]))
        for d in (st.error_dict, st.p_memory_dict, st.q_memory_dict):
            d.clear()
        self._pending = {"error": dict(state.get("error", {})), "q": dict(state["q"])}
        for index in self._layouts:
            self._place(index)

    # -- one bucket's step ---------------------------------------------------------------------
    def start(self, index: int, last: bool, flat: torch.Tensor, views: Sequence[torch.Tensor],
              params: Sequence[torch.Tensor], allreduce_sum: AllreduceSum, size: int) -> _Bucket:
        """Start bucket ``index`` (``flat``, whose ``views`` are its parameters' gradients;
        ``last``: the last bucket of the step): add the error feedback, compress, and start the
        allreduces of the uncompressed part and of P. Mirrors ``powerSGD_hook`` line by line."""
        from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import _orthogonalize

        st = self.state
        if st.iter < st.start_powerSGD_iter:  # plain averaging, as torch's default allreduce
            if last:
                st.iter += 1
            flat.div_(size)
            return _Bucket(flat, finish=allreduce_sum(flat, f"hvdkit.psgd.{index}"))
        self.see_bucket(index, params)
        if index in st.error_dict:
            flat.add_(st.error_dict[index])
        else:
            st.error_dict[index] = torch.zeros_like(flat)
        before = flat.detach().clone()
        mats = _matrices([v.shape for v in views], st.matrix_approximation_rank)
        compressed = {i for i, *_ in mats}
        st.total_numel_before_compression += flat.numel()
        st.total_numel_after_compression += flat.numel() - sum(n * m - (n + m) * r for _, n, m, r in mats)
        plain = [v for i, v in enumerate(views) if i not in compressed]
        plain_flat = torch.cat([v.reshape(-1) for v in plain]) if plain else flat.new_empty(0)
        fresh = index not in st.p_memory_dict
        if fresh:
            st.p_memory_dict[index] = flat.new_empty(sum(n * r for _, n, _, r in mats))
            st.q_memory_dict[index] = flat.new_empty(sum(m * r for _, _, m, r in mats))
        ms, ps, qs, p_at, q_at = [], [], [], 0, 0
        for i, n, m, r in mats:
            ms.append(views[i].view(n, m).unsqueeze(0))
            ps.append(st.p_memory_dict[index][p_at:p_at + n * r].view(1, n, r))
            qs.append(st.q_memory_dict[index][q_at:q_at + m * r].view(1, m, r))
            p_at, q_at = p_at + n * r, q_at + m * r
        if not fresh:
            for q in qs:
                _orthogonalize(q, st.orthogonalization_epsilon)
        else:
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(st.rng.randint(1_000_000_000))
                for q in qs:
                    q.copy_(torch.randn(*q.shape, device="cpu", dtype=flat.dtype))
                    _orthogonalize(q, st.orthogonalization_epsilon)
        for mat, q, p in zip(ms, qs, ps):
            torch.bmm(mat, q, out=p)
        wait_plain = _maybe(allreduce_sum, plain_flat, f"hvdkit.psgd.{index}.plain")
        wait_p = _maybe(allreduce_sum, st.p_memory_dict[index], f"hvdkit.psgd.{index}.p")
        bucket = _Bucket(flat)

        def send_q() -> None:
            st.p_memory_dict[index].copy_(wait_p())
            for p in ps:
                _orthogonalize(p, st.orthogonalization_epsilon)
            for mat, p, q in zip(ms, ps, qs):
                torch.bmm(mat.transpose(1, 2), p, out=q)
            bucket.wait_q = _maybe(allreduce_sum, st.q_memory_dict[index], f"hvdkit.psgd.{index}.q")

        def finish() -> torch.Tensor:
            reduced = wait_plain().div_(size)
            at = 0
            for v in plain:
                v.copy_(reduced[at:at + v.numel()].view_as(v))
                at += v.numel()
            st.q_memory_dict[index].copy_(bucket.wait_q())
            st.q_memory_dict[index].div_(size)
            for p, q, mat in zip(ps, qs, ms):
                torch.bmm(p, q.transpose(1, 2), out=mat)
            st.error_dict[index] = before - flat
            if last:
                st.iter += 1
            return flat

        bucket.send_q_fn, bucket.finish_fn = send_q, finish
        return bucket


class _Bucket:
    """One bucket's PowerSGD step in flight: :meth:`send_q` once P is wanted (it waits for P's
    allreduce and starts Q's), then :meth:`finish`, which leaves the averaged gradient in the
    bucket's flat buffer and returns it. A backend decides when each runs; every rank must start
    the collectives of all its buckets in one order."""

    def __init__(self, flat: torch.Tensor, finish: Wait | None = None) -> None:
        self.flat = flat
        self.send_q_fn: Callable[[], None] | None = None
        self.finish_fn: Wait | None = finish
        self.wait_q: Wait = lambda: flat

    def send_q(self) -> None:
        if self.send_q_fn is not None:
            self.send_q_fn()
            self.send_q_fn = None

    def finish(self) -> torch.Tensor:
        self.send_q()
        assert self.finish_fn is not None
        return self.finish_fn()


def gather_state(comm: Communicator, powersgd: PowerSGD) -> dict[str, Any]:
    """Collective: this process's PowerSGD state with every rank's error feedback (for rank 0's
    checkpoint)."""
    mine = powersgd.state_dict()
    errors = comm.gather_objects(to_cpu(mine.pop("error")))
    return {**mine, "q": to_cpu(mine["q"]), "error": errors}


def apply_state(comm: Communicator, powersgd: PowerSGD, saved: dict[str, Any] | None) -> None:
    """This rank's part of a gathered state: its own error feedback where the world size is
    the one it was saved at (else the error feedback restarts from zero). None: saved without
    PowerSGD, which starts afresh."""
    if saved is None:
        return
    errors = saved["error"]
    mine = errors[comm.rank] if len(errors) == comm.size else {}
    powersgd.load_state_dict({**saved, "error": mine})
