"""HDF5 datasets: opened lazily per process, each rank reads only its shard."""

from __future__ import annotations

import json
import pickle

import h5py
import pytest
import torch
from click.testing import CliRunner
from torch.utils.data import DataLoader

from helpers import HVDKIT, check, launch
from hvdkit import H5Dataset, ShardSampler
from hvdkit.cli import cli
from hvdkit.errors import HvdkitError


@pytest.fixture
def h5file(tmp_path):
    path = tmp_path / "d.h5"
    result = CliRunner().invoke(cli, ["data", "make-synthetic", str(path), "--model", "tiny",
                                      "--num-samples", "100"])
    assert result.exit_code == 0, result.output
    return path


def test_file_layout(h5file):
    with h5py.File(h5file, "r") as f:
        assert f["x"].shape == (100, 8) and f["y"].shape == (100,)
        assert f.attrs["model"] == "tiny"


def test_lazy_open_and_fork_safety(h5file):
    ds = H5Dataset(h5file)
    assert ds._handles == {}                     # nothing open until first read
    x, y = ds[3]
    assert x.shape == (8,) and y.dtype == torch.long
    clone = pickle.loads(pickle.dumps(ds))       # what a DataLoader worker receives
    assert clone._handles == {}
    loader = DataLoader(ds, batch_size=10, num_workers=2)  # forked workers open their own handle
    assert sum(len(b[0]) for b in loader) == 100


def test_each_rank_reads_only_its_shard(h5file):
    shards = []
    for rank in range(2):
        sampler = ShardSampler(100, 2, rank, seed=5)
        sampler.set_epoch(1)
        shards.append(list(sampler))
    assert not set(shards[0]) & set(shards[1])
    assert sorted(shards[0] + shards[1]) == list(range(100))
    # resuming at global sample 40 continues the same global order
    tail = ShardSampler(100, 2, 0, seed=5)
    tail.set_epoch(1, start=40)
    assert list(tail) == shards[0][20:]


def test_missing_file_or_key(tmp_path, h5file):
    with pytest.raises(HvdkitError, match="does not exist"):
        H5Dataset(tmp_path / "nope.h5")
    with pytest.raises(HvdkitError, match="no dataset 'images'"):
        H5Dataset(h5file, x_key="images")


@pytest.mark.mp
@pytest.mark.timeout(200)  # measured 4 s (2 cores, loaded)
def test_two_rank_training_on_hdf5(tmp_path):
    """The file's 200 samples are what the ranks train on: 200 / (2 x 25) = 4 steps (the
    synthetic default would give another count), every sample once (the sample log)."""
    path = tmp_path / "cnn.h5"
    made = CliRunner().invoke(cli, ["data", "make-synthetic", str(path), "--model", "mlp", "--num-samples", "200"])
    assert made.exit_code == 0, made.output
    metrics = tmp_path / "m.json"
    check(launch("mpirun", 2, [*HVDKIT, "train", "--backend", "ddp", "--model", "mlp", "--data", str(path),
                               "--epochs", "1", "--batch-size", "25", "--metrics-file", str(metrics),
                               "--sample-log", str(tmp_path / "samples.jsonl")]))
    m = json.loads(metrics.read_text())
    assert m["global_step"] == 4 and m["params_identical"] is True and m["config"]["data"] == str(path)
    from hvdkit.samplelog import read_sample_log

    ids = sorted(i for r in read_sample_log(tmp_path / "samples.jsonl") for i in r["ids"])
    assert ids == list(range(200))


