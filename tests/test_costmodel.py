"""The step-time model (hvdkit.bench.costmodel) and the script that fits and checks it
(benchmarks/scaling_model.py): each rule on numbers worked by hand, and a fit that must
recover the overheads it generated its points from."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest
import torch

from hvdkit.backends.powersgd import wire_elements
from hvdkit.bench.costmodel import Link, Message, Overheads, allreduce_time, messages, step_time

ROOT = Path(__file__).resolve().parents[1]
LINK = Link(alpha_s=1e-3, bandwidth=1e9)  # 2 workers: a message of S bytes takes 2 ms + S/1e9 s


def test_serial_step_is_compute_plus_every_collective():
    msgs = [Message(1e8, 1.0), Message(2e8, 1.0)]
    t = step_time(1.0, msgs, 2, LINK, Overheads(backward_share=0.0))
    assert t["step_s"] == pytest.approx(1.0 + 2 * 2e-3 + 0.3)
    assert t["comm_s"] == pytest.approx(2 * 2e-3 + 0.3)
    assert t["efficiency"] == pytest.approx(1.0 / t["step_s"])


def test_overlap_hides_what_backward_outlasts_but_never_the_last_bucket():
    early = step_time(1.0, [Message(1e8, 0.1)], 2, LINK, Overheads(backward_share=0.5))
    assert early["step_s"] == pytest.approx(1.0)              # ready at 0.55 s, done at 0.652 s
    last = step_time(1.0, [Message(1e8, 1.0)], 2, LINK, Overheads(backward_share=0.5))
    assert last["step_s"] == pytest.approx(1.0 + 0.102)         # starts when backward ends
    # the link sends one collective at a time: two buckets ready together queue
    queued = step_time(1.0, [Message(5e8, 0.5), Message(5e8, 0.5)], 2, LINK, Overheads(backward_share=0.5))
    assert queued["step_s"] == pytest.approx(0.75 + 2 * 0.502)


def test_overheads_add_to_the_step():
    base = step_time(1.0, [Message(1e8, 1.0)], 2, LINK, Overheads(backward_share=0.0))["step_s"]
    over = Overheads(backward_share=0.0, cpu_s_per_byte=1e-9, message_s=0.01, extra_s=0.05)
    assert step_time(1.0, [Message(1e8, 1.0)], 2, LINK, over)["step_s"] == pytest.approx(base + 0.1 + 0.01 + 0.05)
    assert step_time(1.0, [Message(1e8, 1.0)], 1, LINK, over)["step_s"] == pytest.approx(1.0 + 0.01 + 0.05)


def test_more_workers_cost_more_and_the_ring_tends_to_twice_the_bytes():
    big = [allreduce_time(n, 1e9, 0.0, 1e9) for n in (2, 8, 512)]
    assert big[0] == pytest.approx(1.0) and big[0] < big[1] < big[2] < 2.0
    assert allreduce_time(512, 0, 1e-5, 1e9) == pytest.approx(2 * 511 * 1e-5)


def test_messages_follow_backward_order():
    # parameters 0, 1, 2 registered in that order; backward makes 2 first (half the bytes)
    msgs = messages([1, 1, 2], [[2], [1, 0]], scale=0.5)
    assert [m.ready for m in msgs] == [0.5, 1.0]
    assert [m.nbytes for m in msgs] == [1.0, 1.0]


def test_powersgd_wire_elements():
    w = wire_elements([torch.Size([64, 32]), torch.Size([64]), torch.Size([3, 3])], rank=2)
    # the 64x32 matrix goes as P (64x2) and Q (32x2); the vector and the 3x3 (too small to
    # shrink 2x) go as they are
    assert w == {"plain": 64 + 9, "p": 128, "q": 64, "products": 64 * 32 * 2}


@pytest.mark.timeout(300)  # measured 5 s on 2 cores
def test_fit_recovers_the_overheads_it_was_generated_with():
    """Points made by the model itself from known overheads, on two links: the fit must give
    them back (its predictions within 1%), and a fit without one link must still predict it."""
    sys.path[:0] = [str(ROOT / "benchmarks")]
    try:
        import scaling_model as sm
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    params = sm.layouts(["cnn", "mlp"])
    truth = [0.55, 1.2, 1.6, 0.9, 1.5, 0.4, 0.1, 3.0, 2.0]  # in the units of sm.PARAMS
    links = {"slow": Link(0.0, 1.2e8), "fast": Link(0.0, 9e8)}
    points = []
    for label, link in links.items():
        for model, ps in params.items():
            for variant in sm.VARIANTS:
                k = sm.knobs(variant)
                msgs, products = sm.collectives(ps, k)
                p = {"link_label": label, "model": model, "variant": variant, "knobs": k, "link": link,
                     "compute_s": 0.004 if model == "mlp" else 0.02, "messages": msgs, "products": products,
                     "cast": sum(q.numel() for q in ps[0]) if k["compression"] == "fp16" else 0}
                p["measured_s"] = sm.predict(p, truth)
                points.append(p)
    fitted = sm.check(points)
    assert set(fitted["held_out_theta"]) == {"slow", "fast"}
    errors = [abs(p["predicted_s"] / p["measured_s"] - 1) for p in points]
    held = [abs(p["held_out_s"] / p["measured_s"] - 1) for p in points]
    assert max(errors) < 0.03 and sorted(errors)[len(errors) // 2] < 0.005
    assert max(held) < 0.10
    assert math.isclose(fitted["theta"]["backward_share"], truth[0], abs_tol=0.05)
