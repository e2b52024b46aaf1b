"""A model's blocks: the units that ``--shard full`` gathers one at a time and that
``--activation-checkpointing`` recomputes (torchtitan's transformer block, for both).

A block is an entry of an ``nn.ModuleList``/``nn.Sequential`` (transformer layers, ResNet
stages' blocks, a residual MLP's layers).

* An FSDP unit (:func:`shard_units`) is an outermost block that holds at least
  :data:`MIN_BLOCK_PARAMS` parameters and shares none of them with a module outside it
  (a block inside a unit is gathered with it). Smaller blocks stay in their parent:
  each unit costs an all-gather in forward and in backward and a reduce-scatter, and on a
  model of 198 small tensors one unit per layer measured 11.6x DDP's step time (2 ranks,
  gloo). A parameter used outside its block (a head tied to the embedding) keeps that block
  out: FSDP2 cannot split one parameter between two units, so tied parameters stay with the
  root, and every other block is still its own unit.
* A recomputed block (:func:`checkpoint_activations`) is any entry that has modules of its
  own (a lone ``Linear`` or activation is not worth a recomputation), the outermost only.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from typing import Any

from torch import nn

__all__ = ["MIN_BLOCK_PARAMS", "shard_units", "recomputed_blocks", "checkpoint_activations"]

MIN_BLOCK_PARAMS = 100_000


def _entries(model: nn.Module) -> Iterator[tuple[str, nn.Module]]:
    """(dotted name + ".", module) of every entry of every ModuleList/Sequential, parents first."""
    for prefix, container in model.named_modules():
        if isinstance(container, (nn.ModuleList, nn.Sequential)):
            for key, block in container.named_children():
                yield (f"{prefix}.{key}." if prefix else f"{key}."), block


def shard_units(model: nn.Module) -> list[nn.Module]:
    """The outermost blocks, which FSDP2 shards on their own (in reverse order); the root,
    sharded last, takes the rest. Only the outermost: a block inside a unit is gathered with
    it (as torchtitan shards a transformer block whole), which halves the collectives of a
    GPT block whose MLP's Linears would qualify too."""
    names: dict[int, set[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), set()).add(name)
    found = []
    for inside, block in _entries(model):
        params = list(block.parameters())
        if sum(p.numel() for p in params) >= MIN_BLOCK_PARAMS \
                and all(n.startswith(inside) for p in params for n in names[id(p)]):
            found.append(block)
    return list(reversed(_outermost(found)))


def _outermost(found: list[nn.Module]) -> list[nn.Module]:
    """``found`` without duplicates and without any module inside another of them."""
    inner = {id(m) for b in found for m in b.modules() if m is not b}
    return list({id(b): b for b in found if id(b) not in inner}.values())


def recomputed_blocks(model: nn.Module) -> list[nn.Module]:
    """The blocks ``--activation-checkpointing`` recomputes: the outermost entries that hold
    modules of their own."""
    return _outermost([block for _, block in _entries(model) if next(block.children(), None) is not None])


def checkpoint_activations(model: nn.Module) -> int:
    """Recompute each outermost block's activations in backward instead of keeping them
    (``torch.utils.checkpoint``, non-reentrant: it keeps the RNG state, so dropout draws the
    same mask, and the gradients are the same bits). Done in place, before sharding, on the
    module itself (not a wrapper: the ``state_dict`` names stay the model's own). Returns the
    number of blocks."""
    from torch.utils.checkpoint import checkpoint

    outer = recomputed_blocks(model)

    def recomputed(forward: Any, *args: Any, **kwargs: Any) -> Any:
        return checkpoint(forward, *args, use_reentrant=False, **kwargs)

    for block in outer:
        block.forward = functools.partial(recomputed, block.forward)  # type: ignore[method-assign]
    return len(outer)
