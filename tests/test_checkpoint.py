"""HDF5 checkpoint format: exact round trip, readable by plain h5py/h5dump, corruption detected."""

from __future__ import annotations

import random
import shutil
import subprocess

import h5py
import numpy as np
import pytest
import torch
from click.testing import CliRunner

from hvdkit import LocalBackend, BackendConfig, build_model
from hvdkit.checkpoint import (
    CheckpointManager,
    Snapshot,
    TrainingState,
    capture_rng,
    read_checkpoint,
    restore_rng,
    verify_checkpoint,
    write_checkpoint,
)
from hvdkit.cli import cli
from hvdkit.errors import CheckpointError
from helpers import assert_tree_equal, trained_state


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
    snap = Snapshot(model=tensors, optimizer=opt.state_dict(), scheduler=sched.state_dict(),
                    state=TrainingState(epoch=2, global_step=17, samples_seen=544, samples_in_epoch=32,
                                        extra={"loss_sums": [1.5, 2.25], "epoch_losses": [0.5]}),
                    rng=[capture_rng(), capture_rng()], meta={"world_size": 2, "backend": "ddp"})
    path = write_checkpoint(tmp_path / "ckpt-000000017.h5", snap)
    back = read_checkpoint(path)
    assert_tree_equal(snap.model, back.model)
    assert_tree_equal(snap.optimizer, back.optimizer)  # tensors, 'step', betas tuple, param groups
    assert_tree_equal(snap.scheduler, back.scheduler)
    assert back.state == snap.state
    assert back.meta["world_size"] == 2 and back.meta["backend"] == "ddp"
    assert back.meta["torch_version"] == torch.__version__
    # the optimizer state really loads into a fresh optimizer
    model2 = build_model("mlp")
    opt2 = torch.optim.Adam(model2.parameters(), lr=1e-3)
    opt2.load_state_dict(back.optimizer)
    # RNG restore reproduces the same draws
    restore_rng(back.rng[0])
    a = (torch.rand(3), np.random.rand(), random.random())
    restore_rng(snap.rng[0])
    b = (torch.rand(3), np.random.rand(), random.random())
    assert torch.equal(a[0], b[0]) and a[1:] == b[1:]


def test_plain_h5py_and_h5dump_can_read_it(tmp_path):
    model, opt, _ = trained_state()
    path = write_checkpoint(tmp_path / "c.h5", Snapshot(model=model.state_dict(), optimizer=opt.state_dict(),
                                                        state=TrainingState(global_step=3)))
    with h5py.File(path, "r") as f:
        assert f.attrs["format"] == "hvdkit-checkpoint" and f.attrs["global_step"] == 3
        w = f["model/inp.weight"][()]
        assert np.array_equal(w, model.state_dict()["inp.weight"].numpy())
        assert "exp_avg" in f["optimizer/state/0"]
    if shutil.which("h5dump"):
        out = subprocess.run(["h5dump", "-H", str(path)], capture_output=True, text=True, check=True).stdout
        assert 'DATASET "inp.weight"' in out and "H5T_IEEE_F32LE" in out


def test_bit_flip_and_truncation_are_detected(tmp_path):
    model, _, _ = trained_state()
    good = write_checkpoint(tmp_path / "good.h5", Snapshot(model=model.state_dict()))
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
    ok, message = verify_checkpoint(flipped)
    assert not ok and "SHA-256 of its content does not match" in message
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
        model=model.state_dict(), optimizer=opt.state_dict(), state=TrainingState(global_step=4)))
    other = write_checkpoint(tmp_path / "ckpt-000000003.h5", Snapshot(model=model.state_dict()))
    with h5py.File(path, "r+") as f:  # a well-formed edit: HDF5 itself sees nothing wrong
        f.attrs["json:loop"] = f.attrs["json:loop"].replace('"global_step": 4', '"global_step": 5')
        f.attrs["global_step"] = 5
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
    from hvdkit.checkpoint import _content_checksum

    model, _, _ = trained_state()
    path = write_checkpoint(tmp_path / "c.h5", Snapshot(model=model.state_dict(),
                                                       state=TrainingState(global_step=4)))
    with h5py.File(path, "r+") as f:
        before = _content_checksum(f)
        assert before == int(f.attrs["checksum"])
        for edit in (lambda: f.attrs.__setitem__("epoch", 1),
                     lambda: f.attrs.__setitem__("json:loop", f.attrs["json:loop"].replace("4", "5")),
                     lambda: f["model"].attrs.__setitem__("order", "[]")):
            edit()
            assert _content_checksum(f) != before


