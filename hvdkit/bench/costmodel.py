"""An alpha-beta cost model of ring allreduce, fitted to measurements, used to *predict* scaling.

Ring allreduce of S bytes over N workers: t(N, S) = 2(N-1)·alpha + 2(N-1)/N · S / B
(alpha: per-message latency, B: link bandwidth). With tensor fusion the S bytes of
gradients go in ceil(S / threshold) messages; without it, one message per tensor.
"""

from __future__ import annotations

import math
from typing import Any

__all__ = ["fit_alpha_beta", "allreduce_time", "predict_scaling"]


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


def predict_scaling(compute_s: float, grad_bytes: int, tensors: int, alpha: float, bandwidth: float,
                    workers: list[int], fusion_bytes: int = 128 << 20) -> list[dict[str, Any]]:
    """Step time and efficiency at each worker count, fused and unfused, no overlap assumed
    (an upper bound on step time; perfect overlap would give max(compute, comm))."""
    rows = []
    for n in workers:
        fused = allreduce_time(n, grad_bytes, alpha, bandwidth, max(1, math.ceil(grad_bytes / fusion_bytes)))
        unfused = allreduce_time(n, grad_bytes, alpha, bandwidth, tensors)
        rows.append({"workers": n, "comm_fused_s": fused, "comm_unfused_s": unfused,
                     "step_fused_s": compute_s + fused, "step_unfused_s": compute_s + unfused,
                     "efficiency_fused": compute_s / (compute_s + fused),
                     "efficiency_unfused": compute_s / (compute_s + unfused),
                     "efficiency_overlap_bound": compute_s / max(compute_s, fused)})
    return rows
