"""Config dataclasses validate themselves with one-line errors that carry a hint."""

from __future__ import annotations

import re

import pytest

from hvdkit.config import BackendConfig, DDPOptions, HorovodOptions, TrainConfig, config_from_dict
from hvdkit.data import per_rank_batch_size
from hvdkit.errors import ConfigError


def test_horovod_environment_mapping():
    env = HorovodOptions(fusion_threshold_mb=64, cycle_time_ms=3.5, timeline="/t.json",
                         stall_check_s=30, stall_shutdown_s=120).env_vars()
    assert env == {"HOROVOD_FUSION_THRESHOLD": str(64 * 1024 * 1024), "HOROVOD_CYCLE_TIME": "3.5",
                   "HOROVOD_TIMELINE": "/t.json", "HOROVOD_STALL_CHECK_TIME_SECONDS": "30",
                   "HOROVOD_STALL_SHUTDOWN_TIME_SECONDS": "120"}
    assert HorovodOptions(fusion_threshold_mb=0).env_vars() == {"HOROVOD_FUSION_THRESHOLD": "0"}
    assert HorovodOptions().env_vars() == {}


@pytest.mark.parametrize("make,match", [
    (lambda: BackendConfig(name="mxnet"), "backend 'mxnet' is not known"),
    (lambda: BackendConfig(accumulation_steps=0), "accumulation_steps must be >= 1"),
    (lambda: HorovodOptions(compression="int8"), "compression 'int8'"),
    (lambda: HorovodOptions(op="adasum", gradient_predivide_factor=2.0), "needs op 'average'"),
    (lambda: HorovodOptions(fusion_threshold_mb=-1), "fusion_threshold_mb must be >= 0"),
    (lambda: DDPOptions(bucket_cap_mb=0), "bucket_cap_mb must be > 0"),
    (lambda: DDPOptions(timeout_s=1e-9), "--ddp-timeout must be at least 1 second, got 1e-09"),
    (lambda: DDPOptions(compression="powersgd:rank=2,rank=4"), "powersgd:rank=2,rank=4: rank is given twice"),
    (lambda: DDPOptions(timeout_s=float("nan")), "--ddp-timeout must be at least 1 second, got nan"),
    (lambda: TrainConfig(model="resnet"), "model 'resnet' is not known"),
    (lambda: TrainConfig(lr=0), "lr must be a finite number > 0"),
    (lambda: TrainConfig(lr=float("nan")), "lr must be a finite number > 0, got nan"),
    (lambda: TrainConfig(model="my model:fn"), "'my model' is not a module name"),
    (lambda: TrainConfig(model="pkg.mod:"), "is not an import path"),
    (lambda: TrainConfig(task="regression"), "--task 'regression' is not known"),
    (lambda: TrainConfig(optimizer="lamb"), "--optimizer 'lamb' is not known"),
    (lambda: TrainConfig(data="a.h5", dataset="pkg:fn"), "--data and --dataset both"),
    (lambda: TrainConfig(val_fraction=1.5), "--val-fraction must be in [0, 1), got 1.5"),
    (lambda: TrainConfig(val_data="v.h5", val_fraction=0.1), "--val-data and --val-fraction both"),
    (lambda: TrainConfig(eval_every=5), "--eval-every needs validation data"),
    (lambda: TrainConfig(keep_best="val_loss"), "--keep-best needs --checkpoint-dir"),
    (lambda: TrainConfig(keep_best="val_loss", checkpoint_dir="c"), "--keep-best val_loss needs validation data"),
    (lambda: TrainConfig(keep_best="loss:best", checkpoint_dir="c"), "is not METRIC[:min|max]"),
    (lambda: TrainConfig(clip_grad_norm=-1.0), "clip_grad_norm must be a finite number > 0"),
    (lambda: TrainConfig(lr_schedule="linear"), "lr_schedule 'linear' is not known"),
    (lambda: TrainConfig(model_args=["a=1"]), "model_args must be a mapping"),
])
def test_invalid_values(make, match):
    with pytest.raises(ConfigError, match=re.escape(match)) as info:
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


def test_model_and_optimizer_args_parse_as_yaml_scalars():
    from hvdkit.factories import format_args, parse_args

    args = parse_args(["num_classes=10", "dropout=0.1", "bias=false", "name=resnet", "betas=[0.9, 0.95]"])
    assert args == {"num_classes": 10, "dropout": 0.1, "bias": False, "name": "resnet", "betas": [0.9, 0.95]}
    assert parse_args(format_args(args)) == args  # what --config mappings become on a command line
    for bad, words in ((["noequals"], "is not KEY=VALUE"), (["1x=2"], "is not a keyword argument name"),
                       (["a=1", "a=2"], "is given twice")):
        with pytest.raises(ConfigError, match=words):
            parse_args(bad)


