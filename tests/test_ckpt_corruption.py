"""Every single-byte flip of a checkpoint is detected or provably harmless, never a crash.

A damaged newest checkpoint must make resume fall back to the previous valid one
with one warning; a flip that changes nothing the checkpoint restores (free space,
padding, B-tree slack) may pass, and then the restored state must be identical.
"""

from __future__ import annotations

import random
import shutil
from pathlib import Path

import pytest
import torch

from helpers import assert_tree_equal, write_v3_checkpoint
from hvdkit import BackendConfig, build_model
from hvdkit.backends import LocalBackend
from hvdkit.checkpoint import CheckpointManager, capture_rng, read_checkpoint
from hvdkit.h5tree import materialize
from hvdkit.position import LoopPosition

# flips a format: the one the manager writes gets the most; the read-only older ones fewer (each
# flip reads the file again, ~65 ms)
FLIPS = {5: 600, 4: 200, 3: 200}


def _two_checkpoints(directory, fmt):
    """ckpt-1 and ckpt-2 of a tiny model with Adam, a scheduler and loop state, in format 5
    (the manager's), 4 (files the previous release wrote: tests/data/ckpt-v4) or 3 (hvdkit
    0.4's), which must stay readable."""
    backend = LocalBackend(BackendConfig())
    if fmt == 4:  # written by _two_checkpoints(d, 4) when format 4 was the manager's
        for f in sorted((Path(__file__).parent / "data" / "ckpt-v4").glob("ckpt-*.h5")):
            shutil.copy(f, directory / f.name)
        return CheckpointManager(directory, backend, keep=5)
    torch.manual_seed(0)
    model = build_model("tiny")
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.9)
    mgr = CheckpointManager(directory, backend, keep=5)
    for step in (1, 2):
        model(torch.randn(4, 8)).sum().backward()
        opt.step()
        opt.zero_grad()
        sched.step()
        loop = LoopPosition(epoch=0, global_step=step, samples_seen=8 * step, samples_in_epoch=8 * step,
                        loss_sums=[0.5 * step])
        states = {"model": model, "optimizer": opt, "scheduler": sched, "loop": loop}
        if fmt == 5:
            mgr.save(step, states)
        else:
            write_v3_checkpoint(mgr.path_for(step), {k: v.state_dict() for k, v in states.items()}, step,
                                {"model": "module", "optimizer": "optimizer", "scheduler": "stateful",
                                 "loop": "stateful"}, [capture_rng()])
    return mgr


def _fresh_states():
    torch.manual_seed(1)
    model = build_model("tiny", seed=5)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.9)
    return {"model": model, "optimizer": opt, "scheduler": sched, "loop": LoopPosition()}


@pytest.mark.parametrize("fmt", [5, 4, 3])
def test_random_byte_flips_are_detected_or_harmless(tmp_path, caplog, fmt):
    mgr = _two_checkpoints(tmp_path, fmt)
    newest = tmp_path / "ckpt-000000002.h5"
    pristine_bytes = newest.read_bytes()
    pristine = read_checkpoint(newest)
    older = read_checkpoint(tmp_path / "ckpt-000000001.h5")
    rng = random.Random(20261203)
    outcomes = {"detected": 0, "harmless": 0, "named": 0}
    for flip in range(FLIPS[fmt]):
        data = bytearray(pristine_bytes)
        offset = rng.randrange(len(data))
        data[offset] ^= 1 << rng.randrange(8)
        newest.write_bytes(bytes(data))
        caplog.clear()
        found = mgr.find_latest_valid()  # must not raise, whatever the damage
        warning = "".join(r.getMessage() + "\n" for r in caplog.records if r.name == "hvdkit")
        assert found is not None, f"flip at byte {offset}: no checkpoint found at all"
        with found:
            path, snap = found.path, found.snapshot
            snap.states = materialize(snap.states)
        if path == newest:  # accepted: then it must restore exactly what was written
            assert warning == "", f"flip at byte {offset}: accepted but warned"
            got, want = snap, pristine
            outcomes["harmless"] += 1
        else:  # detected: one warning line, and the previous checkpoint, intact
            assert path.name == "ckpt-000000001.h5", f"flip at byte {offset}"
            assert warning.count("\n") == 1 and "WARNING: skipping ckpt-000000002.h5: " in warning, warning
            got, want = snap, older
            outcomes["detected"] += 1
            outcomes["named"] += "checksum mismatch in dataset /" in warning
        for name in ("model", "optimizer", "scheduler", "loop"):
            assert_tree_equal(got[name], want[name], f"flip {offset}: {name}")
        assert_tree_equal(got.rng, want.rng, f"flip {offset}: rng")
        assert got.meta == want.meta, f"flip at byte {offset}"
        if fmt == 5 and flip % 3 == 0:  # a restore reads the file once, each tensor checked as it is read
            caplog.clear()
            states = _fresh_states()
            restored = mgr.restore(states)
            again = "".join(r.getMessage() + "\n" for r in caplog.records
                            if r.name == "hvdkit" and "skipping" in r.getMessage())
            assert (restored.path, again) == (path, warning), f"flip at byte {offset}: {again!r}"
            assert_tree_equal(dict(states["model"].state_dict()), want["model"], f"flip {offset}: restored model")
            assert_tree_equal(states["optimizer"].state_dict()["state"], want["optimizer"]["state"],
                              f"flip {offset}: restored optimizer")
    print(f"{FLIPS[fmt]} flips over {len(pristine_bytes)} bytes: {outcomes}")
    assert outcomes["detected"] > FLIPS[fmt] // 2  # most bytes of a small checkpoint are content
    if fmt == 5:  # a flip in a tensor's bytes names the tensor
        assert outcomes["named"] > 0
