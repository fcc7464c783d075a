"""A tiny GPT for the engine tests: every feature that breaks offload engines, in 60 lines.

Tied embedding and output weights, LayerNorm computed in fp32, a frozen layer, the last layer applied twice
in one forward, and optional activation checkpointing (reentrant or not) around each layer call.
"""

from __future__ import annotations

from typing import List, Optional

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint


class FP32LayerNorm(nn.LayerNorm):
    """LayerNorm whose maths runs in fp32 whatever the input dtype."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x.float(), self.normalized_shape, self.weight.float(), self.bias.float(),
                            self.eps).to(x.dtype)


class Layer(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = FP32LayerNorm(dim), FP32LayerNorm(dim)
        # No qkv bias: the key bias has an exactly zero true gradient (softmax is shift-invariant), so its
        # gradient is rounding noise that Adam scales up to +-lr; any two correct Adam kernels differ there.
        self.qkv, self.proj = nn.Linear(dim, 3 * dim, bias=False), nn.Linear(dim, dim)
        self.fc, self.out = nn.Linear(dim, 4 * dim), nn.Linear(4 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        att = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, d)
        x = x + self.proj(att)
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class TinyGPT(nn.Module):
    """`forward(idx, targets)` returns the mean cross-entropy loss."""

    def __init__(self, vocab: int = 64, dim: int = 32, layers: int = 3, context: int = 16, heads: int = 2,
                 checkpointing: Optional[str] = None) -> None:
        super().__init__()
        self.checkpointing = checkpointing  # None, "reentrant" or "non_reentrant"
        self.wte, self.wpe = nn.Embedding(vocab, dim), nn.Embedding(context, dim)
        self.h = nn.ModuleList(Layer(dim, heads) for _ in range(layers))
        self.ln_f = FP32LayerNorm(dim)
        self.lm_head = nn.Linear(dim, vocab, bias=False)
        self.lm_head.weight = self.wte.weight  # tied
        self.h[1].requires_grad_(False)  # a frozen layer

    def _run(self, layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
        if self.checkpointing is None:
            return layer(x)
        return checkpoint(layer, x, use_reentrant=self.checkpointing == "reentrant")

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1], device=idx.device))
        for layer in self.h:
            x = self._run(layer, x)
        x = self._run(self.h[-1], x)  # the last layer used twice in one forward
        logits = self.lm_head(self.ln_f(x))
        return F.cross_entropy(logits.float().view(-1, logits.shape[-1]), targets.view(-1))


def largest_param_bytes(model: nn.Module) -> int:
    """The room `wrap()` keeps in a device budget for autograd's largest gradient (planner: device_grad_bytes),
    for tests that size device_memory to a plan."""
    return max(p.numel() * p.element_size() for p in model.parameters())


GRAD_ROOM = largest_param_bytes(TinyGPT())  # TinyGPT's largest: a 32x128 MLP matrix in fp32 (16 KiB)


def make_batches(steps: int, micro: int, batch: int = 4, context: int = 16, vocab: int = 64, seed: int = 0):
    """Synthetic token batches: [steps][micro] of (idx, targets)."""
    gen = torch.Generator().manual_seed(seed)
    return [[(torch.randint(0, vocab, (batch, context), generator=gen),
              torch.randint(0, vocab, (batch, context), generator=gen)) for _ in range(micro)] for _ in range(steps)]


def train_micro_batches(engine, steps) -> List[float]:
    """One optimizer step per list of (idx, targets) micro-batches, their gradients summed, zeroed after the step;
    the losses. Synchronized at the end."""
    losses = []
    for micro_batches in steps:
        for idx, tgt in micro_batches:
            loss = engine(idx, tgt)
            loss.backward()
            losses.append(loss.item())
        engine.step()
        engine.zero_grad()
    engine.synchronize()
    return losses


def train_steps(engine, batches) -> List[float]:
    """One optimizer step per (idx, targets) batch, gradients zeroed after each; the losses. Synchronized at the end."""
    losses = []
    for idx, tgt in batches:
        loss = engine(idx, tgt)
        loss.backward()
        engine.step()
        engine.zero_grad()
        losses.append(loss.item())
    engine.synchronize()
    return losses


def one_intraop_thread():
    """Generator for an autouse fixture: these models are too small to gain from intra-op threads, and on
    a shared 2-core machine an OpenMP team spinning against other processes makes tests 5-10x slower."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
