"""Side streams for a CPU device, so the event bookkeeping of the CUDA path runs in CI without a GPU.

`DeferredStreams` queues each copy on its stream and runs it only when something waits for it: an event's
`synchronize()` or `compute_wait()` runs the copies of that stream up to that event, in issue order, as a CUDA
stream completes them. So a reader that forgot to wait sees the bytes from before the copy, and tests fail.
With `eager=True` copies run when issued (events are then already complete), which catches a buffer written
again before the reader of its previous contents ran (the staging buffer of accumulated gradients).
"""

from __future__ import annotations

import threading
from typing import Callable, List, Optional

import torch
from torch import Tensor


class FakeEvent:
    def __init__(self, stream: "FakeStream") -> None:
        self.stream = stream
        self.done = False
        self.synchronized = 0

    def synchronize(self) -> None:
        self.synchronized += 1
        self.stream.run_until(self)


class FakeStream:
    def __init__(self, lock: threading.RLock) -> None:
        self._lock = lock
        self._queue: List[tuple] = []  # (event, copy), issue order

    def issue(self, copy: Callable[[], None], eager: bool) -> FakeEvent:
        event = FakeEvent(self)
        with self._lock:
            self._queue.append((event, copy))
            if eager:
                self.run_until(event)
        return event

    def run_until(self, event: Optional[FakeEvent]) -> None:
        with self._lock:
            if event is not None and event.done:
                return
            while self._queue:
                queued, copy = self._queue.pop(0)
                copy()
                queued.done = True
                if queued is event:
                    return


class DeferredStreams:
    """A `SideStreams` whose copies run when waited for (or at once with `eager`); counts what happened."""

    def __init__(self, eager: bool = False) -> None:
        self.eager = eager
        self._lock = threading.RLock()  # the update worker and the training thread both wait on events
        self.h2d_stream = FakeStream(self._lock)
        self.d2h_stream = FakeStream(self._lock)
        self.issued = 0
        self.compute_waits = 0

    def h2d(self, dst: Tensor, src: Tensor) -> FakeEvent:
        return self._issue(self.h2d_stream, dst, src)

    def d2h(self, dst: Tensor, src: Tensor) -> FakeEvent:
        return self._issue(self.d2h_stream, dst, src)

    def _issue(self, stream: FakeStream, dst: Tensor, src: Tensor) -> FakeEvent:
        needed = (dst.storage_offset() + dst.numel()) * dst.element_size()

        def copy() -> None:
            # A block evicted before its prefetch ran has a zero-byte storage: on CUDA the copy lands in memory
            # record_stream keeps from reuse; here it is dropped (writing would go out of bounds).
            if dst.untyped_storage().nbytes() >= needed:
                with torch.no_grad():
                    dst.copy_(src)

        self.issued += 1
        return stream.issue(copy, self.eager)

    def compute_wait(self, event: FakeEvent) -> None:
        self.compute_waits += 1
        event.stream.run_until(event)

    def synchronize(self) -> None:
        self.h2d_stream.run_until(None)
        self.d2h_stream.run_until(None)
