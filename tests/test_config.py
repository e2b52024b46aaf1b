"""Config dataclasses validate themselves with one-line errors that carry a hint."""

from __future__ import annotations

import pytest

from hvdkit.config import BackendConfig, DDPOptions, HorovodOptions, TrainConfig, config_from_dict
from hvdkit.data import per_rank_batch_size
from hvdkit.errors import ConfigError


def test_horovod_environment_mapping():
    env = HorovodOptions(fusion_threshold_mb=64, cycle_time_ms=3.5, timeline="/t.json",
                         stall_check_s=30, stall_shutdown_s=120).environment()
    assert env == {"HOROVOD_FUSION_THRESHOLD": str(64 * 1024 * 1024), "HOROVOD_CYCLE_TIME": "3.5",
                   "HOROVOD_TIMELINE": "/t.json", "HOROVOD_STALL_CHECK_TIME_SECONDS": "30",
                   "HOROVOD_STALL_SHUTDOWN_TIME_SECONDS": "120"}
    assert HorovodOptions(fusion_threshold_mb=0).environment() == {"HOROVOD_FUSION_THRESHOLD": "0"}
    assert HorovodOptions().environment() == {}


@pytest.mark.parametrize("make,match", [
    (lambda: BackendConfig(name="mxnet"), "backend 'mxnet' is not known"),
    (lambda: BackendConfig(accumulation_steps=0), "accumulation_steps must be >= 1"),
    (lambda: HorovodOptions(compression="int8"), "compression 'int8'"),
    (lambda: HorovodOptions(op="adasum", gradient_predivide_factor=2.0), "needs op 'average'"),
    (lambda: HorovodOptions(fusion_threshold_mb=-1), "fusion_threshold_mb must be >= 0"),
    (lambda: DDPOptions(bucket_cap_mb=0), "bucket_cap_mb must be > 0"),
    (lambda: TrainConfig(model="resnet"), "model 'resnet' is not known"),
    (lambda: TrainConfig(lr=0), "lr must be > 0"),
])
def test_invalid_values(make, match):
    with pytest.raises(ConfigError, match=match) as info:
        make()
    assert "HINT:" in str(info.value) and "\n" not in str(info.value)


def test_config_from_dict_nested_and_unknown_keys():
    cfg = config_from_dict(TrainConfig, {"epochs": 3, "backend": {"name": "ddp", "ddp": {"bucket_cap_mb": 4}}})
    assert cfg.epochs == 3 and cfg.backend.name == "ddp" and cfg.backend.ddp.bucket_cap_mb == 4
    with pytest.raises(ConfigError, match="unknown TrainConfig key"):
        config_from_dict(TrainConfig, {"epochz": 3})


def test_global_batch_division():
    assert per_rank_batch_size(64, 2, 2) == 16
    assert per_rank_batch_size(63, 2, 1) == 31  # rounded down when not exact
    with pytest.raises(ConfigError, match="global batch 63 does not divide over 2 ranks"):
        per_rank_batch_size(63, 2, 1, exact=True)
    with pytest.raises(ConfigError, match="smaller than"):
        per_rank_batch_size(3, 4, 1)
