"""The nvme staging ring's slots: `depth` host buffers leased once from the StagingPool, a free list, and
the lock and condition variable that guard it.

A slot holds one chunk: three fp32 sections (master, exp_avg, exp_avg_sq) of `chunk_numel` elements, then
room for the chunk's compute weights when its group's weights live on disk. Who holds a slot besides the free
list (a read ahead, a chunk being updated, a write in flight, a weight move, a checkpoint) is the ring's
business (offload/scheduler/disk_ring.py): the pool only hands slots out and takes them back. When none is
free, `take` asks the ring for its oldest write in flight and retires it; the ring's rules (its module doc)
make that always possible.

Thread safety: `lock` guards `free` and the ring's own bookkeeping (one lock, so the ring can take a slot and
register what it holds in one step); `take` and `give_back` take it themselves, and never wait on I/O under it.
"""

from __future__ import annotations

import contextlib
import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Iterator, List, Optional, Tuple

import torch
from torch import Tensor

from offload.errors import OffloadConfigError
from offload.planner import CHUNK_GRANULE, SLOT_BYTES_PER_ELEMENT, min_ring_bytes

if TYPE_CHECKING:
    from offload.tiers.host import HostBuffer, StagingPool


@dataclass
class Slot:
    index: int
    buffer: "HostBuffer"
    raw: Tensor  # all of the slot's bytes
    sections: Tuple[Tensor, Tensor, Tensor]  # fp32 views, `chunk_numel` elements each

    def weights(self, dtype: torch.dtype, numel: int) -> Tensor:
        """The slot's compute-weight area (after the three sections) as `numel` elements of `dtype`."""
        start = 3 * 4 * self.sections[0].numel()
        itemsize = torch.empty((), dtype=dtype).element_size()
        return self.raw[start:start + numel * itemsize].view(dtype)

    def cut(self, numel: int) -> Tuple[Tensor, Tensor, Tensor]:
        """The three sections' first `numel` elements: a chunk of that many elements in this slot."""
        master, exp_avg, exp_avg_sq = self.sections
        return master[:numel], exp_avg[:numel], exp_avg_sq[:numel]


class SlotPool:
    """`depth` slots leased once from `pool` (their total is at most `ring_bytes`), handed out and taken back.

    `oldest_write()` (called with `lock` held) names the ring's oldest write in flight, or None; `retire(it)`
    (called without the lock) waits for that write and gives its slot back. `take` uses them when no slot is
    free.
    """

    def __init__(self, pool: "StagingPool", ring_bytes: int, depth: int, oldest_write: Callable[[], Optional[object]],
                 retire: Callable[[object], None]) -> None:
        slot_bytes = ring_bytes // depth
        chunk = slot_bytes // SLOT_BYTES_PER_ELEMENT // CHUNK_GRANULE * CHUNK_GRANULE
        if chunk <= 0:
            raise OffloadConfigError(
                f"the nvme staging ring needs at least {min_ring_bytes(depth)} bytes of host_memory, got "
                f"{ring_bytes}; raise host_memory")
        self.chunk_numel = chunk
        self.depth = depth
        self.slots: List[Slot] = []
        for index in range(depth):
            buffer = pool.lease(SLOT_BYTES_PER_ELEMENT * chunk)
            raw = buffer.view(torch.uint8, (SLOT_BYTES_PER_ELEMENT * chunk,))
            flat = raw[:3 * 4 * chunk].view(torch.float32)
            sections = (flat[:chunk], flat[chunk:2 * chunk], flat[2 * chunk:])
            self.slots.append(Slot(index, buffer, raw, sections))
        self.free: List[Slot] = list(self.slots)  # guarded by `lock`
        self.lock = threading.Lock()
        self._slot_returned = threading.Condition(self.lock)
        self._oldest_write = oldest_write
        self._retire = retire

    def close(self) -> None:
        """Let go of the slots when every one is free (nothing reads or writes into them): their leases go back
        to the staging pool now, whatever still refers to this pool. Slots in use are kept (I/O may target
        them); they go with the pool."""
        with self.lock:
            if len(self.free) == len(self.slots):
                self.free.clear()
                self.slots.clear()

    def take(self) -> Slot:
        """A free slot; retires the oldest write when none is free (always possible, see disk_ring's module doc)."""
        while True:
            with self.lock:
                if not self.slots:
                    raise OffloadConfigError("the nvme staging ring is closed")
                if self.free:
                    return self.free.pop()
                oldest = self._oldest_write()
                if oldest is None:  # only reads ahead hold slots: wait for one to be consumed
                    self._slot_returned.wait(timeout=1.0)
                    continue
            self._retire(oldest)

    def give_back(self, slot: Slot) -> None:
        with self.lock:
            self.give_back_locked(slot)

    def give_back_locked(self, slot: Slot) -> None:
        """`give_back` for a caller that holds `lock`."""
        self.free.append(slot)
        self._slot_returned.notify_all()

    @contextlib.contextmanager
    def borrow(self, count: int = 1) -> Iterator[List[Tuple[Tensor, Tensor, Tensor]]]:
        """`count` slots' three fp32 sections (`chunk_numel` elements each), given back on exit (at most `depth`)."""
        slots = [self.take() for _ in range(min(count, self.depth))]
        try:
            yield [slot.sections for slot in slots]
        finally:
            for slot in slots:
                self.give_back(slot)

    def slot_of(self, tensor: Tensor) -> Slot:
        """The slot whose first section `tensor` starts (a chunk's master section, as `Slot.cut` made it)."""
        for slot in self.slots:
            if slot.sections[0].data_ptr() == tensor.data_ptr():
                return slot
        raise ValueError("not a view of a ring slot")
