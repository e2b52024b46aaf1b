"""ZeRO-1/2 on any backend's collectives: each rank keeps 1/N of the optimizer state.

``--shard optimizer``. Every parameter is *owned* by one rank, and the gradients travel in
**buckets** (``--bucket-cap-mb``, or a quarter of the model if less, see :func:`bucket_bytes`;
filled in reverse parameter order, the order backward produces them), like DDP's and hvdkit's
bucketed reducers. Inside a bucket the parameters are
given to owners largest first, so each owner's segment is about 1/N of the bucket; the bucket's
flat buffer is laid out owner by owner, padded to equal segments, and one **reduce-scatter**
leaves each rank exactly the averaged gradients of the parameters it owns. A bucket is started
by a gradient hook as soon as its last gradient has been accumulated (and every earlier bucket
has started: every rank issues the collectives in one order), so it travels while backward is
still computing the earlier layers; :meth:`ShardedOptimizer.reduce_gradients` only waits.

A bucket's gradients are freed as it starts (its flat buffer travels; at most
``MAX_IN_FLIGHT`` are left in flight), so after the reduction a rank holds only the gradients
it owns (ZeRO-2's saving), from the result; it steps them with
the user's own optimizer class and hyper-parameters, holding state only for them (ZeRO-1), and
one **all-gather** per bucket gives every rank the whole model again.

Why parameters are owned whole rather than cut into flat slices: each parameter's optimizer
state then stays the user's optimizer's own, per parameter, so any ``torch.optim`` optimizer
works (AdamW, SGD, a LAMB whose update needs the whole tensor, one named by import path) and
the checkpoint holds the standard ``optimizer.state_dict()`` layout, which a run resumes from
at another world size or with sharding off. The cost is padding when one parameter dominates a
bucket: a reduce-scatter would then send N times that tensor. Such a bucket (N x its widest
segment > 2 x its size) is **replicated** instead: allreduced (what unsharded DDP pays) and
its parameters broadcast from their owners after the step.

The buckets are planned and started by hvdkit's one bucket engine
(:mod:`hvdkit.backends.buckets`); this module holds only what is ZeRO's: who owns which
parameter, the owner-by-owner layout of a bucket and its collective, the local step, the
gather, and the state's standard layout. The communicator supplies the collectives
(``Backend.start_reduce_scatter_mean`` and friends), so Horovod
(``hvd.reducescatter``/``hvd.allgather``) and torch.distributed share this one piece.
"""

from __future__ import annotations

import collections
import math
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ..h5tree import Deferred, materialize, materialize_into
from ..sizes import nbytes
from .buckets import MAX_IN_FLIGHT, BucketEngine, bucket_bytes, plan_buckets
from .comm import Communicator, TensorSpec, Wait, broadcast_tree, skeleton, state_tensors
from .strategy import Strategy, same_optimizer

__all__ = ["OwnedBucket", "ShardedOptimizer", "ZeroStrategy", "assign_owners", "plan_owned"]


