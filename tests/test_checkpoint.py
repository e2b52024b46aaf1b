"""HDF5 checkpoint format: exact round trip, readable by plain h5py/h5dump, corruption detected."""

from __future__ import annotations

import logging
import random
import shutil
import subprocess
from pathlib import Path

import h5py
import numpy as np
import pytest
import torch
from click.testing import CliRunner

from helpers import PY, assert_tree_equal, check, flip_tensor_bit, launch, trained_state
from hvdkit import BackendConfig, build_model
from hvdkit.backends import LocalBackend
from hvdkit.checkpoint import (
    CheckpointManager,
    Snapshot,
    capture_rng,
    read_checkpoint,
    restore_rng,
    verify_checkpoint,
    write_checkpoint,
)
from hvdkit.cli import cli
from hvdkit.errors import CheckpointError
from hvdkit.position import LoopPosition


def test_round_trip_is_exact(tmp_path):
    model, opt, sched = trained_state()
    tensors = {
        **model.state_dict(),
        "extra.bf16": torch.randn(5, 3).to(torch.bfloat16),
        "extra.fp16": torch.randn(7).half(),
        "extra.int": torch.arange(6, dtype=torch.int64).reshape(2, 3),
        "extra.bool": torch.tensor([True, False]),
        "extra.scalar": torch.tensor(3.5),
        "weird/name with spaces": torch.ones(2),
    }
    loop = LoopPosition(epoch=2, global_step=17, samples_seen=544, samples_in_epoch=32, loss_sums=[1.5, 2.25],
                    history=[{"epoch": 0, "loss": 0.5}]).state_dict()
    snap = Snapshot(states={"model": tensors, "optimizer": opt.state_dict(), "scheduler": sched.state_dict(),
                            "loop": loop, "seed": 17, "note": ("a", 1)},
                    rng=[capture_rng(), capture_rng()], meta={"step": 17, "world_size": 2, "backend": "ddp"})
    path = write_checkpoint(tmp_path / "ckpt-000000017.h5", snap)
    back = read_checkpoint(path)
    assert list(back.states) == list(snap.states)
    for key in snap.states:  # tensors, 'step', betas tuple, param groups, plain values
        assert_tree_equal(snap[key], back[key], key)
    assert back.step == 17 and back.meta["world_size"] == 2 and back.meta["backend"] == "ddp"
    assert back.meta["torch_version"] == torch.__version__
    # the optimizer state really loads into a fresh optimizer
    model2 = build_model("mlp")
    opt2 = torch.optim.Adam(model2.parameters(), lr=1e-3)
    opt2.load_state_dict(back["optimizer"])
    # RNG restore reproduces the same draws
    restore_rng(back.rng[0])
    a = (torch.rand(3), np.random.rand(), random.random())
    restore_rng(snap.rng[0])
    b = (torch.rand(3), np.random.rand(), random.random())
    assert torch.equal(a[0], b[0]) and a[1:] == b[1:]


def test_plain_h5py_and_h5dump_can_read_it(tmp_path):
    model, opt, _ = trained_state()
    path = write_checkpoint(tmp_path / "c.h5", Snapshot(states={"model": model.state_dict(),
                                                                "optimizer": opt.state_dict()}, meta={"step": 3}))
    with h5py.File(path, "r") as f:
        assert f.attrs["format"] == "hvdkit-checkpoint" and f.attrs["step"] == 3
        w = f["model/inp.weight"][()]
        assert np.array_equal(w, model.state_dict()["inp.weight"].numpy())
        assert "exp_avg" in f["optimizer/state/0"]
    if shutil.which("h5dump"):
        out = subprocess.run(["h5dump", "-H", str(path)], capture_output=True, text=True, check=True).stdout
        assert 'DATASET "inp.weight"' in out and "H5T_IEEE_F32LE" in out


