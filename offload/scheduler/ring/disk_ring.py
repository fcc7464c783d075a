"""The nvme step pipeline: a bounded ring of staging slots through which disk-resident optimizer state flows.

An update of a disk-resident group goes chunk by chunk: `load` a chunk (its read usually issued earlier,
while the previous chunk was being updated), update it in the slot, `store` it (the write is issued and
left in flight). So the disk reads chunk i+1 and writes chunk i-1 while the CPU updates chunk i. Chunks
are element ranges of a record, at most one slot long: a record larger than a slot is processed in pieces,
never rejected. See docs/design.md [Note: the nvme step pipeline].

Ordering rules that keep it correct: a read of a range waits for the in-flight write of that range; a slot
is reused only after its write has completed; reads issued ahead never take the last slot that is neither
read-ahead nor free, so the chunk the worker needs next can always get a slot (no deadlock when the
announced order and the update order differ).
"""

from __future__ import annotations

import collections
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, ContextManager, Deque, Dict, List, Optional, Tuple

from torch import Tensor

from offload.io.future import IOFuture, wait_all
from offload.planner import (  # the planner sizes the ring; re-exported (`__all__`) for existing imports
    CHUNK_GRANULE, MAX_DEPTH, MIN_DEPTH, SLOT_BYTES_PER_ELEMENT, min_ring_bytes, ring_depth_for, ring_size_for)
from offload.scheduler.ring.weight_io import DiskWeightIO
from offload.scheduler.ring.ring_slots import Slot, SlotPool
from offload.trace import Tracer

if TYPE_CHECKING:
    from offload.scheduler.blocks.block import FlatGroup
    from offload.tiers.disk import SwapStore
    from offload.tiers.host import StagingPool

ChunkKey = Tuple[str, int]  # (the group's layout key, first element)


@dataclass
class _InFlight:
    slot: Slot
    group: "FlatGroup"
    start: int
    stop: int
    futures: List[IOFuture]