def _indexed(groups: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``groups`` as a ``state_dict`` lists them: hyper-parameters, and parameters by index."""
    out, at = [], 0
    for group in groups:
        n = len(group["params"])
        out.append({**{k: v for k, v in group.items() if k != "params"}, "params": list(range(at, at + n))})
        at += n
    return out


def _entry(state: dict[Any, Any], index: int) -> Any:
    """A saved parameter's state, keyed by its index (an int, or a string once read from a file)."""
    return state.get(index, state.get(str(index)))


@dataclass(frozen=True)
class OwnedBucket:
    """A bucket of the plan (global parameter indices), and who owns which of its parameters."""

    index: int                 # position in the plan: the order every rank starts buckets in
    params: tuple[int, ...]
    segments: list[list[int]]  # per owner rank, in layout order
    width: int                 # elements of the widest owner segment (the padded segment length)
    scatter: bool              # reduce-scatter + all-gather; False: allreduce + broadcasts


def assign_owners(plan: Sequence[Sequence[int]], numels: list[int], world: int) -> tuple[list[OwnedBucket], list[int]]:
    """Every parameter's owner, bucket by bucket: largest first to the rank with the least of
    the bucket (then the least overall, then the lowest rank), so every rank computes one
    assignment; and each bucket's owner-by-owner layout."""
    owner = [0] * len(numels)
    total_load = [0] * world
    buckets = []
    for index, members in enumerate(plan):
        load = [0] * world
        segments: list[list[int]] = [[] for _ in range(world)]
        for i in sorted(members, key=lambda k: (-numels[k], -k)):
            r = min(range(world), key=lambda q: (load[q], total_load[q], q))
            owner[i] = r
            segments[r].append(i)
            load[r] += numels[i]
            total_load[r] += numels[i]
        width = max(max(load), 1)
        buckets.append(OwnedBucket(index=index, params=tuple(members), segments=segments, width=width,
                                   scatter=world * width <= 2 * sum(load)))
    return buckets, owner


def plan_owned(params: Sequence[torch.Tensor], bucket_cap_mb: float,
               world: int) -> tuple[list[list[int]], list[OwnedBucket], list[int]]:
    """The buckets of ``params`` (the optimizer's, in its groups' order), their owners' layout
    and every parameter's owner: a function of the shapes alone (a meta model's too), so the
    memory preflight plans exactly what the optimizer will."""
    sizes = [nbytes([p]) for p in params]
    plan = plan_buckets(sizes, [(p.dtype, p.device) for p in params], bucket_bytes(sum(sizes), bucket_cap_mb))
    buckets, owner = assign_owners(plan, [p.numel() for p in params], world)
    return plan, buckets, owner


class ShardedOptimizer(torch.optim.Optimizer):
    """Wraps the optimizer the user built: same ``param_groups`` (schedulers work on them), state
    only for this rank's parameters. :meth:`step` is reduce, clip, local step, gather.

    ``backward_passes``: backward passes per step (gradient accumulation): a bucket starts
    when each of its gradients has been accumulated that many times. Fewer (a short last group)
    or more (a loop that accumulates without saying so) are still right: what has not started,
    or has grown since, is reduced in :meth:`reduce_gradients`."""

    def __init__(self, optimizer: torch.optim.Optimizer, comm: Communicator, bucket_cap_mb: float = 25.0,
                 backward_passes: int = 1) -> None:
        # no super().__init__: the wrapped optimizer's groups are this one's (no copy of params)
        self.wrapped = optimizer
        self.comm = comm
        self.defaults = optimizer.defaults
        self.param_groups = optimizer.param_groups
        self.state: dict[Any, Any] = {}  # type: ignore[assignment]  # the state lives in self.local
        self._optimizer_step_pre_hooks: dict[int, Callable[..., Any]] = {}
        self._optimizer_step_post_hooks: dict[int, Callable[..., Any]] = {}
        self.params = [p for g in self.param_groups for p in g["params"]]
        self._index_of = {id(p): i for i, p in enumerate(self.params)}
        rank = comm.rank
        plan, self.buckets, self.owner = plan_owned(self.params, bucket_cap_mb, comm.size)
        self.mine = [i for i, o in enumerate(self.owner) if o == rank]
        self._keep = [self._keep_plan(b) for b in self.buckets]  # indexed by OwnedBucket.index
        groups = []
        self._group_of_local: list[int] = []
        for gi, group in enumerate(self.param_groups):
            owned = [p for p in group["params"] if self.owner[self._index(p)] == rank]
            if owned:
                groups.append({**{k: v for k, v in group.items() if k != "params"}, "params": owned})
                self._group_of_local.append(gi)
        # the user's class and hyper-parameters over the owned parameters only (None: owns none)
        self.local = same_optimizer(optimizer, groups) if groups else None
        self._pending: dict[str, Any] | None = None  # a full state dict rank 0 loaded, to scatter
        # overlap with backward: the engine's hooks start whole buckets, in order, as they complete
        self._results: dict[int, Wait] = {}  # this step's started buckets (a re-send adds to the first)
        self._started: list[Wait] = []       # in the order started
        self.engine = BucketEngine(self.params, plan, self._start, backward_passes)
        self.waited = 0.0  # seconds in step() waiting for collectives
        self.kept_bytes = 0  # reduced gradients this rank held until its last step (ZeRO-2: its own)
        if optimizer.state:  # state the caller's optimizer had (a restore before the wrap):
            self.load_state_dict(optimizer.state_dict())  # kept; the broadcast gives root's

    @property
    def overlap(self) -> dict[str, int]:
        """How many buckets there are, how many are replicated, how often they overlapped backward,
        and the bytes of reduced gradients this rank kept until its last step against the bytes
        of the parameters it owns (equal: nothing but its own is kept)."""
        return {**self.engine.stats, "replicated": sum(not b.scatter for b in self.buckets),
                "kept_bytes": self.kept_bytes,
                "owned_bytes": nbytes(self.params[i] for i in self.mine)}

    def _index(self, p: torch.Tensor) -> int:
        return self._index_of[id(p)]

    def _slots(self, bucket: OwnedBucket) -> Iterator[tuple[int, torch.Tensor, int]]:
        """(owner, parameter, offset in the bucket's padded flat buffer), owner by owner."""
        for r, seg in enumerate(bucket.segments):
            at = r * bucket.width
            for i in seg:
                yield r, self.params[i], at
                at += self.params[i].numel()

    def _own_slots(self, bucket: OwnedBucket) -> Iterator[tuple[torch.Tensor, int]]:
        """(parameter, offset in this rank's segment) for the parameters it owns in ``bucket``."""
        at = 0
        for i in bucket.segments[self.comm.rank]:
            yield self.params[i], at
            at += self.params[i].numel()

    def remove_hooks(self) -> None:
        """Stop watching the parameters' gradients and drop what is in flight (the optimizer is
        being discarded)."""
        self.engine.reset(wait=False)
        self.engine.remove()

    # -- the step, in three collective parts ---------------------------------------------
    def _start(self, b: int) -> Wait:
        """Copy bucket ``b``'s gradients (zeros where none) into one buffer, free them (ZeRO-2:
        the buffer is what travels, and the owner's come back from the result) and start its
        collective. The oldest bucket beyond ``MAX_IN_FLIGHT`` is waited for here. A bucket
        started again in one step (a gradient grew after it started, and the engine re-sends
        it) adds the new result to the first: the reduction is linear, and the first pass's
        gradients are gone."""
        bucket = self.buckets[b]
        first = self.params[bucket.params[0]]
        name = f"zero.{bucket.index}"
        if bucket.scatter:
            flat = torch.zeros(bucket.width * len(bucket.segments), dtype=first.dtype, device=first.device)
            for _, p, at in self._slots(bucket):
                if p.grad is not None:
                    flat[at:at + p.numel()].copy_(p.grad.reshape(-1))
        else:
            flat = torch.cat([self.params[i].grad.reshape(-1) if self.params[i].grad is not None
                              else torch.zeros(self.params[i].numel(), dtype=first.dtype, device=first.device)
                              for i in bucket.params])
        for i in bucket.params:
            self.params[i].grad = None
        # held in a list and dropped once waited for: a torch.distributed work keeps its input
        # and output tensors (the flat buffer, the whole segment) for as long as it is referenced
        pending = [(self.comm.start_reduce_scatter_mean if bucket.scatter else self.comm.start_allreduce_mean)(
            flat, name)]
        del flat
        earlier, done = self._results.get(b), list[torch.Tensor]()

        def result() -> torch.Tensor:
            if not done:
                out = self._kept(bucket, pending.pop()())
                done.append(out if earlier is None else earlier() + out)
            return done[0]

        self._results[b] = result
        self._started.append(result)
        if len(self._started) > MAX_IN_FLIGHT:
            self._started[-1 - MAX_IN_FLIGHT]()
        return result

    def _keep_plan(self, bucket: OwnedBucket) -> tuple[int, list[tuple[int, int]] | None]:
        """What :meth:`_kept` cuts from ``bucket``'s result, worked out once: this rank's element
        count, and for an allreduced bucket the (start, stop) of each own parameter in the
        bucket's order (None: the rank owns all of it, in that order, so the result is kept whole)."""
        own = bucket.segments[self.comm.rank]
        n = sum(self.params[i].numel() for i in own)
        if bucket.scatter:
            return n, None
        offset, at = {}, 0
        for i in bucket.params:
            offset[i] = at
            at += self.params[i].numel()
        if n == at and [offset[i] for i in own] == sorted(offset[i] for i in own):
            return n, None
        return n, [(offset[i], offset[i] + self.params[i].numel()) for i in own]

    def _kept(self, bucket: OwnedBucket, out: torch.Tensor) -> torch.Tensor:
        """What this rank keeps of bucket's reduced result until the step: its own parameters'
        gradients in :meth:`_own_slots` order, nothing else. The padding of a segment (all of it
        where the rank owns nothing in the bucket: a one-parameter bucket's other ranks) and the
        others' parts of an allreduced bucket are freed as the result arrives; kept, they made
        every rank hold every large parameter's gradient until the step."""
        n, ranges = self._keep[bucket.index]
        if bucket.scatter:  # out is this rank's padded segment: its parameters first
            return out if n == out.numel() else out[:n].clone()
        if ranges is None:
            return out  # owns the whole bucket, in the bucket's order
        return torch.cat([out[a:b] for a, b in ranges]) if ranges else out[:0].clone()

    def reduce_gradients(self) -> None:
        """Wait for every bucket (the engine starts those backward did not): this rank's
        parameters get the averaged gradients, the rest none. :attr:`kept_bytes`: what this rank
        held of the reduced gradients until this step."""
        rank = self.comm.rank
        kept = self.engine.finish()
        self._results.clear()
        self._started.clear()
        self.kept_bytes = sum(k.untyped_storage().nbytes() for k in kept)
        for bucket, out in zip(self.buckets, kept):
            for p, at in self._own_slots(bucket):
                p.grad = out[at:at + p.numel()].view_as(p)
        for i, p in enumerate(self.params):
            if self.owner[i] != rank:
                p.grad = None  # ZeRO-2: a rank keeps only the gradients it steps

    def owned_grad_norm(self) -> torch.Tensor:
        """The global L2 norm of the reduced gradients (collective: squares summed over ranks)."""
        sq = torch.zeros((), dtype=torch.float64)
        for i in self.mine:
            g = self.params[i].grad
            if g is not None:
                sq += g.detach().double().pow(2).sum().cpu()
        return torch.as_tensor(math.sqrt(self.comm.allreduce_metric(sq, "sum")))

    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        """``clip_grad_norm_`` over the whole model, on the owned, reduced gradients."""
        total = self.owned_grad_norm()
        coef = max_norm / (float(total) + 1e-6)
        if coef < 1.0:
            for i in self.mine:
                g = self.params[i].grad
                if g is not None:
                    g.mul_(coef)
        return total

    def local_step(self) -> None:
        """Step the owned parameters with the current hyper-parameters (schedulers set them on
        :attr:`param_groups`)."""
        if self.local is None:
            return
        for local_group, gi in zip(self.local.param_groups, self._group_of_local):
            for key, value in self.param_groups[gi].items():
                if key != "params":
                    local_group[key] = value
        self.local.step()

    def gather_parameters(self) -> None:
        """Every rank takes every owner's updated parameters: one all-gather per scattered
        bucket, one broadcast from the owner per parameter of a replicated one, in plan order,
        at most :data:`~hvdkit.backends.buckets.MAX_IN_FLIGHT` in flight (each all-gather's
        result is a whole bucket: all at once would be the whole model again)."""
        rank = self.comm.rank
        pending: collections.deque[tuple[OwnedBucket, Callable[[], torch.Tensor]]] = collections.deque()

        def finish_oldest() -> None:
            bucket, wait = pending.popleft()
            flat = wait()
            if bucket.scatter:
                for r, p, at in self._slots(bucket):
                    if r != rank:
                        p.copy_(flat[at:at + p.numel()].view_as(p))

        with torch.no_grad():
            for bucket in self.buckets:
                if bucket.scatter:
                    first = self.params[bucket.params[0]]
                    mine = torch.zeros(bucket.width, dtype=first.dtype, device=first.device)
                    for p, at in self._own_slots(bucket):
                        mine[at:at + p.numel()].copy_(p.reshape(-1))
                    pending.append((bucket, self.comm.start_all_gather_flat(mine, f"zero.{bucket.index}")))
                else:
                    for i in bucket.params:
                        pending.append((bucket, self.comm.start_broadcast_(self.params[i].data, self.owner[i],
                                                                           f"zero.{bucket.index}.{i}")))
                while len(pending) > MAX_IN_FLIGHT:
                    finish_oldest()
            while pending:
                finish_oldest()

    def step(self, closure: Any = None, clip_grad_norm: float | None = None) -> Any:  # type: ignore[override]
        """Collective: reduce, clip the reduced gradients to ``clip_grad_norm`` (their global
        norm), step this rank's parameters, gather. :attr:`waited` grows by the seconds spent
        waiting for the two collectives (what overlap did not hide)."""
        loss = closure() if closure is not None else None
        started = time.perf_counter()
        self.reduce_gradients()
        self.waited += time.perf_counter() - started
        if clip_grad_norm:
            self.clip_grad_norm_(clip_grad_norm)
        self.local_step()
        started = time.perf_counter()
        self.gather_parameters()
        self.waited += time.perf_counter() - started
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.engine.reset()  # a skipped step: finish and drop what is in flight
        self._results.clear()
        self._started.clear()
        for p in self.params:
            if set_to_none:
                p.grad = None
            elif p.grad is not None:
                p.grad.zero_()

    # -- state: the standard layout, streamed to rank 0 ------------------------------------
    def state_dict(self) -> dict[str, Any]:  # type: ignore[override]
        """Collective: the whole optimizer's ``state_dict`` in ``torch.optim``'s layout, the same
        structure on every rank, each tensor a :class:`~hvdkit.h5tree.Deferred` that, when
        fetched (on every rank, in order), comes from its owner to rank 0: memory is one
        tensor, never the whole state (owner 0's tensors need no collective at all)."""
        local_index = {i: k for k, i in enumerate(self._local_order())}
        local_sd = self.local.state_dict() if self.local is not None else {"state": {}}
        mine = {i: local_sd["state"][local_index[i]] for i in self.mine if local_index[i] in local_sd["state"]}
        shapes = self.comm.gather_objects({i: skeleton(entry) for i, entry in mine.items()})
        state: dict[int, Any] = {}
        for i, owner in enumerate(self.owner):
            if i in shapes[owner]:
                state[i] = self._deferred(shapes[owner][i], mine.get(i), owner, f"zero.sd.{i}")
        return {"state": state, "param_groups": _indexed(self.param_groups)}

    def _deferred(self, shape: Any, mine: Any, owner: int, name: str) -> Any:
        """A skeleton's tensors as Deferred leaves that bring ``owner``'s tensor to rank 0."""
        if isinstance(shape, TensorSpec):
            return Deferred(lambda: self._to_rank0(mine, shape, owner, name), shape.shape, shape.dtype)
        if isinstance(shape, dict):
            return {k: self._deferred(v, mine[k] if mine is not None else None, owner, f"{name}.{k}")
                    for k, v in shape.items()}
        if isinstance(shape, (list, tuple)):
            return type(shape)(self._deferred(v, mine[j] if mine is not None else None, owner, f"{name}.{j}")
                               for j, v in enumerate(shape))
        return shape

    def _to_rank0(self, mine: torch.Tensor | None, shape: TensorSpec, owner: int, name: str) -> torch.Tensor | None:
        rank = self.comm.rank
        if owner == 0:
            return mine.detach().cpu() if rank == 0 and mine is not None else None
        buf = mine.detach().contiguous() if rank == owner and mine is not None else \
            torch.empty(shape.shape, dtype=shape.dtype, device=self.comm.device)
        self.comm.start_broadcast_(buf, owner, name)()
        return buf.cpu() if rank == 0 else None

    def _local_order(self) -> list[int]:
        """Global indices of the local optimizer's parameters, in its own order."""
        return [self._index(p) for g in (self.local.param_groups if self.local else []) for p in g["params"]]

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load what this rank owns from a whole ``state_dict`` (any world size, sharded or not);
        on the rank that calls it alone (a restore on rank 0) the rest waits for
        :meth:`scatter_pending`."""
        saved = state_dict["param_groups"]
        if len(saved) != len(self.param_groups) or any(
                len(s["params"]) != len(g["params"]) for s, g in zip(saved, self.param_groups)):
            raise ValueError("the optimizer state does not match this model's parameter groups")
        for group, s in zip(self.param_groups, saved):
            group.update({k: v for k, v in s.items() if k != "params"})
        self._load_mine(state_dict["state"])
        self._pending = state_dict

    def _load_mine(self, state: dict[Any, Any]) -> None:
        if self.local is None:
            return
        order = self._local_order()
        held = self.local.state_dict()["state"]  # read into where this rank holds state already
        local_state = {k: materialize_into(_entry(state, i), held.get(k)) for k, i in enumerate(order)
                       if _entry(state, i) is not None}
        self.local.load_state_dict({"state": local_state, "param_groups": _indexed(self.local.param_groups)})

    def scatter_pending(self, root: int = 0) -> None:
        """Collective: every rank takes from ``root``'s loaded ``state_dict`` the state of the
        parameters it owns, one parameter at a time, and ``root``'s hyper-parameters."""
        full = self._pending if self.comm.rank == root else None
        mine = [{k: v for k, v in g.items() if k != "params"} for g in self.param_groups]
        hyper = self.comm.broadcast_object(mine, root)  # root's (every rank sends a same-shaped list)
        for group, h in zip(self.param_groups, hyper):
            group.update(h)
        has_state = self.comm.broadcast_object(bool(full and full["state"]), root)
        if not has_state:
            self._pending = None
            return
        received: dict[int, Any] = {}
        held: dict[int, Any] = {}  # this rank's current state by global index: each entry is received into it
        if self.local is not None and self.comm.rank != root:
            order = self._local_order()
            held = {order[k]: v for k, v in self.local.state_dict()["state"].items()}
        for i, owner in enumerate(self.owner):
            if owner == root:
                continue  # root loaded its own already
            entry = materialize(_entry(full["state"], i)) if full is not None else None  # one parameter's
            owned = owner == self.comm.rank
            value = broadcast_tree(self.comm, entry, root, into=held.get(i) if owned else None)
            if owned and value is not None:
                received[i] = value
        if self.comm.rank != root:
            self._load_mine(received)
        self._pending = None


class ZeroStrategy(Strategy):
    """``--shard optimizer``: whole parameters on every rank, each rank stepping and holding
    state for the ones it owns (:class:`ShardedOptimizer`), on any communicator's collectives."""

    shard = "optimizer"

    def __init__(self, comm: Communicator, bucket_cap_mb: float, backward_passes: int) -> None:
        super().__init__(comm)
        self.bucket_cap_mb, self.backward_passes = bucket_cap_mb, backward_passes
        self.optimizer: ShardedOptimizer | None = None

    def wrap(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> tuple[nn.Module, torch.optim.Optimizer]:
        self.optimizer = ShardedOptimizer(optimizer, self.comm, bucket_cap_mb=self.bucket_cap_mb,
                                          backward_passes=self.backward_passes)
        return model, self.optimizer

    def _sharded(self) -> ShardedOptimizer:
        assert self.optimizer is not None, "wrap() comes first"
        return self.optimizer

    # accumulate: the default nullcontext; the engine counts backward passes itself

    def optimizer_step(self, optimizer: torch.optim.Optimizer, scaler: torch.amp.GradScaler | None,
                       clip_grad_norm: float | None) -> float:
        """Reduce-scatter, clip the owned reduced gradients by the global norm, step, all-gather
        (no scaler: the config refuses fp16 with sharding)."""
        sharded = self._sharded()
        waited = sharded.waited
        sharded.step(clip_grad_norm=clip_grad_norm)
        return sharded.waited - waited

    def load_optimizer_state_dict(self, optimizer: torch.optim.Optimizer, state: dict[str, Any]) -> None:
        # the tensors stay in the file: this rank reads the part it owns, and the scatter the
        # rest, one parameter's state at a time
        optimizer.load_state_dict({**state, "param_groups": materialize(state["param_groups"])})

    def broadcast_optimizer(self, optimizer: torch.optim.Optimizer, root: int) -> None:
        self._sharded().scatter_pending(root)  # each rank takes the part it owns

    def held(self, model: nn.Module,
             optimizer: torch.optim.Optimizer) -> tuple[list[torch.Tensor], list[torch.Tensor], list[Any]]:
        """Every parameter; of the owned part, its state and its gradients, which are all that
        survive the reduction."""
        sharded = self._sharded()
        grads = [sharded.params[i] for i in sharded.mine if sharded.params[i].requires_grad]
        return list(model.parameters()), grads, state_tensors(sharded.local)

    def report(self) -> dict[str, Any]:
        return {"shard_overlap": dict(self.optimizer.overlap)} if self.optimizer is not None else {}

    def close(self) -> None:
        if self.optimizer is not None:
            self.optimizer.remove_hooks()