def test_several_files_read_as_one_dataset_by_list_glob_or_directory(tmp_path):
    """--data a.h5,b.h5, a glob, or a directory of shards: one dataset, in that order; files of
    another sample shape are refused in one line."""
    import numpy as np

    from hvdkit.data import write_h5_dataset

    shards = tmp_path / "shards"
    shards.mkdir()
    for k, n in enumerate((7, 5, 9)):
        x = np.arange(n * 3, dtype=np.float32).reshape(n, 3) + 1000 * k
        write_h5_dataset(shards / f"part-{k}.h5", x, np.full(n, k, dtype=np.int64))
    by_dir = H5Dataset(shards)
    assert len(by_dir) == 21 and len(H5Dataset(str(shards / "part-*.h5"))) == 21
    listed = H5Dataset(f"{shards / 'part-2.h5'},{shards / 'part-0.h5'}")
    assert len(listed) == 16 and int(listed[0][1]) == 2 and int(listed[9][1]) == 0
    assert [int(by_dir[i][1]) for i in (0, 6, 7, 11, 12, 20)] == [0, 0, 1, 1, 2, 2]
    assert torch.equal(by_dir[8][0], torch.tensor([1003.0, 1004.0, 1005.0]))
    assert list(by_dir.labels()) == [0] * 7 + [1] * 5 + [2] * 9
    assert sum(len(b[0]) for b in DataLoader(by_dir, batch_size=4, num_workers=2)) == 21
    write_h5_dataset(tmp_path / "other.h5", np.zeros((4, 2), dtype=np.float32), np.zeros(4, dtype=np.int64))
    with pytest.raises(HvdkitError, match="disagree on sample shape"):
        H5Dataset(f"{shards / 'part-0.h5'},{tmp_path / 'other.h5'}")
    with pytest.raises(HvdkitError, match="no dataset file matches"):
        H5Dataset(str(tmp_path / "nothing-*.h5"))


def test_an_hdf5_sample_is_one_contiguous_read(tmp_path):
    """The writer lays x and y out contiguously: random access of one sample needs no chunk index."""
    import numpy as np

    from hvdkit.data import write_h5_dataset

    path = write_h5_dataset(tmp_path / "c.h5", np.ones((10, 4), dtype=np.float32), np.arange(10), block=3)
    with h5py.File(path, "r") as f:
        assert f["x"].chunks is None and f["y"].chunks is None and f["x"].id.get_offset() is not None
        assert f["x"][()].sum() == 40 and list(f["y"][()]) == list(range(10))


@pytest.mark.timeout(300)  # measured 20 s on 2 cores
def test_200m_sample_sampling_and_split_take_constant_memory():
    """A synthetic index space of 200M samples: the split, its views, and a rank's sampler over
    the first 2M of its 95M indices, in under 100 MiB of peak memory (VmHWM, reset after
    torch is loaded); every index the sampler yields is a training index, none twice. The
    lists these replace would hold 1.6 GB for the split and 0.8 GB per epoch."""
    import subprocess
    import sys

    code = r"""
import sys
import numpy as np, torch
from hvdkit.data import ShardSampler, split_indices
def kib(field):
    return int(next(l for l in open("/proc/self/status") if l.startswith(field)).split()[1])
open("/proc/self/clear_refs", "w").write("5")  # the peak (VmHWM) starts again from here
base = kib("VmRSS")
N = 200_000_000
train, val = split_indices(N, 0.05, seed=1)
assert len(train) + len(val) == N and len(val) == 10_000_000
sampler = ShardSampler(len(train), 2, 1, seed=3)
sampler.set_epoch(4, start=1_000)
seen = np.empty(2_000_000, dtype=np.int64)  # 16 MB of the test's own, counted
for k, i in enumerate(sampler):
    if k == len(seen):
        break
    seen[k] = train[i] if k < 2000 else i
grew = kib("VmHWM") - base  # the peak, before the checks' own copies
assert len(sampler) == (len(train) - 1_000) // 2
assert len(np.unique(seen[2000:])) == len(seen) - 2000 and seen[2000:].max() < len(train)
assert not set(seen[:2000].tolist()) & {val[j] for j in range(2000)}
print(grew * 1024)
"""
    from helpers import base_env

    proc = subprocess.run([sys.executable, "-c", code], env=base_env(), capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-2000:]
    grew = int(proc.stdout.split()[-1])
    print(f"peak memory above the baseline: {grew / 2**20:.1f} MiB")
    assert grew < 100 * 2**20
