"""A cost model of data-parallel step time: ring allreduce on an alpha-beta link, buckets that
start as backward produces them, and the machine's own overheads, fitted to measurements.

Ring allreduce of S bytes over N workers: t(N, S) = 2(N-1)·alpha + 2(N-1)/N · S / B
(alpha: per-message latency, B: link bandwidth). A step is simulated, not summed:

* forward takes ``(1 - backward_share)`` of the compute time, then backward produces the
  gradients layer by layer (a bucket can start once its last gradient exists): when each
  gradient exists comes from the layers' FLOPs, or without them from an even byte rate;
* the link sends one collective at a time, in bucket order; each also pays a fixed software
  cost (``message_s``), and on Horovod starts on its background thread's next tick
  (``cycle_s``), where collectives ready together share one negotiation;
* the step ends when both backward and the last collective have ended; on a machine whose
  communication shares the cores with compute (a CPU node; not NCCL on a GPU), every byte
  also costs ``cpu_s_per_byte`` of compute, and compression its own arithmetic.

With ``backward_share = 0`` nothing overlaps (the step is compute + every collective); the
overlap floor is max(compute, communication).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

__all__ = ["Link", "Message", "Overheads", "allreduce_time", "fit_alpha_beta", "messages", "predict_scaling",
           "step_time"]


@dataclass(frozen=True)
class Link:
    """A link between workers: per-message latency (s) and bandwidth (bytes/s)."""

    alpha_s: float
    bandwidth: float

    @classmethod
    def gbit(cls, rate_gbit: float, alpha_s: float) -> Link:
        """A link of ``rate_gbit`` Gbit/s at line rate."""
        return cls(alpha_s, rate_gbit * 1e9 / 8)


@dataclass(frozen=True)
class Message:
    """One collective: its bytes, and how far through backward its last gradient is ready (0-1)."""

    nbytes: float
    ready: float


@dataclass(frozen=True)
class Overheads:
    """What a step costs beyond compute and the wire; zeros are an ideal GPU cluster's."""

    backward_share: float = 2 / 3    # the part of compute in which communication can hide
    cpu_s_per_byte: float = 0.0      # communication work that takes compute's cores
    message_s: float = 0.0           # fixed cost of one collective in the framework
    extra_s: float = 0.0             # other per-step arithmetic (compression's products)
    cycle_s: float = 0.0             # Horovod: a collective starts on its background thread's next tick


def fit_alpha_beta(sizes: list[int], seconds: list[float], n: int) -> tuple[float, float]:
    """Least-squares (alpha seconds, B bytes/s) from allreduce times measured at world size ``n``."""
    if n < 2:
        raise ValueError("need a world of at least 2 to fit a ring allreduce")
    k_lat, k_bw = 2 * (n - 1), 2 * (n - 1) / n
    xs = [k_bw * s for s in sizes]
    mx, my = sum(xs) / len(xs), sum(seconds) / len(seconds)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, seconds)) / sum((x - mx) ** 2 for x in xs)
    intercept = my - slope * mx
    alpha = max(intercept / k_lat, 1e-7)
    return alpha, 1.0 / max(slope, 1e-15)


def allreduce_time(n: int, nbytes: float, alpha: float, bandwidth: float, messages: int = 1) -> float:
    """Predicted seconds to allreduce ``nbytes`` split into ``messages`` over ``n`` workers."""
    if n < 2:
        return 0.0
    return messages * 2 * (n - 1) * alpha + 2 * (n - 1) / n * nbytes / bandwidth


def messages(sizes: Sequence[float], plan: Sequence[Sequence[int]], scale: float = 1.0,
             ready: Sequence[float] | None = None) -> list[Message]:
    """The collectives of a bucket plan: ``sizes`` are the parameters' bytes in registration
    order, ``plan`` lists buckets of their indices in the order they start (as
    :func:`hvdkit.backends.buckets.plan_buckets` gives them). ``ready`` is how far through
    backward each parameter's gradient exists (0-1; e.g. from the layers' FLOPs); without it,
    backward produces gradients in reverse registration order at an even byte rate. ``scale``
    multiplies the bytes sent (0.5: fp16)."""
    if ready is None:
        total, acc, done = float(sum(sizes)), 0.0, [0.0] * len(sizes)
        for i in reversed(range(len(sizes))):
            acc += sizes[i]
            done[i] = acc / total
        ready = done
    return [Message(scale * sum(sizes[i] for i in b), max(ready[i] for i in b)) for b in plan if b]


def step_time(compute_s: float, msgs: Sequence[Message], n: int, link: Link, over: Overheads = Overheads()
              ) -> dict[str, float]:
    """Seconds per step (``step_s``) and its parts for ``msgs`` sent by ``n`` workers."""
    backward = over.backward_share * compute_s
    start_bwd = compute_s - backward
    end = start_bwd
    wire = 0.0
    for m in msgs:
        t = allreduce_time(n, m.nbytes, link.alpha_s, link.bandwidth) + over.message_s
        start = start_bwd + m.ready * backward
        if over.cycle_s > 0:  # negotiated on the next tick; collectives ready together share it
            start = math.ceil(start / over.cycle_s - 1e-9) * over.cycle_s
        end = max(end, start) + t
        wire += t
    sent = sum(m.nbytes for m in msgs) if n > 1 else 0.0
    step = max(compute_s, end) + over.cpu_s_per_byte * sent + over.extra_s
    return {"step_s": step, "comm_s": wire, "exposed_s": step - compute_s,
            "efficiency": compute_s / step if step > 0 else 1.0}


def predict_scaling(compute_s: float, grad_bytes: int, tensors: int, alpha: float, bandwidth: float,
                    workers: list[int], fusion_bytes: int = 128 << 20) -> list[dict[str, Any]]:
    """Step time and efficiency at each worker count, fused and unfused, no overlap assumed
    (an upper bound on step time; perfect overlap would give max(compute, comm))."""
    link, serial = Link(alpha, bandwidth), Overheads(backward_share=0.0)
    rows = []
    for n in workers:
        fused_n = max(1, math.ceil(grad_bytes / fusion_bytes))
        fused = step_time(compute_s, [Message(grad_bytes / fused_n, 1.0)] * fused_n, n, link, serial)
        unfused = step_time(compute_s, [Message(grad_bytes / tensors, 1.0)] * tensors, n, link, serial)
        rows.append({"workers": n, "comm_fused_s": fused["comm_s"], "comm_unfused_s": unfused["comm_s"],
                     "step_fused_s": fused["step_s"], "step_unfused_s": unfused["step_s"],
                     "efficiency_fused": fused["efficiency"], "efficiency_unfused": unfused["efficiency"],
                     "efficiency_overlap_bound": compute_s / max(compute_s, fused["comm_s"])})
    return rows
