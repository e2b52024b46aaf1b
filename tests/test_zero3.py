"""hvdkit's ZeRO-3 (``--shard full`` on Horovod, hvdkit/backends/zero3.py) in one process: the
units are gathered one at a time and freed, the tied weights sit in the root, and the steps are
those of the plain model. The multi-rank runs (bits against FSDP2 and unsharded, memory,
checkpoints across modes) are in test_shard.py, test_blocks.py and test_materialise.py."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from torch import nn

from helpers import ROOT
from hvdkit.backends.local import LocalBackend
from hvdkit.backends.zero3 import Zero3Strategy
from hvdkit.blocks import checkpoint_activations
from hvdkit.config import BackendConfig
from hvdkit.errors import HvdkitError
from hvdkit.models import build_model

MODELS = str(ROOT / "examples" / "models.py")


def _gpt(**extra: Any) -> nn.Module:
    torch.manual_seed(0)
    return build_model(f"{MODELS}:gpt", args={"vocab_size": 96, "n_layer": 4, "n_embd": 128, "block_size": 32,
                                              **extra})


@pytest.mark.parametrize("recompute", [False, True])
def test_units_are_gathered_one_at_a_time_and_the_steps_are_the_plain_models(recompute):
    """A 4-block GPT (its head tied to the embedding): while any block runs forward or backward,
    at most two blocks are whole (the one computing and the next, prefetched) besides the
    root; after a step no block is. Three AdamW steps end on the plain model's bits, with and
    without activation checkpointing."""
    plain = _gpt()
    sharded = copy.deepcopy(plain)
    if recompute:
        checkpoint_activations(sharded)
    comm = LocalBackend(BackendConfig(name="local"))
    strategy = Zero3Strategy(comm)
    model, opt = strategy.wrap(sharded, torch.optim.AdamW(sharded.parameters(), lr=1e-2))
    ref_opt = torch.optim.AdamW(plain.parameters(), lr=1e-2)
    blocks, root = strategy.units[:-1], strategy.units[-1]
    assert len(blocks) == 4 and model.tok.weight in root.params  # type: ignore[operator]
    assert model.head.weight is model.tok.weight  # still tied

    whole_blocks: list[int] = []

    def count(*_: Any) -> None:
        whole_blocks.append(sum(u.gathered for u in blocks))

    for block in (u.module for u in blocks):
        block.register_forward_pre_hook(count)
        block.register_full_backward_hook(count)
    x = torch.randint(0, 96, (4, 32))
    for _ in range(3):
        for m, o in ((plain, ref_opt), (model, opt)):
            o.zero_grad()
            logits = m(x)
            logits.float().square().mean().backward()
            if m is model:
                strategy.optimizer_step(o, None, None)
            else:
                o.step()
        assert not any(u.gathered for u in blocks)
        assert all(p.numel() == 0 for u in blocks for p in u.params)  # freed: only the shards hold data
    assert whole_blocks and max(whole_blocks) <= 2, whole_blocks
    got = strategy.module_state_dict(model)
    for name, want in plain.state_dict().items():
        value = got[name]
        value = value.fetch() if hasattr(value, "fetch") else value
        assert torch.equal(value, want), name
    strategy.close()


def test_a_0_dimensional_parameter_is_refused_in_one_line():
    class Scaled(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin, self.scale = nn.Linear(4, 4), nn.Parameter(torch.tensor(2.0))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.lin(x) * self.scale

    model = Scaled()
    with pytest.raises(HvdkitError, match="0-dimensional one.*HINT: make it a 1-element tensor"):
        Zero3Strategy(LocalBackend(BackendConfig(name="local"))).wrap(model, torch.optim.SGD(model.parameters()))


def test_a_meta_built_gpt_is_made_into_shards_to_the_bits_of_the_whole_build():
    """wrap_meta makes each module's tensors and keeps each parameter's rows: the state it
    gives is the whole build's (apply_whole, the replicated path's), the tie kept, and no
    registered parameter holds data afterwards."""
    from hvdkit.models import build_model_lazily

    args = {"vocab_size": 96, "n_layer": 3, "n_embd": 128, "block_size": 32}
    whole = build_model_lazily(f"{MODELS}:gpt", seed=3, args=args)
    assert whole.init is not None
    whole.init.apply_whole(whole.model)
    lazy = build_model_lazily(f"{MODELS}:gpt", seed=3, args=args)
    assert lazy.init is not None
    strategy = Zero3Strategy(LocalBackend(BackendConfig(name="local")))
    model, opt = strategy.wrap_meta(lazy.model, torch.optim.AdamW(lazy.model.parameters()), lazy.init)
    assert model.head.weight is model.tok.weight
    assert all(p.numel() == 0 and not p.is_meta for p in model.parameters())
    assert not any(b.is_meta for b in model.buffers())
    got = strategy.module_state_dict(model)
    for name, want in whole.model.state_dict().items():
        value = got[name]
        assert torch.equal(value.fetch() if hasattr(value, "fetch") else value, want), name
    assert sum(p.numel() for g in opt.param_groups for p in g["params"]) == sum(
        p.numel() for p in whole.model.parameters())
    strategy.close()


def test_a_unit_of_two_dtypes_is_refused_in_one_line():
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4).to(torch.bfloat16))
    with pytest.raises(HvdkitError, match=r"2 dtypes \(torch.bfloat16, torch.float32\).*HINT: give its parameters"):
        Zero3Strategy(LocalBackend(BackendConfig(name="local"))).wrap(model, torch.optim.SGD(model.parameters()))