class DiskRing:
    """`depth` slots leased once from `pool` (their total is the ring budget, see ring_slots.SlotPool) and the
    chunk I/O in flight over them; the weight moves of disk-resident compute weights (disk_weight_io.py) share
    the slots.

    Thread safety: the engine's thread announces and the step worker loads and stores; one lock (the slot
    pool's) guards the bookkeeping, and waits on I/O happen outside it.
    """

    def __init__(self, store: "SwapStore", pool: "StagingPool", ring_bytes: int, depth: int = MIN_DEPTH,
                 tracer: Optional[Tracer] = None) -> None:
        self._tracer = tracer or Tracer()  # every wait for the disk is a "disk wait" span
        self._slots = SlotPool(pool, ring_bytes, depth, retire=self._finish_write,
                               oldest_write=lambda: self._writes[0] if self._writes else None)
        self.chunk_numel = self._slots.chunk_numel
        self.depth = depth
        self._store = store
        self._weight_io = DiskWeightIO(self, self._slots, store)
        self._reads: Dict[ChunkKey, _InFlight] = {}
        self._checked_out: Dict[ChunkKey, Optional[Slot]] = {}  # chunks being updated: from `load` to `store`
        self._writes: Deque[_InFlight] = collections.deque()
        self._announced: Deque[Tuple["FlatGroup", int, int]] = collections.deque()
        self._announced_keys: set = set()
        self._lock = self._slots.lock
        self._deferred: Optional[BaseException] = None  # a write error met on the training thread
        self.io_wait_seconds = 0.0
        self.chunks_loaded = 0
        self.chunks_read_ahead = 0

    # ----- chunks ------------------------------------------------------------------------------------
    @property
    def swap(self) -> "SwapStore":
        """The swap file this ring reads and writes."""
        return self._store

    def chunks(self, group: "FlatGroup") -> List[Tuple[int, int]]:
        """Element ranges [start, stop) covering the group's trainable range, each at most one slot."""
        n = group.trainable_numel
        return [(start, min(start + self.chunk_numel, n)) for start in range(0, n, self.chunk_numel)]

    def announce(self, groups: List["FlatGroup"], replace: bool = False) -> None:
        """These groups will be updated soon, in this order: read their chunks ahead as slots allow. A chunk
        already announced or read ahead is not announced again; `replace` drops earlier announcements not
        yet read (the order changed)."""
        with self._lock:
            if replace:
                self._announced.clear()
                self._announced_keys.clear()
            for group in groups:
                for a, b in self.chunks(group):
                    key = (group.key, a)
                    if key not in self._announced_keys and key not in self._reads:
                        self._announced.append((group, a, b))
                        self._announced_keys.add(key)
        self._read_ahead_deferring_errors()

    def _read_ahead_deferring_errors(self) -> None:
        """`_read_ahead` for the training thread: a failed write it reaps is kept for the worker's next `load`
        (or `drain`) to raise, so the error fails an update (and poisons the engine) instead of escaping
        from a hook in the middle of scheduling a step."""
        try:
            self._read_ahead()
        except Exception as exc:  # noqa: BLE001 - kept and raised on the worker
            self._defer(exc)

    def _defer(self, error: Exception) -> None:
        """Keep an error met on the training thread for the worker's next `load` (or `drain`) to raise."""
        with self._lock:
            self._deferred = self._deferred or error

    def _raise_deferred(self) -> None:
        with self._lock:
            error, self._deferred = self._deferred, None
        if error is not None:
            raise error

    # ----- the worker's side -------------------------------------------------------------------------
    def load(self, group: "FlatGroup", start: int, stop: int) -> Tuple[Tensor, Tensor, Tensor]:
        """Views (master, exp_avg, exp_avg_sq) of elements [start, stop) in a slot, read from disk; hand the
        slot back with `store` (or `abandon` on failure). When the group's compute weights live on disk,
        the slot's weight area (`weights_of`) is read too, and `store` writes it back."""
        self._raise_deferred()
        key = (group.key, start)
        with self._lock:  # [Note: checked out in the same step as taken] until `store` or `abandon`, no
            # read-ahead of this chunk may start (its bytes are about to change)
            entry = self._reads.pop(key, None)
            self._drop_announced(key)
            self._checked_out[key] = None if entry is None else entry.slot
        slot = None if entry is None else entry.slot
        try:
            if entry is None:
                slot = self._slots.take()
                with self._lock:
                    self._checked_out[key] = slot
                self._wait_writes_of(group, start, stop)
                entry = _InFlight(slot, group, start, stop, self._submit(False, slot, group, start, stop))
            self._wait(entry.futures)
        except BaseException:
            with self._lock:
                self._checked_out.pop(key, None)
            if slot is not None:
                self._slots.give_back(slot)
            raise
        self.chunks_loaded += 1
        self._read_ahead()
        return entry.slot.cut(stop - start)

    def store(self, group: "FlatGroup", start: int, stop: int, sections: Tuple[Tensor, Tensor, Tensor]) -> None:
        """Write the chunk `load` returned back to disk; the slot returns to the ring when the write is done."""
        slot = self._slots.slot_of(sections[0])
        with self._lock:  # submitted and registered at once: `_read_ahead` (other threads) must never see
            # this chunk without its write in flight, or it would read the old bytes (submitting never blocks)
            try:
                futures = self._submit(True, slot, group, start, stop)
            except BaseException:  # nothing of it is in flight (SwapStore.submit waits what it started)
                self._checked_out.pop((group.key, start), None)
                self._slots.give_back_locked(slot)
                raise
            self._writes.append(_InFlight(slot, group, start, stop, futures))
            self._checked_out.pop((group.key, start), None)
        self._read_ahead()

    def weights_of(self, sections: Tuple[Tensor, Tensor, Tensor], group: "FlatGroup") -> Optional[Tensor]:
        """The loaded chunk's compute weights (the update writes the new ones there), or None when the
        group's weights do not live on disk."""
        if group.key not in self._store.weights:
            return None
        return self._slots.slot_of(sections[0]).weights(group.dtype, sections[0].numel())

    def discard(self, group: "FlatGroup") -> None:
        """Forget this group's announced and read-ahead chunks (its update was skipped). Their slots come back
        once the reads finish; otherwise reads nobody consumes would hold slots and stall later loads."""
        with self._lock:
            keys = [(group.key, a) for a, _b in self.chunks(group)]
            entries = [self._reads.pop(key) for key in keys if key in self._reads]
            for key in keys:
                self._drop_announced(key)
        for entry in entries:
            try:
                self._wait(entry.futures)
            except Exception:
                pass  # the data is dropped; a later read of this range reports any error
            finally:
                self._slots.give_back(entry.slot)

    def borrow(self, count: int = 1) -> ContextManager[List[Tuple[Tensor, Tensor, Tensor]]]:
        """`count` slots' three fp32 sections (`chunk_numel` elements each) for a caller that moves a record
        itself (checkpoints), given back on exit: memory the ring already holds, so a checkpoint of any size
        needs none of its own. Use it after `drain()`, with no update running (at most the ring's depth)."""
        return self._slots.borrow(count)

    def abandon(self, sections: Tuple[Tensor, Tensor, Tensor]) -> None:
        """Return a loaded chunk's slot without writing it (its update failed: the disk keeps the old state)."""
        slot = self._slots.slot_of(sections[0])
        with self._lock:
            for key in [k for k, s in self._checked_out.items() if s is slot]:
                del self._checked_out[key]
        self._slots.give_back(slot)

    def write_fresh(self, group: "FlatGroup", fill) -> None:
        """Initialise the group's record chunk by chunk: `fill(start, stop, sections)` writes into the slot."""
        for start, stop in self.chunks(group):
            slot = self._slots.take()
            sections = slot.cut(stop - start)
            try:
                fill(start, stop, sections)
            except BaseException:
                self._slots.give_back(slot)
                raise
            self.store(group, start, stop, sections)

    def drain(self) -> None:
        """Wait for every write in flight and drop reads issued ahead; every slot is back when this returns,
        and the first error of any of them is raised at the end. For callers that change the swap file
        themselves (checkpoints) or release it (close)."""
        with self._lock:
            reads, self._reads = list(self._reads.values()), {}
            self._announced.clear()
            self._announced_keys.clear()
        first: Optional[BaseException] = None
        for entry in reads:
            try:
                self._wait(entry.futures)
            except BaseException as exc:
                first = first or exc
            finally:
                self._slots.give_back(entry.slot)
        try:
            self._finish_all_writes()
        except BaseException as exc:
            first = first or exc
        if first is not None:
            raise first
        self._raise_deferred()

    def close(self) -> None:
        """After `drain` (close): give the slots' host memory back to the staging pool now. The ring's objects
        refer to each other (cycles), so without this the memory would wait for a garbage collection."""
        self._slots.close()

    def flush_writes(self) -> None:
        """Wait for every write in flight (the swap file then holds the current state) and raise the first
        error of any of them. Reads issued ahead stay (by then only those of groups that got no update:
        their state does not change, so the reads stay valid); `drain` drops them."""
        self._finish_all_writes()
        self._raise_deferred()
        self._read_ahead_deferring_errors()  # announced chunks that waited for these writes

    def _finish_all_writes(self) -> None:
        """Wait for every write in flight, returning their slots; raise the first error after all are done."""
        first: Optional[BaseException] = None
        while True:
            with self._lock:
                if not self._writes:
                    break
                entry = self._writes[0]
            try:
                self._finish_write(entry)
            except BaseException as exc:
                first = first or exc
        if first is not None:
            raise first

    def stats(self) -> Dict[str, float]:
        """Chunk size, chunks updated, how many were read ahead, seconds the worker waited on the disk."""
        return {"nvme_chunk_numel": self.chunk_numel, "nvme_ring_slots": self.depth,
                "nvme_chunks_moved": self.chunks_loaded, "nvme_chunks_read_ahead": self.chunks_read_ahead,
                "nvme_io_wait_seconds": self.io_wait_seconds}

    # ----- compute weights on disk (disk_weight_io.py) -----------------------------------------------
    def read_weights(self, group: "FlatGroup", dst: Tensor, copy: Callable[[Tensor, Tensor], None]) -> None:
        self._weight_io.read_weights(group, dst, copy)

    def write_weights(self, group: "FlatGroup", src: Tensor) -> None:
        self._weight_io.write_weights(group, src)

    def start_weights_read(self, group: "FlatGroup", itemsize: int) -> Optional[list]:
        return self._weight_io.start_weights_read(group, itemsize)

    def finish_weights_read(self, handle: list, dst: Tensor, copy: Callable[[Tensor, Tensor], None]) -> None:
        self._weight_io.finish_weights_read(handle, dst, copy)

    def cancel_weights_read(self, handle: list) -> None:
        self._weight_io.cancel_weights_read(handle)

    # ----- internals ---------------------------------------------------------------------------------
    def _submit(self, write: bool, slot: Slot, group: "FlatGroup", start: int, stop: int) -> List[IOFuture]:
        weights = slot.weights(group.dtype, stop - start) if group.key in self._store.weights else None
        submit = self._store.write_chunk if write else self._store.read_chunk
        return submit(group, start, stop, slot.cut(stop - start), weights)

    def _finish_write(self, entry: _InFlight) -> None:
        """Wait for a write, then unregister it and return its slot. [Note: a write stays registered until it
        is done] `_read_ahead` on another thread checks `_writes` for overlaps: a write taken off the list
        while still in flight would let it read the chunk's old bytes. Exactly one thread unregisters an
        entry (by identity, under the lock), and only that one returns the slot."""
        try:
            self._wait(entry.futures)
        finally:
            with self._lock:
                index = next((i for i, w in enumerate(self._writes) if w is entry), None)
                if index is not None:
                    del self._writes[index]
            if index is not None:
                self._slots.give_back(entry.slot)

    def _writing(self, group: "FlatGroup") -> bool:
        """Whether a write of the group is in flight; the caller holds the lock."""
        return any(w.group is group for w in self._writes)

    def _wait_writes_of(self, group: "FlatGroup", start: int, stop: int) -> None:
        """A read of [start, stop) must see the last write of it: finish overlapping writes first."""
        with self._lock:
            overlapping = [w for w in self._writes if w.group is group and w.start < stop and start < w.stop]
        for entry in overlapping:
            self._finish_write(entry)

    def _reap_finished_writes(self) -> None:
        """Return the slots of writes that have completed (oldest first, never blocking); a failed write
        raises here, in whichever thread reaps it."""
        while True:
            with self._lock:
                if not self._writes or not all(f.done() for f in self._writes[0].futures):
                    return
                entry = self._writes[0]
            self._finish_write(entry)

    def _read_ahead(self) -> None:
        """Issue reads of announced chunks while a free slot remains beyond the one kept for the worker."""
        self._reap_finished_writes()
        while True:
            with self._lock:
                if not self._announced or len(self._slots.free) < 2:
                    return
                group, start, stop = self._announced[0]
                if (group.key, start) in self._checked_out or any(
                        w.group is group and w.start < stop and start < w.stop for w in self._writes):
                    return  # being updated, or its write still in flight: read it once the write is registered
                self._announced.popleft()
                key = (group.key, start)
                self._announced_keys.discard(key)
                slot = self._slots.free.pop()
                try:  # submitting does not block; under the lock, `load` never sees a read without futures
                    futures = self._submit(False, slot, group, start, stop)
                except BaseException:
                    self._slots.free.append(slot)
                    raise
                self._reads[key] = _InFlight(slot, group, start, stop, futures)
                self.chunks_read_ahead += 1

    def _drop_announced(self, key: ChunkKey) -> None:
        if key not in self._announced_keys:
            return
        self._announced_keys.discard(key)
        for item in self._announced:
            if (item[0].key, item[1]) == key:
                self._announced.remove(item)
                return

    def _wait(self, futures: List[IOFuture]) -> None:
        """Wait for every request of a chunk, then raise the first error: a slot is handed back only when
        the kernel no longer reads into or writes from it, even when one of its requests failed."""
        begin = time.perf_counter()
        try:
            with self._tracer.span("disk wait"):
                wait_all(futures)
        finally:
            self.io_wait_seconds += time.perf_counter() - begin


__all__ = ["DiskRing", "ChunkKey", "CHUNK_GRANULE", "SLOT_BYTES_PER_ELEMENT", "MIN_DEPTH", "MAX_DEPTH",
           "min_ring_bytes", "ring_size_for", "ring_depth_for"]
