"""A 16-bit gradient resting in the first moment its speculative update wrote (issue 35).

With exact clipping, a block's gradient must outlive its speculative update: if the global norm turns out above
the threshold, the update runs again, clipped, from the untouched state. Keeping every gradient until then costs
the nvme tier its staging ring (2.4 GiB of bf16 gradients at 1.2B parameters). But the speculative update wrote
what the gradient was: AdamW's first moment is m' = fma(1 - beta1, g - m, m), so fma(m' - m, 1 / (1 - beta1), m),
rounded to bf16 or fp16, is g for all but a few elements per hundred thousand, which the update's own pass finds
and keeps (csrc/adam/grad_rebuild.h). The old moment stays in the live record and the new one in the shadow until
the step commits or redoes the update, so the gradient can be given back to the window after the update and
rebuilt, bit for bit, for whatever reads it next: the redo, a `clip_grad_norm_` by call, the next micro-batch's
sum. See docs/design.md [Note: gradients resting in the moments].
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional

import torch
from torch import Tensor

from offload.optim.functional import rebuild_gradient
from offload.scheduler.state.adamw import RestingSpan
from offload.scheduler.state.disk_store import DiskStore


@dataclass(frozen=True)
class GradInMoments:
    """Where a group's gradient rests: its store's two copies of the first moment (`old_copy`: the one before
    the speculative update; the other holds the update's), the spans the update stepped and the elements the
    rebuild misses. Valid until either copy's first moment changes: the gradient is rebuilt before any update
    of the group (it reads its gradient first), and no checkpoint load replaces the state under a pending
    gradient (each refuses, or drops the gradients first, as `prepare_for_load` does)."""

    store: DiskStore
    old_copy: int
    spans: List[RestingSpan]

    @property
    def missed(self) -> int:
        """Elements the rebuild patches in."""
        return sum(span.miss_index.numel() for span in self.spans)

    @property
    def bytes_read(self) -> int:
        """What a rebuild reads from the swap file: two fp32 first moments of the group."""
        return 8 * self.store.group.trainable_numel

    def rebuild_into(self, grad: Tensor, num_threads: Optional[int] = None) -> None:
        """The gradient, bit for bit, into `grad` (the group's flat gradient; zero where no span stepped)."""
        if sum(span.hi - span.lo for span in self.spans) < grad.numel():
            grad.zero_()

        def into(start: int, stop: int, m_old: Tensor, m_new: Tensor) -> None:
            for span in self.spans:
                lo, hi = max(span.lo, start), min(span.hi, stop)
                if lo < hi:
                    rebuild_gradient(m_old[lo - start:hi - start], m_new[lo - start:hi - start], span.beta1,
                                     grad[lo:hi], num_threads)

        self.store.read_first_moments(self.old_copy, into)
        bits = grad.view(torch.int16)
        for span in self.spans:
            if span.miss_index.numel():
                bits[span.miss_index] = span.miss_bits