def _defaults_and_choices(command) -> dict[str, tuple]:
    import click

    out = {}
    for p in command.params:
        if isinstance(p, click.Option) and p.name:
            choices = tuple(p.type.choices) if isinstance(p.type, click.Choice) else None
            out[p.name] = (p.default, choices)
    return out


def test_click_defaults_and_choices_are_the_configs_own():
    """Every default and choice list of 'hvdkit train' and 'hvdkit slurm' is the dataclasses' and
    constants' of hvdkit.config / hvdkit.launch.slurm: change one there and the CLI follows."""
    import dataclasses

    from hvdkit import config
    from hvdkit.backends.traits import BACKENDS, DEFAULT_BACKEND
    from hvdkit.cli.slurm_cmd import slurm_command
    from hvdkit.cli.train_cmd import train_command
    from hvdkit.launch.slurm import SlurmJob

    train = _defaults_and_choices(train_command)
    sources = {f.name: f.default for cls in (config.TrainConfig, config.BackendConfig, config.HorovodOptions,
                                              config.DDPOptions)
               for f in dataclasses.fields(cls) if f.default is not dataclasses.MISSING}
    checked = 0
    for name, (default, _) in train.items():
        if name in sources and default is not None and name != "backend":
            assert default == sources[name], (name, default, sources[name])
            checked += 1
    assert checked >= 30, checked
    assert train["backend"] == (DEFAULT_BACKEND, tuple(BACKENDS)) and config.BackendConfig().name == DEFAULT_BACKEND
    for option, constant in (("precision", config.PRECISIONS), ("lr_schedule", config.LR_SCHEDULES),
                             ("on_nonfinite", config.NONFINITE_MODES), ("log_level", config.LOG_LEVELS),
                             ("hvd_op", config.HOROVOD_OPS),
                             ("hvd_reducer", config.HOROVOD_REDUCERS), ("shard", config.SHARD_MODES),
                             ("progress", config.PROGRESS_MODES)):
        assert train[option][1] == tuple(constant), option
    # --compression takes options (powersgd:rank=R,start=N): not a choice, but its help names every kind
    shown = next(p for p in train_command.params if p.name == "compression").metavar
    assert shown.replace("[:rank=R,start=N]", "").split("|") == list(config.COMPRESSIONS)
    job = {f.name: f.default for f in dataclasses.fields(SlurmJob) if f.default is not dataclasses.MISSING}
    slurm = _defaults_and_choices(slurm_command)
    for name in ("job_name", "nodes", "tasks_per_node", "gpus_per_node", "cpus_per_task", "time", "signal",
                 "signal_seconds", "requeue", "elastic_timeout", "backend"):
        assert slurm[name][0] == job[name], name


def test_the_configs_task_and_optimizer_names_are_what_tasks_and_optim_build():
    """config.py lists the names for the CLI (no torch import); tasks.py and optim.py own them."""
    import torch

    from hvdkit.config import OPTIMIZER_NAMES, TASK_METRICS, TASK_NAMES, TrainConfig
    from hvdkit.optim import make_optimizer
    from hvdkit.tasks import TASKS, make_task

    assert set(TASK_NAMES) == set(TASKS) and all(make_task(n).name == n for n in TASK_NAMES)
    assert {n: TASKS[n].metrics for n in TASK_NAMES} == TASK_METRICS
    model = torch.nn.Linear(2, 2)
    built = {n: type(make_optimizer(TrainConfig(optimizer=n), model, 0.1)).__name__.lower() for n in OPTIMIZER_NAMES}
    assert built == {n: n for n in OPTIMIZER_NAMES}


def test_a_bad_hvdkit_backend_in_the_environment_is_named_as_the_cause(monkeypatch):
    monkeypatch.setenv("HVDKIT_BACKEND", "Horovod")
    with pytest.raises(ConfigError, match=re.escape("HVDKIT_BACKEND='Horovod' in the environment is not a backend")):
        BackendConfig()
    with pytest.raises(ConfigError, match="backend 'bogus' is not known"):  # a name given is blamed as given
        BackendConfig(name="bogus")
