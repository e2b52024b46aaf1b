"""Blocks: FSDP2 units for a model with tied weights, and --activation-checkpointing, which
must give the same bits on every backend and sharding mode while keeping fewer activations."""

from __future__ import annotations

import subprocess
import sys
from typing import Any

import pytest
import torch
from torch import nn

from helpers import HVDKIT, ROOT, base_env, check, read_metrics
from hvdkit.blocks import checkpoint_activations, shard_units
from hvdkit.models import build_model

MODELS = str(ROOT / "examples" / "models.py")


def gpt(**args: Any) -> nn.Module:
    """The shipped example GPT (its head tied to the embedding), as --model loads it."""
    return build_model(f"{MODELS}:gpt", args=args)


TRAIN = ["--model", "mlp", "--num-samples", "512", "--batch-size", "16", "--optimizer", "adamw",
         "--lr", "0.002", "--log-every", "0", "--epochs", "1"]


def test_a_tied_gpt_is_sharded_block_by_block_with_the_tied_weights_in_the_root():
    model = gpt(vocab_size=96, n_layer=3, n_embd=256)  # its MLP's Linears (262k) would qualify: inside a unit
    assert shard_units(model) == list(reversed(list(model.blocks)))  # tok and the tied head stay in the root
    # a block whose weight is used outside it cannot be a unit of its own; the others still are
    model.blocks[1].attn.proj.weight = model.blocks[2].attn.proj.weight
    assert shard_units(model) == [model.blocks[2].mlp[2], model.blocks[2].mlp[0], model.blocks[1].mlp[2],
                                  model.blocks[1].mlp[0], model.blocks[0]]  # their untied insides still are
    # too small to pay for its own gathers: with its parent
    assert shard_units(gpt(vocab_size=96, n_layer=2, n_embd=32)) == []


def test_fully_shard_makes_each_gpt_block_its_own_unit():
    """Real FSDP2 on a 1-rank gloo group (its own process: the group is process-wide)."""
    code = """
import sys, tempfile, torch, torch.distributed as dist
from torch.distributed.fsdp import FSDPModule
from hvdkit.backends.fsdp import shard_model
from hvdkit.models import build_model
dist.init_process_group("gloo", init_method="file://" + tempfile.mktemp(), rank=0, world_size=1)
model = build_model(sys.argv[1] + ":gpt", args={"vocab_size": 96, "n_layer": 3})
model, opt = shard_model(model, torch.optim.AdamW(model.parameters()))
units = [name for name, m in model.named_modules() if isinstance(m, FSDPModule)]
assert units == ["", "blocks.0", "blocks.1", "blocks.2"], units
assert model.head.weight is model.tok.weight  # still tied, in the root's unit
model(torch.randint(0, 96, (2, 16))).sum().backward()
opt.step()
dist.destroy_process_group()
print("ok")
"""
    proc = subprocess.run([sys.executable, "-c", code, MODELS], env=base_env(),
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stdout + proc.stderr


def _grads(model: nn.Module, x: torch.Tensor, seed: int = 3) -> tuple[list[torch.Tensor], torch.Tensor]:
    torch.manual_seed(seed)  # dropout's masks
    loss = model(x).float().square().mean()
    loss.backward()
    return [p.grad.clone() for p in model.parameters()], loss.detach()


@pytest.mark.parametrize("name", ["gpt", "mlp"])
def test_activation_checkpointing_gives_the_same_bits_and_keeps_the_names(name):
    """In one process, dropout on: recomputed blocks draw the same masks (the RNG state is
    kept), so the loss and every gradient are bit for bit those without it."""
    def build() -> nn.Module:
        return gpt(vocab_size=96, n_layer=3, dropout=0.2) if name == "gpt" else build_model("mlp")

    x = torch.randint(0, 96, (4, 32)) if name == "gpt" else torch.randn(8, 64)
    plain, recomputed = build(), build()
    names = list(recomputed.state_dict())
    assert checkpoint_activations(recomputed) == (3 if name == "gpt" else 48)
    assert list(recomputed.state_dict()) == names  # no wrapper in the names: checkpoints unchanged
    want, want_loss = _grads(plain, x)
    got, got_loss = _grads(recomputed, x)
    assert torch.equal(got_loss, want_loss)
    assert all(torch.equal(a, b) for a, b in zip(got, want))


def test_activation_checkpointing_keeps_fewer_activations():
    """What it is for: the autograd graph holds only each block's input, not its insides."""
    from torch.autograd.graph import saved_tensors_hooks

    def saved_bytes(model: nn.Module) -> int:
        total = [0]

        def pack(t: torch.Tensor) -> torch.Tensor:
            total[0] += t.numel() * t.element_size()
            return t

        with saved_tensors_hooks(pack, lambda t: t):
            model(torch.randint(0, 96, (4, 64))).sum()
        return total[0]

    plain, recomputed = gpt(vocab_size=96, n_layer=4), gpt(vocab_size=96, n_layer=4)
    checkpoint_activations(recomputed)
    assert saved_bytes(recomputed) < saved_bytes(plain) / 3


def test_a_model_without_blocks_is_said_to_recompute_nothing():
    assert checkpoint_activations(build_model("tiny")) == 0


def _run(tmp_path, name: str, backend: str, shard: str, *extra: str) -> tuple[dict, str]:
    metrics = tmp_path / f"{name}.json"
    proc = subprocess.run([*HVDKIT, "run", "-np", "2", "--backend", backend, "--log-dir", str(tmp_path),
                           "--", *TRAIN, "--shard", shard, "--metrics-file", str(metrics), *extra],
                          env=base_env(), capture_output=True, text=True, timeout=200)
    check(proc)
    return read_metrics(metrics), proc.stdout + proc.stderr


@pytest.mark.mp
@pytest.mark.timeout(600)  # measured 35 s (2 cores)
def test_activation_checkpointing_ends_on_the_same_bits_in_every_mode(tmp_path):
    """2 ranks: with --activation-checkpointing every sharding mode of both backends ends on the
    bits of the plain unsharded run (sharded equals unsharded at 2 ranks, test_shard.py, and
    the two backends add two gradients alike)."""
    ref, _ = _run(tmp_path, "plain", "ddp", "none")
    for backend, shard in [("ddp", "none"), ("ddp", "full"), ("horovod", "none"), ("horovod", "optimizer"),
                           ("horovod", "full")]:
        got, out = _run(tmp_path, f"ac-{backend}-{shard}", backend, shard, "--activation-checkpointing")
        assert "activation checkpointing: 48 block(s) of --model mlp recomputed in backward" in out, out[-2000:]
        assert got["param_digest"] == ref["param_digest"] and got["final_loss"] == ref["final_loss"], (backend, shard)


def test_activation_checkpointing_of_a_model_without_blocks_is_one_warning(tmp_path):
    proc = subprocess.run([*HVDKIT, "train", "--backend", "local", "--model", "tiny", "--num-samples", "64",
                           "--max-steps", "1", "--activation-checkpointing"],
                          env=base_env(), capture_output=True, text=True, timeout=120)
    check(proc)
    warning = [ln for ln in (proc.stdout + proc.stderr).splitlines()
               if "activation" in ln and "memory:" not in ln]  # the preflight's estimate names activations too
    assert len(warning) == 1 and "--model tiny has no block to recompute" in warning[0], warning