def test_manager_keeps_last_n_and_falls_back_past_corrupt(tmp_path, capsys):
    backend = LocalBackend(BackendConfig())
    mgr = CheckpointManager(tmp_path, backend, keep=2)
    stale = tmp_path / ".ckpt-000000009.h5.tmp4242"  # left by a writer killed mid-write
    stale.write_bytes(b"half")
    model = build_model("tiny")
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in (1, 2, 3):
        with torch.no_grad():
            next(model.parameters()).fill_(step)
        mgr.save(model, opt, None, TrainingState(global_step=step))
    assert not stale.exists()
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == ["ckpt-000000002.h5", "ckpt-000000003.h5", "latest"]
    assert (tmp_path / "latest").read_text().strip() == "ckpt-000000003.h5"

    # corrupt the newest: resume warns and uses step 2
    newest = tmp_path / "ckpt-000000003.h5"
    newest.write_bytes(newest.read_bytes()[:1000])
    fresh = build_model("tiny", seed=9)
    state = mgr.restore(fresh, torch.optim.SGD(fresh.parameters(), lr=0.1))
    assert state.global_step == 2
    assert torch.all(next(fresh.parameters()) == 2)
    assert "WARNING: skipping ckpt-000000003.h5: checkpoint" in capsys.readouterr().err


def test_restore_with_no_checkpoint_is_fresh_start(tmp_path):
    mgr = CheckpointManager(tmp_path / "none", LocalBackend(BackendConfig()))
    model = build_model("tiny")
    assert mgr.restore(model, torch.optim.SGD(model.parameters(), lr=0.1)) is None


def test_failed_write_is_one_error_not_a_half_file(tmp_path):
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("x")
    mgr = CheckpointManager(blocker, LocalBackend(BackendConfig()))
    model = build_model("tiny")
    with pytest.raises(CheckpointError, match="rank 0 could not handle the checkpoint: checkpoint "
                       "directory .* is not a directory") as info:
        mgr.save(model, None, None, TrainingState(global_step=1))
    assert "HINT: pass a directory path to --checkpoint-dir" in str(info.value)
    assert blocker.read_text() == "x"


def test_ckpt_show_cli(tmp_path):
    model, opt, _ = trained_state()
    path = write_checkpoint(tmp_path / "ckpt-000000005.h5", Snapshot(
        model=model.state_dict(), optimizer=opt.state_dict(), state=TrainingState(epoch=1, global_step=5),
        meta={"world_size": 2, "backend": "horovod"}))
    (tmp_path / "latest").write_text(path.name)
    result = CliRunner().invoke(cli, ["ckpt", "show", str(tmp_path)])
    assert result.exit_code == 0, result.output
    assert "global_step  5" in result.output and "backend      horovod" in result.output
    assert "inp.weight" in result.output and "checksum     OK" in result.output
    with h5py.File(path, "r+") as f:
        f["model/inp.bias"][0] += 1.0  # silent change of one value
    result = CliRunner().invoke(cli, ["ckpt", "show", str(path)])
    assert result.exit_code == 1 and "is corrupt: SHA-256" in result.output
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
    import hvdkit.checkpoint as ckmod

    if not precheck:  # skip the up-front check so that os.write itself gets ENOSPC
        monkeypatch.setattr(ckmod, "_SPACE_MARGIN", -(1 << 40))
    mgr = CheckpointManager(tiny_fs, LocalBackend(BackendConfig()))
    model = build_model("tiny")
    mgr.save(model, None, None, TrainingState(global_step=1))
    first = (tiny_fs / "ckpt-000000001.h5").read_bytes()
    free = shutil.disk_usage(tiny_fs).free
    (tiny_fs / "filler").write_bytes(b"\0" * (free - 8192))  # leave 8 KiB: less than a checkpoint
    with pytest.raises(CheckpointError) as info:
        mgr.save(model, None, None, TrainingState(global_step=2))
    message = str(info.value)
    assert "disk full: checkpoint ckpt-000000002.h5 needs" in message and " free in " in message
    assert "HINT: free space or point --checkpoint-dir elsewhere" in message and "\n" not in message
    assert sorted(p.name for p in tiny_fs.iterdir()) == ["ckpt-000000001.h5", "filler", "latest"]
    assert (tiny_fs / "ckpt-000000001.h5").read_bytes() == first
    assert verify_checkpoint(tiny_fs / "ckpt-000000001.h5")[0]
