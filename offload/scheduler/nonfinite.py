"""Non-finite gradients without clipping: a block whose gradients hold inf/NaN is not updated.

Without `max_grad_norm` blocks update during backward, before the other blocks' gradients exist, so the
check is per block: each block with a non-finite gradient keeps its weights, moments and step counts
(counted and warned once per step). A NaN or inf loss makes every gradient non-finite, so then every block
is skipped: the whole step is skipped. With clipping the global norm decides for the whole step instead
(engine._schedule_step).
"""

from __future__ import annotations

import math
import threading
import warnings
from typing import Optional, Set

import torch

from offload.optim.functional import sum_of_squares
from offload.scheduler.step import GroupState


def grads_finite(state: GroupState, num_threads: Optional[int] = None) -> bool:
    """Whether every accumulated gradient element of the group is finite: one read of the gradient (2-4 B
    per parameter, against ~30 B the Adam update moves), with the update's threads."""
    state.settle_grads()
    grad = state.grad[:state.group.trainable_numel]
    if grad.device.type == "cpu" and grad.dtype in (torch.float32, torch.bfloat16, torch.float16):
        return math.isfinite(sum_of_squares(grad, num_threads=num_threads))
    return bool(torch.isfinite(grad).all())


class NonFiniteSkips:
    """Counts blocks skipped for non-finite gradients, and the steps that had any; warns once per step."""

    def __init__(self) -> None:
        self.block_skips = 0
        self._steps: Set[int] = set()
        self._lock = threading.Lock()

    def record(self, step: int, block: str) -> None:
        with self._lock:
            self.block_skips += 1
            first = step not in self._steps
            self._steps.add(step)
        if first:
            warnings.warn(f"offload: optimizer step {step + 1}: non-finite gradients (inf/NaN); blocks with them "
                          f"(first: {block!r}) were not updated", RuntimeWarning)

    @property
    def steps(self) -> int:
        return len(self._steps)
