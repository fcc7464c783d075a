"""GradPool: the host bytes that gradient accumulators may hold at once on the nvme tier ("gradient window").

With accumulation declared and no clipping, each block's gradient is consumed by its update during the last
backward (docs/design.md [Note: when a block may update early]), so the host needs gradient buffers only
for the blocks between their first gradient and the end of their update: a window, not the whole model.
An accumulator takes its bytes when its first gradient arrives and gives them back when its update is done
(grad_home.py). When the window is full the training thread waits for an update to
finish; when nothing could free bytes (no update queued or running) it goes over the budget rather than
deadlock, counted in `over_budget_events` (never wrong, reported by `engine.stats()`).
See docs/design.md [Note: the gradient window].
"""

from __future__ import annotations

import threading
from typing import Optional, Protocol

WAIT_SLICE_SECONDS = 0.05  # how often a waiting acquire re-checks whether anything can still free bytes


class Updates(Protocol):
    """Whoever gives bytes back: the step worker, while an update is queued or running."""

    def has_work(self) -> bool: ...

    def on_own_thread(self) -> bool:
        """Whether the caller is the worker itself (which must not wait for itself)."""
        ...


class GradPool:
    """A byte budget shared by the accumulators of one engine; thread-safe."""

    def __init__(self, budget_bytes: int) -> None:
        self.budget_bytes = budget_bytes
        self.in_use = 0
        self.peak = 0
        self.over_budget_events = 0
        self._changed = threading.Condition()
        self._updates: Optional[Updates] = None

    def bind(self, updates: Updates) -> None:
        """`updates.has_work()`: whether an update is queued or running, which will give bytes back."""
        self._updates = updates

    def acquire(self, nbytes: int, wait: bool = True) -> None:
        """Take `nbytes`, waiting while the window is full and an update will give some back (`wait=False`:
        the worker itself, which nothing else would free bytes for)."""
        with self._changed:
            updates: Optional[Updates] = None  # asked once, when the window is full: whether this thread may wait
            while self.in_use and self.in_use + nbytes > self.budget_bytes:
                if updates is None and wait and self._updates is not None and not self._updates.on_own_thread():
                    updates = self._updates
                if updates is None or not updates.has_work():
                    self.over_budget_events += 1
                    break
                self._changed.wait(WAIT_SLICE_SECONDS)
            self.in_use += nbytes
            self.peak = max(self.peak, self.in_use)

    def release(self, nbytes: int) -> None:
        with self._changed:
            self.in_use -= nbytes
            self._changed.notify_all()
