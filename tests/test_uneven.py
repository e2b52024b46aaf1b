"""--uneven: every sample trained on, ranks with shorter shards join, nobody stalls.

97 samples on 2 ranks with 8 per batch: rank 0 gets 49 (6 full batches and one of 1),
rank 1 gets 48 (6 full batches), so in the 7th step of each epoch rank 1 has joined and
answers rank 0's gradient reduction with zeros. The documented result: each step's update
is the mean gradient over the samples all ranks read at that step, i.e. one process with
batch 16 on the same sample order (to floating-point rounding).
"""

from __future__ import annotations

import subprocess

import pytest
import torch

from helpers import HVDKIT, base_env, read_metrics
from hvdkit.checkpoint import read_checkpoint
from hvdkit.samplelog import read_sample_log

COMMON = ["--model", "tiny", "--epochs", "2", "--num-samples", "97", "--uneven", "--lr", "0.05",
          "--optimizer", "sgd", "--momentum", "0.9"]


def _train(argv, cwd) -> str:
    proc = subprocess.run(argv, env=base_env(), cwd=cwd, text=True, capture_output=True, timeout=100)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    return proc.stdout


def _last_weights(directory) -> dict[str, torch.Tensor]:
    newest = max(directory.glob("ckpt-*.h5"))
    return read_checkpoint(newest)["model"]


@pytest.fixture(scope="module")
def one_process(tmp_path_factory):
    """The same samples in the same order, one process, batch 16 (= 2 ranks x 8)."""
    tmp = tmp_path_factory.mktemp("single")
    _train([*HVDKIT, "train", "--backend", "local", *COMMON, "--batch-size", "16",
            "--checkpoint-dir", str(tmp / "ck"), "--metrics-file", str(tmp / "m.json")], tmp)
    return read_metrics(tmp / "m.json")["final_loss"], _last_weights(tmp / "ck")


@pytest.mark.mp
@pytest.mark.timeout(120)  # measured 8 s (2 cores, loaded)
@pytest.mark.parametrize("backend", ["horovod", "ddp"])
def test_uneven_shards_finish_without_a_stall_and_match_one_process(tmp_path, backend, one_process):
    out = _train([*HVDKIT, "run", "-np", "2", "--backend", backend, "--", *COMMON, "--backend", backend,
                  "--batch-size", "8", "--no-scale-lr", "--checkpoint-dir", str(tmp_path / "ck"),
                  "--sample-log", str(tmp_path / "ids.jsonl"), "--metrics-file", str(tmp_path / "m.json")], tmp_path)
    done = read_metrics(tmp_path / "m.json")
    assert done["global_step"] == 14 and done["params_identical"] is True, out[-2000:]  # 7 steps per epoch
    records = read_sample_log(tmp_path / "ids.jsonl")
    for epoch in (0, 1):  # nothing padded, nothing dropped
        assert sorted(i for r in records if r["epoch"] == epoch for i in r["ids"]) == list(range(97))
    loss, weights = one_process
    assert done["final_loss"] == pytest.approx(loss, rel=1e-6)
    mine = _last_weights(tmp_path / "ck")
    for name, tensor in weights.items():
        torch.testing.assert_close(mine[name], tensor, rtol=1e-5, atol=1e-6, msg=name)


def test_uneven_is_refused_where_a_joined_rank_could_not_take_part():
    from click.testing import CliRunner

    from hvdkit.cli import cli

    result = CliRunner().invoke(cli, ["train", "--uneven", "--accumulation-steps", "2"])
    assert result.exit_code != 0
    assert "--uneven cannot be combined with --accumulation-steps above 1" in result.output
