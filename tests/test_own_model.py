"""Your own model, task, data and optimizer: import paths, tasks, schedules, exact metrics (unit level)."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from hvdkit import BackendConfig, build_model
from hvdkit.backends import LocalBackend
from hvdkit.config import TrainConfig
from hvdkit.data import split_indices
from hvdkit.errors import ConfigError, HvdkitError
from hvdkit.factories import check_static, resolve
from hvdkit.metrics import EvalShard, MetricSums
from hvdkit.optim import make_optimizer, param_groups
from hvdkit.schedule import LrPlan
from hvdkit.tasks import Classification, FunctionTask, LanguageModel, make_task


def test_import_paths_by_module_and_by_file(tmp_path):
    (tmp_path / "mine.py").write_text(
        "import torch\n\n"
        "class Net(torch.nn.Module):\n"
        "    def __init__(self, width=4):\n        super().__init__()\n        self.fc = torch.nn.Linear(8, width)\n"
        "    def forward(self, x):\n        return {'logits': self.fc(x)}\n\n"
        "def make(width=4, **rest):\n    return Net(width)\n")
    model = build_model(f"{tmp_path}/mine.py:Net", args={"width": 3})
    assert model.fc.out_features == 3
    assert isinstance(build_model("torch.nn:Linear", args={"in_features": 2, "out_features": 5}), nn.Linear)
    with pytest.raises(ConfigError, match="takes no argument 'depth'"):
        build_model(f"{tmp_path}/mine.py:Net", args={"depth": 3})
    resolve(f"{tmp_path}/mine.py:make", {"anything": 1})  # **kwargs takes any argument
    # the static check (hvdkit slurm, no import) reads the same signatures from source
    check_static(f"{tmp_path}/mine.py:Net", {"width": 3})
    with pytest.raises(ConfigError, match="takes no argument 'depth'"):
        check_static(f"{tmp_path}/mine.py:Net", {"depth": 3})
    check_static(f"{tmp_path}/mine.py:make", {"depth": 3})
    with pytest.raises(ConfigError, match="returned a int, not a torch.nn.Module"):
        build_model("json:loads", args={"s": "3"})


def test_a_model_returning_a_dict_trains_with_the_classification_task():
    class DictNet(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(8, 4)

        def forward(self, x):
            return {"logits": self.fc(x), "hidden": x}

    out = Classification()(DictNet(), (torch.randn(5, 8), torch.tensor([0, 1, 2, 3, 0])))
    assert out["loss"].requires_grad and int(out["count"]) == 5 and 0 <= float(out["accuracy"]) <= 1


def test_language_model_task_shifts_targets_and_derives_perplexity():
    class Uniform(nn.Module):
        def forward(self, idx):  # every next character equally likely among 10
            return torch.zeros(*idx.shape, 10)

    tokens = torch.randint(0, 10, (3, 9))
    out = LanguageModel()(Uniform(), tokens)
    assert int(out["count"]) == 3 * 8  # 8 predictions per window of 9
    assert float(out["loss"]) == pytest.approx(math.log(10))
    assert LanguageModel().finalize({"loss": math.log(10)})["perplexity"] == pytest.approx(10.0)
    with pytest.raises(HvdkitError, match="token id 12 does not fit the model's vocabulary of 10"):
        LanguageModel().check(Uniform(), torch.full((2, 5), 12))


def test_function_task_defaults_the_count_and_rejects_a_non_scalar_loss():
    def task(model, batch):
        x, y = batch
        return {"loss": ((model(x).squeeze(-1) - y) ** 2).mean(), "mae": (model(x).squeeze(-1) - y).abs().mean()}

    fn = FunctionTask(task, "mine:task")
    out = fn(nn.Linear(3, 1), (torch.randn(6, 3), torch.randn(6)))
    assert int(out["count"]) == 6 and set(out) == {"loss", "mae", "count"}
    with pytest.raises(HvdkitError, match="returned a loss of shape"):
        FunctionTask(lambda m, b: {"loss": torch.ones(2)}, "bad:fn")(nn.Linear(3, 1), torch.randn(2, 3))
    assert isinstance(make_task("classification"), Classification)


def test_metric_sums_weigh_every_sample_once():
    """Batch means of unequal batches: the exact mean over samples, not the mean of means."""
    sums = MetricSums()
    sums.add({"loss": torch.tensor(1.0), "accuracy": torch.tensor(0.5)}, 2)
    sums.add({"loss": torch.tensor(4.0), "accuracy": torch.tensor(1.0)}, 1)
    out = sums.compute(LocalBackend(BackendConfig(name="local")))
    assert out == {"loss": pytest.approx(2.0), "accuracy": pytest.approx(2 / 3), "count": 3.0}


def test_eval_shards_cover_every_sample_once_at_any_world_size():
    for size in (1, 2, 3, 4, 7):
        shards = [list(EvalShard(97, size, r)) for r in range(size)]
        assert sorted(i for s in shards for i in s) == list(range(97))
        assert max(map(len, shards)) - min(map(len, shards)) <= 1


def test_validation_split_is_fixed_by_its_seed_alone():
    train, val = split_indices(1000, 0.1, seed=3)
    assert len(val) == 100 and not set(train) & set(val) and sorted(train + val) == list(range(1000))
    assert split_indices(1000, 0.1, seed=3) == (train, val)   # resumes, world sizes, resets
    assert split_indices(1000, 0.1, seed=4)[1] != val
    with pytest.raises(ConfigError, match="leaves no training sample"):
        split_indices(3, 0.9, seed=0)


def test_lr_schedules_after_the_warmup():
    cosine = LrPlan(scale=4.0, warmup_steps=10, total_steps=110, kind="cosine", min_ratio=0.1)
    assert cosine.factor(0) == 0.25 and cosine.factor(10) == 1.0
    assert cosine.factor(60) == pytest.approx(0.55) and cosine.factor(110) == pytest.approx(0.1)
    assert cosine.factor(500) == pytest.approx(0.1)  # stays at the floor past the end
    step = LrPlan(kind="step", step_every=5, gamma=0.5)
    assert [step.factor(s) for s in (0, 4, 5, 10, 14)] == [1.0, 1.0, 0.5, 0.25, 0.25]
    assert LrPlan().factor(1000) == 1.0


def test_weight_decay_skips_biases_and_norms_and_optimizers_come_by_import_path():
    model = nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4), nn.Embedding(10, 4))
    groups = param_groups(model, 0.1)
    decayed = {id(p) for p in groups[0]["params"]}
    assert groups[0]["weight_decay"] == 0.1 and groups[1]["weight_decay"] == 0.0
    assert decayed == {id(model[0].weight), id(model[2].weight)}
    cfg = TrainConfig(optimizer="torch.optim:RMSprop", optimizer_args={"alpha": 0.8}, weight_decay=0.1)
    opt = make_optimizer(cfg, model, 0.01)
    assert isinstance(opt, torch.optim.RMSprop) and opt.defaults["alpha"] == 0.8
    assert [g["weight_decay"] for g in opt.param_groups] == [0.1, 0.0]
    adamw = make_optimizer(TrainConfig(optimizer="adamw", optimizer_args={"betas": [0.9, 0.95]}), model, 0.01)
    assert tuple(adamw.defaults["betas"]) == (0.9, 0.95)
