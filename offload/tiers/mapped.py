"""Host buffers that give their memory back to the system when freed: one anonymous mapping each.

Buffers the engine allocates and frees every step (a streamed block's device buffer on a machine without a
GPU, a windowed gradient accumulator) would otherwise come from glibc's heap, which keeps freed chunks of a
few MiB in the process (its dynamic mmap threshold moves them there), and RSS would outgrow the budgets.
"""

from __future__ import annotations

import mmap

import torch


def mapped_storage(nbytes: int) -> torch.UntypedStorage:
    """Zero-filled bytes in a mapping of their own, unmapped when the storage dies."""
    return torch.frombuffer(mmap.mmap(-1, max(nbytes, 1)), dtype=torch.uint8).untyped_storage()


def mapped_zeros(numel: int, dtype: torch.dtype) -> torch.Tensor:
    """A flat CPU tensor of zeros (fresh anonymous pages read as zero) in a mapping of its own."""
    return torch.empty(0, dtype=dtype).set_(mapped_storage(numel * dtype.itemsize), 0, (numel,), (1,))
