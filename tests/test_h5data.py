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
    assert ds._file is None                      # nothing open until first read
    x, y = ds[3]
    assert x.shape == (8,) and y.dtype == torch.long
    clone = pickle.loads(pickle.dumps(ds))       # what a DataLoader worker receives
    assert clone._file is None
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
