"""GradPool: the host bytes that gradient accumulators may hold at once on the nvme tier ("gradient window").

With accumulation declared and no clipping, each block's gradient is consumed by its update during the last
backward (docs/design.md [Note: when a block may update early]), so the host needs gradient buffers only
for the blocks between their first gradient and the end of their update: a window, not the whole model.
An accumulator takes its bytes when its first gradient arrives and gives them back when its update is done
(grad_home.py). When the window is full the training thread waits for an update to
finish; when nothing could free bytes (no update queued or running) it goes over the budget rather than
deadlock, counted in `over_budget_events` (never wrong, reported by `engine.stats()`).

A host buffer given back (`give_back`) stays with the pool as a spare, while the bytes in use and the spares fit
the budget, and the next `take_zeros` of its size reuses it: a fresh mapping costs a page fault per 4 KiB at its
first touch (1.2B parameters: 2.5 GB of bf16 gradients a step, ~2 s of faults on the training thread on this
VM), a reused one a memset. Spares are dropped (unmapped) as soon as the bytes in use need their room, so host
memory stays within the budget as before. See docs/design.md [Note: the gradient window].
"""

from __future__ import annotations

import threading
from typing import List, Optional, Protocol

import torch

from offload.tiers.mapped import mapped_zeros

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
        self._spares: List[torch.Tensor] = []  # buffers given back, their pages still mapped, for the next take

    def bind(self, updates: Updates) -> None:
        """`updates.has_work()`: whether an update is queued or running, which will give bytes back."""
        self._updates = updates

    def acquire(self, nbytes: int, wait: bool = True) -> None:
        """Take `nbytes`, waiting while the window is full and an update will give some back (`wait=False`:
        the worker itself, which nothing else would free bytes for)."""
        with self._changed:
            self._acquire_locked(nbytes, wait)
            self._note_peak_locked()

    def _acquire_locked(self, nbytes: int, wait: bool) -> None:
        updates: Optional[Updates] = None  # asked once, when the window is full: whether this thread may wait
        while self.in_use and self.in_use + nbytes > self.budget_bytes:
            if updates is None and wait and self._updates is not None and not self._updates.on_own_thread():
                updates = self._updates
            if updates is None or not updates.has_work():
                self.over_budget_events += 1
                break
            self._changed.wait(WAIT_SLICE_SECONDS)
        self.in_use += nbytes

    def _note_peak_locked(self) -> None:
        """`peak`: the most host bytes the window held, its buffers in use and its spares (both are mapped)."""
        self.peak = max(self.peak, self.in_use + self.spare_bytes)

    def release(self, nbytes: int) -> None:
        with self._changed:
            self.in_use -= nbytes
            self._changed.notify_all()

    def take_zeros(self, numel: int, dtype: torch.dtype, wait: bool = True) -> torch.Tensor:
        """A flat host buffer of zeros from the window (`acquire`'s wait): a spare of that size, zeroed, or a
        fresh mapping."""
        with self._changed:  # the bytes, the spare taken and the spares dropped at once: `peak` sees no overlap
            self._acquire_locked(numel * dtype.itemsize, wait)
            spare = next((i for i, t in enumerate(self._spares) if t.numel() == numel and t.dtype == dtype), None)
            buffer = self._spares.pop(spare) if spare is not None else None
            self._drop_spares_over_budget()
            self._note_peak_locked()
        return buffer.zero_() if buffer is not None else mapped_zeros(numel, dtype)

    def give_back(self, buffer: torch.Tensor) -> None:
        """A buffer of `take_zeros` back: its bytes to the window, the buffer kept as a spare if nothing else
        holds its memory (a view, a copy in flight) and the budget has room for it."""
        with self._changed:  # bytes back and the spare kept at once: a take woken by the bytes finds the spare
            self.in_use -= buffer.nbytes
            if _only_holder(buffer) and self.in_use + self.spare_bytes + buffer.nbytes <= self.budget_bytes:
                self._spares.append(buffer)
            self._changed.notify_all()

    @property
    def spare_bytes(self) -> int:
        return sum(t.nbytes for t in self._spares)

    def _drop_spares_over_budget(self) -> None:
        """Spares go (their mappings with them) while the bytes in use and the spares pass the budget."""
        while self._spares and self.in_use + self.spare_bytes > self.budget_bytes:
            self._spares.pop()


def _only_holder(buffer: torch.Tensor) -> bool:
    """Whether `buffer` is the one tensor on its memory (then nothing reads or writes it once it is given back).
    A torch without the count keeps no spare: every take maps fresh pages, as before spares."""
    use_count = getattr(torch._C, "_storage_Use_Count", None)
    if use_count is None:
        return False
    storage = buffer.untyped_storage()
    return use_count(storage._cdata) == 2  # `buffer`'s and `storage`'s own
