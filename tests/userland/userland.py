"""A user's own pieces, by import path: a dataset factory, a model, a task, and noisy augmentation.

Nothing here knows about hvdkit.
"""

import torch
from torch.utils.data import Dataset, TensorDataset


def regression(samples: int = 512, features: int = 6, seed: int = 0):
    """(train, val): y = x @ w + noise, as two TensorDatasets."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(samples, features, generator=gen)
    y = x @ torch.randn(features, generator=gen) + 0.1 * torch.randn(samples, generator=gen)
    cut = samples * 3 // 4
    return {"train": TensorDataset(x[:cut], y[:cut]), "val": TensorDataset(x[cut:], y[cut:])}


def regressor(features: int = 6, width: int = 16):
    return torch.nn.Sequential(torch.nn.Linear(features, width), torch.nn.LayerNorm(width), torch.nn.Tanh(),
                               torch.nn.Linear(width, 1))


def mse(model, batch):
    x, y = batch
    pred = model(x).squeeze(-1)
    return {"loss": torch.nn.functional.mse_loss(pred, y), "mae": (pred - y).abs().mean(),
            "count": y.shape[0]}


class Noisy(Dataset):
    """Synthetic 'tiny' samples with random augmentation: noise drawn from the global RNG."""

    def __init__(self, samples: int = 512, seed: int = 3) -> None:
        gen = torch.Generator().manual_seed(seed)
        self.x = torch.randn(samples, 8, generator=gen)
        self.y = (self.x @ torch.randn(8, 4, generator=gen)).argmax(1)

    def __len__(self) -> int:
        return len(self.y)

    def __getitem__(self, i: int):
        return self.x[i] + 0.3 * torch.randn(8), self.y[i]


def noisy(samples: int = 512):
    return Noisy(samples)


def wide_mlp(width: int = 2048, depth: int = 10, classes: int = 10):
    """A deep, wide MLP: at the defaults 42M parameters, 168 MB in fp32 (AdamW: 4x that in all)."""
    blocks = [torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.ReLU()) for _ in range(depth)]
    return torch.nn.Sequential(*blocks, torch.nn.Linear(width, classes))


def vectors(samples: int = 64, width: int = 2048, classes: int = 10, seed: int = 0):
    """Random vectors with random labels, for the wide MLP."""
    gen = torch.Generator().manual_seed(seed)
    return TensorDataset(torch.randn(samples, width, generator=gen),
                         torch.randint(0, classes, (samples,), generator=gen))
