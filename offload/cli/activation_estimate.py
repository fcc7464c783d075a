"""`python -m offload estimate --seq-len N --micro-batch B`: the activations a GPT-style model saves for its
backward, where they live with and without `activations="offload"`, and how many tokens per micro-batch fit the
device memory the plan leaves.

The bytes are the usual estimate of what one transformer layer saves per micro-batch (Korthikanti et al., "Reducing
Activation Recomputation in Large Transformer Models", 2022): s*b*h*(34 + 5*a*s/h) bytes with 16-bit
activations and dropout (s tokens, b sequences, h width, a heads; the 5*a*s/h term is attention's s x s
scores, gone with a fused attention kernel), scaled by the compute dtype's size / 2; with activation
checkpointing a layer keeps only its input (2*s*b*h at 16 bits) and one layer's full set during its recompute.
An estimate: a model's own layers can save more or less (measure with `engine.stats()` after a step with
activations="offload": `activation_bytes_to_disk`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional


@dataclass(frozen=True)
class ActivationEstimate:
    """Saved-activation bytes of one micro-batch: per layer, in all, and what stays on the device."""

    per_layer: int  # everything one layer saves (without checkpointing), or its checkpoint (with)
    total: int  # all layers
    on_device_offloaded: int  # with activations="offload": about one layer's set (the one computing)
    recompute: int  # with checkpointing: one layer's full set during its recompute (0 without)

    @property
    def on_device_kept(self) -> int:
        """Without offload: every layer's saved tensors, plus a recompute's."""
        return self.total + self.recompute


def layer_bytes(tokens: int, dim: int, heads: int, seq_len: int, itemsize: int, fused_attention: bool) -> int:
    """What one transformer layer saves for its backward for `tokens` tokens (s*b) of sequences of `seq_len`."""
    scores = 0 if fused_attention else 5 * heads * seq_len
    return tokens * (34 * dim + scores) * itemsize // 2


def estimate_activations(layers: int, dim: int, heads: int, seq_len: int, micro_batch: int, itemsize: int,
                         checkpointing: bool, fused_attention: bool = False) -> ActivationEstimate:
    tokens = seq_len * micro_batch
    full = layer_bytes(tokens, dim, heads, seq_len, itemsize, fused_attention)
    if checkpointing:
        checkpoint = tokens * dim * itemsize
        return ActivationEstimate(checkpoint, layers * checkpoint, full, full)
    return ActivationEstimate(full, layers * full, full, 0)


def tokens_that_fit(room: int, layers: int, dim: int, heads: int, seq_len: int, itemsize: int, checkpointing: bool,
                    offloaded: bool, fused_attention: bool = False) -> int:
    """The most sequences of `seq_len` per micro-batch whose activations fit `room` bytes, in tokens."""
    one = estimate_activations(layers, dim, heads, seq_len, 1, itemsize, checkpointing, fused_attention)
    need = one.on_device_offloaded if offloaded else one.on_device_kept
    return max(room, 0) // max(need, 1) * seq_len


def describe(layers: int, dim: int, heads: int, seq_len: int, micro_batch: int, itemsize: int, checkpointing: bool,
             device_room: Optional[int], human: Callable[[Optional[int]], str], fused_attention: bool = True) -> str:
    """The estimate's lines for the CLI."""
    est = estimate_activations(layers, dim, heads, seq_len, micro_batch, itemsize, checkpointing, fused_attention)
    how = "with checkpointing, each layer's input" if checkpointing else "every layer's saved tensors"
    how += ", fused attention" if fused_attention else ", attention scores saved"
    lines = [f"activations of {micro_batch} x {seq_len} tokens ({how}; an estimate): {human(est.per_layer)} a layer, "
             f"{human(est.total)} in all",
             f"  kept (activations=None): {human(est.on_device_kept)} on the device; "
             f"activations='offload': about {human(est.on_device_offloaded)} on the device, "
             f"{human(est.total)} through the swap file each step"]
    if device_room is not None:
        kept = tokens_that_fit(device_room, layers, dim, heads, seq_len, itemsize, checkpointing, False, fused_attention)
        off = tokens_that_fit(device_room, layers, dim, heads, seq_len, itemsize, checkpointing, True, fused_attention)
        lines.append(f"  the device room the plan leaves ({human(device_room)}) holds the activations of "
                     f"{kept:,} tokens per micro-batch kept, {off:,} offloaded")
    return "\n".join(lines)
