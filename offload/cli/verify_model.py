"""The built-in model of `python -m offload verify`: a small GPT with the features that break offload
engines (tied embedding/output, a layer used twice per forward, a frozen layer), and its synthetic batches."""

from __future__ import annotations

from typing import Callable, Tuple

import torch
import torch.nn.functional as F
from torch import nn

VOCAB, DIM, LAYERS, CONTEXT, BATCH = 128, 64, 4, 32, 4


class _Layer(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.attn = nn.MultiheadAttention(dim, 4, bias=False, batch_first=True)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm1(x)
        mask = torch.triu(torch.ones(x.shape[1], x.shape[1], dtype=torch.bool, device=x.device), 1)
        x = x + self.attn(h, h, h, attn_mask=mask, need_weights=False)[0]
        return x + self.mlp(self.norm2(x))


class TinyGPT(nn.Module):
    """`forward(idx, targets)` returns the mean next-token cross-entropy."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.layers = nn.ModuleList(_Layer(DIM) for _ in range(LAYERS))
        self.norm = nn.LayerNorm(DIM)
        self.head = nn.Linear(DIM, VOCAB, bias=False)
        self.head.weight = self.embed.weight  # tied
        self.layers[1].requires_grad_(False)  # frozen

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        x = self.embed(idx)
        for layer in self.layers:
            x = layer(x)
        x = self.layers[-1](x)  # used twice
        logits = self.head(self.norm(x))
        return F.cross_entropy(logits.float().reshape(-1, VOCAB), targets.reshape(-1))


def tiny_gpt() -> Tuple[nn.Module, Callable[[int], tuple]]:
    """(model, batch_fn): the signature `python -m offload verify --model module:function` expects."""
    torch.manual_seed(0)
    model = TinyGPT()

    def batch(step: int) -> tuple:
        gen = torch.Generator().manual_seed(1000 + step)
        return (torch.randint(0, VOCAB, (BATCH, CONTEXT), generator=gen),
                torch.randint(0, VOCAB, (BATCH, CONTEXT), generator=gen))

    return model, batch