def test_bit_flip_and_truncation_are_detected(tmp_path):
    model, _, _ = trained_state()
    good = write_checkpoint(tmp_path / "good.h5", Snapshot(states={"model": model.state_dict()}))
    assert verify_checkpoint(good) == (True, "checksum OK")

    flipped = tmp_path / "flipped.h5"
    shutil.copy(good, flipped)
    with h5py.File(flipped, "r") as f:
        offset = f["model/blocks.3.fc.weight"].id.get_offset() + 101
    with open(flipped, "r+b") as fh:
        fh.seek(offset)
        byte = fh.read(1)
        fh.seek(offset)
        fh.write(bytes([byte[0] ^ 0x10]))
    ok, message = verify_checkpoint(flipped)  # a tensor's byte: its range's CRC names it
    assert not ok and "checksum mismatch in dataset /model/blocks.3.fc.weight" in message

    meta = tmp_path / "meta.h5"  # a byte of HDF5's superblock: covered by the digest of the rest
    shutil.copy(good, meta)
    with h5py.File(meta, "r") as f:
        at = f.userblock_size + 10
    with open(meta, "r+b") as fh:
        fh.seek(at)
        byte = fh.read(1)
        fh.seek(at)
        fh.write(bytes([byte[0] ^ 0x01]))
    ok, message = verify_checkpoint(meta)
    assert not ok and "SHA-256 of its metadata does not match" in message
    with pytest.raises(CheckpointError, match="is corrupt"):
        read_checkpoint(flipped)

    truncated = tmp_path / "truncated.h5"
    truncated.write_bytes(good.read_bytes()[: good.stat().st_size // 2])
    ok, message = verify_checkpoint(truncated)
    assert not ok and "is truncated or padded" in message and "\n" not in message


def test_loop_state_edit_is_detected_and_ckpt_verify_says_so(tmp_path):
    """The reported silent corruption: global_step 4 -> 5 in the loop state, file otherwise valid."""
    model, opt, _ = trained_state()
    path = write_checkpoint(tmp_path / "ckpt-000000004.h5", Snapshot(
        states={"model": model.state_dict(), "optimizer": opt.state_dict(),
                "loop": LoopPosition(global_step=4).state_dict()}, meta={"step": 4}))
    other = write_checkpoint(tmp_path / "ckpt-000000003.h5", Snapshot(states={"model": model.state_dict()}))
    with h5py.File(path, "r+") as f:  # a well-formed edit: HDF5 itself sees nothing wrong
        assert '"global_step", 4' in f.attrs["json:loop"]
        f.attrs["json:loop"] = f.attrs["json:loop"].replace('"global_step", 4', '"global_step", 5')
        f.attrs["step"] = 5
    assert not verify_checkpoint(path)[0]
    result = CliRunner().invoke(cli, ["ckpt", "verify", str(tmp_path)])
    assert result.exit_code == 1
    ok_line, failed_line = [ln for ln in result.output.splitlines() if ln.startswith(("OK", "FAILED"))]
    assert "Error: 1 of 2 checkpoint(s) failed verification" in result.output
    assert ok_line == f"OK      {other}"
    assert failed_line.startswith(f"FAILED  checkpoint {path} is ")  # h5py rewrote it: size changed
    assert failed_line.endswith("HINT: delete it or let resume fall back to the previous checkpoint")
    result = CliRunner().invoke(cli, ["ckpt", "verify", str(other)])
    assert result.exit_code == 0 and result.output == f"OK      {other}\n"


def test_content_checksum_covers_attributes_even_without_the_digest(tmp_path):
    """Second layer: the in-file checksum also changes with any attribute (the root's too)."""
    from hvdkit.checkpoint.integrity import content_checksum

    model, _, _ = trained_state()
    path = write_checkpoint(tmp_path / "c.h5", Snapshot(states={"model": model.state_dict(),
                                                               "loop": LoopPosition(global_step=4).state_dict()},
                                                       meta={"step": 4}))
    with h5py.File(path, "r+") as f:
        before = content_checksum(f, data_bytes=False)  # format 4: each dataset by its CRC attribute
        assert before == int(f.attrs["checksum"])
        for edit in (lambda: f.attrs.__setitem__("step", 1),
                     lambda: f.attrs.__setitem__("json:loop", f.attrs["json:loop"].replace("4", "5")),
                     lambda: f["model"].attrs.__setitem__("order", "[]")):
            edit()
            assert content_checksum(f, data_bytes=False) != before


def test_manager_keeps_last_n_and_falls_back_past_corrupt(tmp_path, caplog):
    backend = LocalBackend(BackendConfig())
    mgr = CheckpointManager(tmp_path, backend, keep=2)
    stale = tmp_path / ".ckpt-000000009.h5.tmp4242"  # left by a writer killed mid-write
    stale.write_bytes(b"half")
    model = build_model("tiny")
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in (1, 2, 3):
        with torch.no_grad():
            next(model.parameters()).fill_(step)
        mgr.save(step, {"model": model, "optimizer": opt, "step": step})
    assert not stale.exists()
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == ["ckpt-000000002.h5", "ckpt-000000003.h5", "latest"]
    assert (tmp_path / "latest").read_text().strip() == "ckpt-000000003.h5"

    # corrupt the newest: resume warns and uses step 2
    newest = tmp_path / "ckpt-000000003.h5"
    newest.write_bytes(newest.read_bytes()[:1000])
    fresh = build_model("tiny", seed=9)
    states = {"model": fresh, "optimizer": torch.optim.SGD(fresh.parameters(), lr=0.1), "step": 0}
    restored = mgr.restore(states)
    assert restored.step == 2 and states["step"] == 2  # a plain value comes back in the dict
    assert torch.all(next(fresh.parameters()) == 2)
    warnings = [r.getMessage() for r in caplog.records if r.name == "hvdkit"]
    assert any(w.startswith("WARNING: skipping ckpt-000000003.h5: checkpoint") for w in warnings), warnings


class Counter:
    """A Stateful object of the user's own (not a module, optimizer or scheduler)."""

    def __init__(self) -> None:
        self.seen, self.names = 0, ["a"]

    def state_dict(self):
        return {"seen": self.seen, "names": list(self.names), "buffer": torch.arange(3) * self.seen}

    def load_state_dict(self, state):
        self.seen, self.names = state["seen"], list(state["names"])
        assert torch.equal(state["buffer"], torch.arange(3) * self.seen)


def test_any_stateful_objects_and_plain_values_round_trip(tmp_path):
    """Fabric-style states: objects with state_dict are saved through it, values as they are;
    restore loads in place and returns what the dict did not name."""
    from hvdkit.data import ShardSampler

    backend = LocalBackend(BackendConfig())
    mgr = CheckpointManager(tmp_path, backend)
    counter, sampler = Counter(), ShardSampler(100, 1, 0, seed=3)
    counter.seen, counter.names = 7, ["x", "y"]
    sampler.set_epoch(2, start=40)
    mgr.save(5, {"counter": counter, "sampler": sampler, "config": {"lr": 0.1, "sizes": (1, 2)}, "extra": 9})
    counter2, sampler2 = Counter(), ShardSampler(100, 1, 0)
    states = {"counter": counter2, "sampler": sampler2, "config": None}
    restored = mgr.restore(states)
    assert (counter2.seen, counter2.names) == (7, ["x", "y"])
    assert sampler2.state_dict() == {"epoch": 2, "start": 40, "seed": 3}
    assert list(sampler2) == list(sampler)  # the same samples from the same position
    assert states["config"] == {"lr": 0.1, "sizes": (1, 2)}
    assert restored.remainder == {"extra": 9} and restored.step == 5
    with pytest.raises(CheckpointError, match="the checkpoint has no state 'missing'"):
        mgr.restore({"missing": Counter()})


def test_keep_best_is_never_rotated_away(tmp_path):
    backend = LocalBackend(BackendConfig())
    mgr = CheckpointManager(tmp_path, backend, keep=2, keep_best="val_accuracy")  # accuracy: max
    model = build_model("tiny")
    for step, acc in ((1, 0.5), (2, 0.9), (3, 0.7), (4, 0.8), (5, float("nan"))):
        mgr.save(step, {"model": model}, metrics={"val_accuracy": acc})
    names = sorted(p.name for p in tmp_path.glob("ckpt-*.h5"))
    assert names == ["ckpt-000000002.h5", "ckpt-000000004.h5", "ckpt-000000005.h5"]
    assert mgr.best() == {"file": "ckpt-000000002.h5", "step": 2, "metric": "val_accuracy", "mode": "max",
                          "value": 0.9}
    assert read_checkpoint(tmp_path / "ckpt-000000002.h5").metrics == {"val_accuracy": 0.9}
    loss_mgr = CheckpointManager(tmp_path / "l", backend, keep=1, keep_best="val_loss")  # loss: min
    for step, loss in ((1, 2.0), (2, 1.0), (3, 1.5)):
        loss_mgr.save(step, {"model": model}, metrics={"val_loss": loss})
    assert loss_mgr.best()["file"] == "ckpt-000000002.h5"
    assert sorted(p.name for p in (tmp_path / "l").glob("ckpt-*.h5")) == ["ckpt-000000002.h5",
                                                                          "ckpt-000000003.h5"]


def test_a_format_2_checkpoint_of_hvdkit_0_2_still_resumes(tmp_path):
    """Files of the previous layout (groups model/optimizer/scheduler/loop) read as states."""
    import io

    from helpers import seal_in_memory
    from hvdkit.checkpoint.integrity import USERBLOCK, content_checksum
    from hvdkit.h5tree import write_tree

    model, opt, sched = trained_state()
    buffer = io.BytesIO()
    with h5py.File(buffer, "w", track_order=True, userblock_size=USERBLOCK) as f:
        f.attrs.update({"format": "hvdkit-checkpoint", "format_version": 2, "epoch": 1, "global_step": 6,
                        "samples_seen": 96, "samples_in_epoch": 0, "world_size": 1, "backend": "local"})
        write_tree(f, "model", model.state_dict())
        write_tree(f, "optimizer", opt.state_dict())
        write_tree(f, "scheduler", sched.state_dict())
        write_tree(f, "loop", {"epoch": 1, "global_step": 6, "samples_seen": 96, "samples_in_epoch": 0,
                               "extra": {"loss_sums": [0.25], "loss_committed": 1.5, "steps_in_epoch": 0,
                                         "epoch_losses": [0.75]}})
        f.attrs["checksum"] = content_checksum(f)
    (tmp_path / "ckpt-000000006.h5").write_bytes(seal_in_memory(bytearray(buffer.getvalue())))
    fresh = build_model("mlp", seed=5)
    optimizer = torch.optim.Adam(fresh.parameters(), lr=1e-3)
    loop = LoopPosition()
    restored = CheckpointManager(tmp_path, LocalBackend(BackendConfig())).restore(
        {"model": fresh, "optimizer": optimizer, "scheduler": torch.optim.lr_scheduler.StepLR(optimizer, 2),
         "loop": loop})
    assert restored.step == 6
    assert (loop.epoch, loop.global_step, loop.loss_sums, loop.epoch_losses) == (1, 6, [0.25], [0.75])
    assert_tree_equal(fresh.state_dict(), model.state_dict())


def test_a_restore_reads_the_file_once_and_a_damaged_tensor_falls_back_or_fails(tmp_path, caplog):
    """The restore verifies a format 5 file's metadata first and each tensor as it is read
    (one pass), straight into the tensors held: a damaged tensor then makes it load the
    previous checkpoint; with none left it fails, since the states already hold part of it."""
    backend = LocalBackend(BackendConfig())
    mgr = CheckpointManager(tmp_path, backend, keep=3)
    model = build_model("tiny")
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    saved = {}
    for step in (1, 2):
        model(torch.randn(4, 8)).sum().backward()
        opt.step()
        saved[step] = {k: v.clone() for k, v in model.state_dict().items()}
        mgr.save(step, {"model": model, "optimizer": opt})

    fresh = build_model("tiny", seed=9)
    fresh_opt = torch.optim.Adam(fresh.parameters(), lr=1e-2)
    held = next(fresh.parameters())
    assert mgr.restore({"model": fresh, "optimizer": fresh_opt}).step == 2
    assert next(fresh.parameters()) is held  # read into the parameter itself, not swapped
    assert_tree_equal(dict(fresh.state_dict()), saved[2])
    assert_tree_equal(fresh_opt.state_dict(), opt.state_dict())

    flip_tensor_bit(tmp_path / "ckpt-000000002.h5")
    caplog.clear()
    fresh = build_model("tiny", seed=9)
    assert mgr.restore({"model": fresh, "optimizer": torch.optim.Adam(fresh.parameters(), lr=1e-2)}).step == 1
    assert_tree_equal(dict(fresh.state_dict()), saved[1])
    warnings = [r.getMessage() for r in caplog.records if r.name == "hvdkit" and r.levelno >= logging.WARNING]
    assert warnings == [f"WARNING: skipping ckpt-000000002.h5: checkpoint {tmp_path / 'ckpt-000000002.h5'} is "
                        "corrupt: checksum mismatch in dataset /model/0.weight; trying the previous "
                        "checkpoint"], warnings

    with pytest.raises(CheckpointError, match="checksum mismatch in dataset /model/0.weight"):
        mgr.restore({"model": fresh}, path=tmp_path / "ckpt-000000002.h5")  # named: no fall back
    flip_tensor_bit(tmp_path / "ckpt-000000001.h5")
    with pytest.raises(CheckpointError, match=r"no checkpoint in .* verifies, and the states already hold part "
                       r"of ckpt-000000001.h5, whose tensors were damaged") as info:
        mgr.restore({"model": build_model("tiny")})
    assert "HINT: move the damaged checkpoints out of" in str(info.value)


LATE_DAMAGE = """
import logging
import sys
from pathlib import Path

import torch

import hvdkit
from hvdkit.checkpoint import read_checkpoint
from hvdkit.h5tree import materialize, tree_leaves

shard, directory, dataset = sys.argv[1], Path(sys.argv[2]), sys.argv[3]
sys.path.insert(0, sys.argv[4])  # the tests' helpers
from helpers import flip_tensor_bit
logging.basicConfig(level=logging.WARNING, format="%(message)s")  # hvdkit's warnings, as an application shows them
backend = hvdkit.create_backend(hvdkit.BackendConfig(name="ddp", shard=shard))


def states():
    torch.manual_seed(0)
    model = hvdkit.build_model("tiny")
    model, opt = backend.wrap(model, torch.optim.Adam(model.parameters(), lr=1e-2))
    backend.broadcast_state(model, opt)
    return {"model": model, "optimizer": opt}


mgr = hvdkit.CheckpointManager(directory, backend, keep=3)
held = states()
for step in (1, 2):
    with backend.accumulate(held["model"], sync=True):
        held["model"](torch.randn(4, 8, generator=torch.Generator().manual_seed(backend.rank))).sum().backward()
    backend.optimizer_step(held["optimizer"])
    held["optimizer"].zero_grad()
    mgr.save(step, held)
if backend.rank == 0:  # one bit of a tensor that a sharded strategy reads while it sends it on
    flip_tensor_bit(directory / "ckpt-000000002.h5", dataset)
backend.barrier()
fresh = states()
restored = mgr.restore(fresh)
print(f"rank {backend.rank} restored step {restored.step}", flush=True)
mgr.save(9, fresh)  # what every rank now holds, gathered: step 1's state exactly
if backend.rank == 0:
    again, first = (read_checkpoint(directory / f"ckpt-00000000{n}.h5") for n in (9, 1))
    for key in ("model", "optimizer"):
        a, b = list(tree_leaves(materialize(again[key]))), list(tree_leaves(materialize(first[key])))
        assert len(a) == len(b) > 0 and all(torch.equal(x, y) for x, y in zip(a, b)), key
    print("same as step 1", flush=True)
backend.shutdown()
"""


@pytest.mark.mp
@pytest.mark.timeout(300)  # measured 9-12 s each (2 cores)
@pytest.mark.parametrize("shard,dataset", [("optimizer", "optimizer/state/0/exp_avg"), ("full", "model/0.weight")])
def test_a_tensor_found_damaged_while_a_sharded_strategy_sends_it_makes_every_rank_load_the_previous(
        tmp_path, shard, dataset):
    """ZeRO and FSDP read rank 0's tensors inside the collective that sends them on: a damaged
    one is found there, every rank goes on to the end of it, then all load the previous file."""
    script = tmp_path / "late.py"
    script.write_text(LATE_DAMAGE)
    out = check(launch("mpirun", 2, [PY, str(script), shard, str(tmp_path / "ck"), dataset,
                                     str(Path(__file__).parent)], timeout=240))
    assert "rank 0 restored step 1" in out and "rank 1 restored step 1" in out, out
    assert out.count("WARNING: skipping ckpt-000000002.h5: checkpoint") == 1, out
    assert f"checksum mismatch in dataset /{dataset}" in out and "same as step 1" in out, out


def test_a_header_resealed_over_a_damaged_tensor_is_still_caught_by_the_datasets_own_crc(tmp_path):
    """The two layers must agree: a tool that rewrote the sealed table to match damaged bytes
    is caught by the dataset's CRC attribute, by `ckpt verify` (one pass, no second read of
    the tensor) and by a restore (checked as it reads)."""
    import zlib

    from hvdkit.checkpoint.integrity import seal_ranges, verify_sealed

    backend = LocalBackend(BackendConfig())
    mgr = CheckpointManager(tmp_path, backend)
    model = build_model("tiny")
    path = mgr.save(1, {"model": model})
    table = verify_sealed(path)
    flip_tensor_bit(path)
    with h5py.File(path, "r") as f:
        damaged = f["model/0.weight"].id.get_offset()
    data = path.read_bytes()
    seal_ranges(path, [(offset, length, zlib.crc32(data[offset:offset + length]) if offset == damaged else crc)
                       for offset, (length, crc) in table.items()])
    assert verify_sealed(path)[damaged][1] != table[damaged][1]  # the header now matches the damage
    ok, message = verify_checkpoint(path)
    assert not ok and "checksum mismatch in dataset /model/0.weight" in message, message
    with pytest.raises(CheckpointError, match="checksum mismatch in dataset /model/0.weight"):
        mgr.restore({"model": build_model("tiny", seed=3)}, path=path)


@pytest.mark.parametrize("fmt", ["safetensors", "torch"])
def test_export_checks_each_tensor_it_writes_and_writes_nothing_from_a_damaged_one(tmp_path, fmt):
    mgr = CheckpointManager(tmp_path, LocalBackend(BackendConfig()))
    path = mgr.save(1, {"model": build_model("tiny")})
    out = tmp_path / "weights.out"
    assert CliRunner().invoke(cli, ["ckpt", "export", str(path), str(out), "--format", fmt]).exit_code == 0
    out.unlink()
    flip_tensor_bit(path, "model/2.weight")  # found after 0.weight and 0.bias were written
    result = CliRunner().invoke(cli, ["ckpt", "export", str(path), str(out), "--format", fmt])
    assert result.exit_code == 1 and "checksum mismatch in dataset /model/2.weight" in result.output, result.output
    assert len(result.output.strip().splitlines()) == 1 and not out.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt-000000001.h5", "latest"]  # no temp file left


def test_a_checkpoint_replaced_between_its_check_and_its_open_is_refused(tmp_path, monkeypatch):
    """HDF5 opens the file by name after its metadata verified: that must be the same file."""
    model, _, _ = trained_state()
    good = write_checkpoint(tmp_path / "ckpt-000000001.h5", Snapshot(states={"model": model.state_dict()}))
    other = write_checkpoint(tmp_path / "other.h5", Snapshot(states={"model": model.state_dict()}))
    real_open = h5py.File

    def swap_then_open(name, *args, **kwargs):
        other.replace(good)  # a writer's rename lands between the check and the open
        return real_open(name, *args, **kwargs)

    monkeypatch.setattr(h5py, "File", swap_then_open)
    from hvdkit.checkpoint import open_checkpoint

    with pytest.raises(CheckpointError, match="was replaced while it was opened") as info:
        open_checkpoint(good, as_read=True)
    assert "HINT: resume again" in str(info.value)


def test_the_crc_is_isal_s_and_the_same_as_zlib_s():
    """ISA-L's CRC-32 is a dependency (the fast path is the default) and gives zlib's values."""
    import zlib

    import isal.isal_zlib

    from hvdkit import h5tree

    assert h5tree.crc32 is isal.isal_zlib.crc32
    data = np.random.default_rng(0).bytes(3 << 20)
    assert h5tree.crc32(data, 7) == zlib.crc32(data, 7)
    assert h5tree.crc32_of(np.frombuffer(data, np.float32)) == zlib.crc32(data)


def test_restore_with_no_checkpoint_is_fresh_start(tmp_path):
    mgr = CheckpointManager(tmp_path / "none", LocalBackend(BackendConfig()))
    model = build_model("tiny")
    assert mgr.restore({"model": model, "optimizer": torch.optim.SGD(model.parameters(), lr=0.1)}) is None


def test_failed_write_is_one_error_not_a_half_file(tmp_path):
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("x")
    mgr = CheckpointManager(blocker, LocalBackend(BackendConfig()))
    model = build_model("tiny")
    with pytest.raises(CheckpointError, match="rank 0 could not handle the checkpoint: checkpoint "
                       "directory .* is not a directory") as info:
        mgr.save(1, {"model": model})
    assert "HINT: pass a directory path to --checkpoint-dir" in str(info.value)
    assert blocker.read_text() == "x"


def test_ckpt_show_cli(tmp_path):
    model, opt, _ = trained_state()
    path = write_checkpoint(tmp_path / "ckpt-000000005.h5", Snapshot(
        states={"model": model.state_dict(), "optimizer": opt.state_dict(),
                "loop": LoopPosition(epoch=1, global_step=5).state_dict()},
        meta={"step": 5, "world_size": 2, "backend": "horovod", "states": {"model": "module",
                                                                           "optimizer": "optimizer",
                                                                           "loop": "stateful"}}))
    (tmp_path / "latest").write_text(path.name)
    result = CliRunner().invoke(cli, ["ckpt", "show", str(tmp_path)])
    assert result.exit_code == 0, result.output
    assert "step         5" in result.output and "epoch        1" in result.output
    assert "backend      horovod" in result.output
    assert "inp.weight" in result.output and "checksum     OK" in result.output
    with h5py.File(path, "r+") as f:
        f["model/inp.bias"][0] += 1.0  # silent change of one value
    result = CliRunner().invoke(cli, ["ckpt", "show", str(path)])
    assert result.exit_code == 1 and "is corrupt: checksum mismatch in dataset /model/inp.bias" in result.output
    assert len(result.output.strip().splitlines()) == 1


@pytest.fixture
def tiny_fs(tmp_path):
    """A real 512 KiB tmpfs (root only), unmounted afterwards."""
    mnt = tmp_path / "small"
    mnt.mkdir()
    made = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=512k", "tmpfs", str(mnt)],
                          capture_output=True, text=True, timeout=30)
    if made.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({made.stderr.strip()}); needs root")
    yield mnt
    subprocess.run(["umount", str(mnt)], check=True, timeout=30)


@pytest.mark.parametrize("precheck", [True, False], ids=["free-space-check", "write-hits-ENOSPC"])
def test_full_disk_is_reported_as_full_and_keeps_the_previous_checkpoint(tiny_fs, monkeypatch, precheck):
    import hvdkit.fileio as fileio

    if not precheck:  # skip the up-front check so that os.write itself gets ENOSPC
        monkeypatch.setattr(fileio, "SPACE_MARGIN", -(1 << 40))
    mgr = CheckpointManager(tiny_fs, LocalBackend(BackendConfig()))
    model = build_model("tiny")
    mgr.save(1, {"model": model})
    first = (tiny_fs / "ckpt-000000001.h5").read_bytes()
    free = shutil.disk_usage(tiny_fs).free
    (tiny_fs / "filler").write_bytes(b"\0" * (free - 8192))  # leave 8 KiB: less than a checkpoint
    with pytest.raises(CheckpointError) as info:
        mgr.save(2, {"model": model})
    message = str(info.value)
    assert "disk full: checkpoint ckpt-000000002.h5 needs" in message and " free in " in message
    assert "HINT: free space or point --checkpoint-dir elsewhere" in message and "\n" not in message
    assert sorted(p.name for p in tiny_fs.iterdir()) == ["ckpt-000000001.h5", "filler", "latest"]
    assert (tiny_fs / "ckpt-000000001.h5").read_bytes() == first
    assert verify_checkpoint(tiny_fs / "ckpt-000000001.h5")[0]


def test_running_loss_rules_for_a_restore_a_sync_and_a_roll_back():
    """The rules RunningLoss keeps in one place, on one process: a restore takes this rank's
    saved sum (their mean at another world size), a sync where a rank lacks the newest commit
    folds the holders' mean, a roll-back returns to this rank's commit."""
    from hvdkit.position import LoopPosition, RunningLoss

    p = LoopPosition(loss_sums=[1.0, 3.0], steps_in_epoch=4)
    loss = RunningLoss(p, torch.device("cpu"))
    loss.restored(rank=1, size=2)
    assert float(loss.local) == 3.0
    loss.restored(rank=0, size=3)
    assert float(loss.local) == 2.0
    loss.synced([(5, 1.5), (5, 2.5)], rank=1)  # everyone at the newest commit: its own
    assert float(loss.local) == 2.5 and p.loss_committed == 0.0
    loss.synced([(5, 1.5), (-1, 0.0), (5, 2.5)], rank=1)  # a newcomer: the holders' mean folded
    assert float(loss.local) == 0.0 and p.loss_committed == 2.0
    loss.add(torch.tensor(0.5, dtype=torch.float64))
    loss.before_commit()
    loss.add(torch.tensor(7.0, dtype=torch.float64))
    loss.rolled_back()
    assert float(loss.local) == 0.5 and p.loss_pending == 0.5
    loss.end_epoch()
    assert float(loss.local) == 0.0 and p.loss_committed == 0.0
