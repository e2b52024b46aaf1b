"""Models hvdkit has never seen, used by import path: ``--model examples/models.py:gpt``.

Plain PyTorch, nothing to subclass: a function returning an ``nn.Module`` is all ``--model``
needs; ``--model-arg key=value`` passes its keyword arguments.

* :func:`digits_cnn`: a small CNN for scikit-learn's 8x8 digits (``hvdkit data import-digits``).
* :func:`gpt`: a character-level GPT in the style of nanoGPT (causal self-attention, pre-norm
  blocks, tied embeddings) for ``hvdkit data import-text``; it returns logits (N, T, vocab),
  so train it with ``--task language-model``.
"""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.nn import functional as F


def digits_cnn(num_classes: int = 10, channels: int = 1, width: int = 32, dropout: float = 0.1) -> nn.Module:
    """Two 3x3 conv blocks and a linear head; about 60k parameters at width 32."""
    return nn.Sequential(
        nn.Conv2d(channels, width, 3, padding=1), nn.BatchNorm2d(width), nn.ReLU(),
        nn.Conv2d(width, 2 * width, 3, padding=1), nn.BatchNorm2d(2 * width), nn.ReLU(),
        nn.MaxPool2d(2),                                   # 8x8 -> 4x4
        nn.Flatten(), nn.Dropout(dropout), nn.Linear(2 * width * 16, num_classes),
    )


class CausalSelfAttention(nn.Module):
    def __init__(self, n_embd: int, n_head: int, dropout: float) -> None:
        super().__init__()
        assert n_embd % n_head == 0, "n_embd must divide by n_head"
        self.qkv = nn.Linear(n_embd, 3 * n_embd)
        self.proj = nn.Linear(n_embd, n_embd)
        self.n_head, self.dropout = n_head, dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(x).split(c, dim=2)
        q, k, v = (z.view(b, t, self.n_head, c // self.n_head).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                           dropout_p=self.dropout if self.training else 0.0)
        return self.proj(y.transpose(1, 2).reshape(b, t, c))


class Block(nn.Module):
    def __init__(self, n_embd: int, n_head: int, dropout: float) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(n_embd), nn.LayerNorm(n_embd)
        self.attn = CausalSelfAttention(n_embd, n_head, dropout)
        self.mlp = nn.Sequential(nn.Linear(n_embd, 4 * n_embd), nn.GELU(), nn.Linear(4 * n_embd, n_embd),
                                 nn.Dropout(dropout))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    """Token and position embeddings, ``n_layer`` pre-norm blocks, a head tied to the embedding."""

    def __init__(self, vocab_size: int, block_size: int = 64, n_layer: int = 4, n_head: int = 4,
                 n_embd: int = 128, dropout: float = 0.0) -> None:
        super().__init__()
        self.block_size = block_size
        self.tok = nn.Embedding(vocab_size, n_embd)
        self.pos = nn.Embedding(block_size, n_embd)
        self.drop = nn.Dropout(dropout)
        self.blocks = nn.Sequential(*[Block(n_embd, n_head, dropout) for _ in range(n_layer)])
        self.ln = nn.LayerNorm(n_embd)
        self.head = nn.Linear(n_embd, vocab_size, bias=False)
        self.head.weight = self.tok.weight  # weight tying (Press & Wolf)
        self.n_layer = n_layer
        for name, module in self.named_modules():
            self.hvdkit_init(name, module)

    def hvdkit_init(self, name: str, module: nn.Module) -> None:
        """Initialise ``module``'s own tensors: GPT-2's normal(0, 0.02), its residual projections
        scaled by 1/sqrt(2 n_layer), LayerNorms at one and zero.

        The constructor calls it for every module; hvdkit calls it too, once per module in
        ``named_modules()`` order, which lets it build this model on the meta device and make
        it one module at a time (``--shard full``: no rank ever holds it whole).
        """
        if isinstance(module, (nn.Linear, nn.Embedding)):
            residual = name.endswith(("attn.proj", "mlp.2"))  # GPT-2's scaled init of residual projections
            nn.init.normal_(module.weight, mean=0.0, std=0.02 / math.sqrt(2 * self.n_layer) if residual else 0.02)
            if isinstance(module, nn.Linear) and module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.LayerNorm):
            module.reset_parameters()

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        t = idx.shape[1]
        if t > self.block_size:
            raise ValueError(f"sequence of {t} tokens is longer than block_size {self.block_size}")
        x = self.drop(self.tok(idx) + self.pos(torch.arange(t, device=idx.device)))
        return self.head(self.ln(self.blocks(x)))


def gpt(vocab_size: int, block_size: int = 64, n_layer: int = 4, n_head: int = 4, n_embd: int = 128,
        dropout: float = 0.0) -> GPT:
    """A character GPT; at the defaults about 0.8M parameters (plus the vocabulary's). The return
    annotation is what tells hvdkit it may build it on the meta device (GPT.hvdkit_init)."""
    return GPT(vocab_size, block_size, n_layer, n_head, n_embd, dropout)
