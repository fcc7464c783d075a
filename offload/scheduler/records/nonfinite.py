"""Non-finite gradients without clipping: a block whose gradients hold inf/NaN is not updated.

Without `max_grad_norm` blocks update during backward, before the other blocks' gradients exist, so the
check is per block: each block with a non-finite gradient keeps its weights, moments and step counts
(counted and warned once per step). A NaN or inf loss makes every gradient non-finite, so then every block
is skipped: the whole step is skipped. With clipping the global norm decides for the whole step instead
(StepPipeline.schedule_step). The check itself is GradHome.all_finite.
"""

from __future__ import annotations

import threading
import warnings
from typing import Set


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
                          f"(first: {block!r}) were not updated", RuntimeWarning, stacklevel=2)

    def reset(self) -> None:
        """A checkpoint's counts replace these (they include its skips)."""
        with self._lock:
            self.block_skips = 0
            self._steps.clear()

    @property
    def steps(self) -> int:
        return len(self._steps)
