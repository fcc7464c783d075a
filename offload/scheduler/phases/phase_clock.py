"""Wall time of the wrapped model's forward and backward passes, for `engine.stats()`.

With the update worker's seconds and its waits for the disk, it says where a step's time goes (NEEDS.md P6:
users of other offload engines cannot tell whether the GPU, the CPU step or the disk is the bottleneck).
"""

from __future__ import annotations

import time
from typing import Optional

from offload.scheduler.torch_internals import after_backward


class PhaseClock:
    """Accumulates forward seconds (outermost call of the root module, including no_grad evaluation) and
    backward seconds (from the first gradient of the module's outputs to the end of that autograd graph task)."""

    def __init__(self) -> None:
        self.forward_seconds = 0.0
        self.backward_seconds = 0.0
        self._depth = 0
        self._forward_start = 0.0
        self._backward_task: Optional[int] = None
        self._backward_start = 0.0

    def forward_begins(self) -> None:
        if self._depth == 0:
            self._forward_start = time.perf_counter()
        self._depth += 1

    def forward_ends(self) -> None:
        self._depth = max(0, self._depth - 1)
        if self._depth == 0:
            self.forward_seconds += time.perf_counter() - self._forward_start

    def backward_begins(self, graph_task: int) -> None:
        """Called from a gradient hook on the module's outputs (so inside the backward pass)."""
        if graph_task == self._backward_task:
            return
        self._backward_task = graph_task
        self._backward_start = time.perf_counter()
        after_backward(self._backward_ends)

    def _backward_ends(self) -> None:
        self.backward_seconds += time.perf_counter() - self._backward_start
        self._backward_task = None
