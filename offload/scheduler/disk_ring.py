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
import contextlib
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Deque, Dict, Iterator, List, Optional, Tuple

import torch
from torch import Tensor

from offload.errors import OffloadConfigError
from offload.io.future import IOFuture, wait_all

if TYPE_CHECKING:
    from offload.scheduler.block import FlatGroup
    from offload.tiers.disk import SwapStore
    from offload.tiers.host import HostBuffer, StagingPool

ChunkKey = Tuple[int, int]  # (id of the group, first element)
CHUNK_GRANULE = 2048  # elements: 8 KiB of fp32 and 4 KiB of bf16, so every chunk is an aligned request
SLOT_BYTES_PER_ELEMENT = 16  # the state, and room for compute weights (<= 4 bytes) of blocks whose weights are on disk
MIN_DEPTH = 4  # read i+1, update i, write i-1, and one spare so a write can finish while the next read starts
MAX_DEPTH = 8  # [Note: ring depth] more slots let the forward read ahead more of the coming backward's state


def min_ring_bytes(depth: int = MIN_DEPTH) -> int:
    """The smallest ring that works: `depth` slots of one granule each."""
    return depth * CHUNK_GRANULE * SLOT_BYTES_PER_ELEMENT


@dataclass
class _Slot:
    index: int
    buffer: "HostBuffer"
    raw: Tensor  # all of the slot's bytes
    sections: Tuple[Tensor, Tensor, Tensor]  # fp32 views, `chunk_numel` elements each

    def weights(self, dtype: torch.dtype, numel: int) -> Tensor:
        """The slot's compute-weight area (after the three sections) as `numel` elements of `dtype`."""
        start = 3 * 4 * self.sections[0].numel()
        itemsize = torch.empty((), dtype=dtype).element_size()
        return self.raw[start:start + numel * itemsize].view(dtype)


@dataclass
class _InFlight:
    slot: _Slot
    group: "FlatGroup"
    start: int
    stop: int
    futures: List[IOFuture]


class DiskRing:
    """`depth` slots leased once from `pool` (their total is the ring budget) and the I/O in flight over them.

    Thread safety: the engine's thread announces and the step worker loads and stores; one lock guards the
    bookkeeping, and waits on I/O happen outside it.
    """

    def __init__(self, store: "SwapStore", pool: "StagingPool", ring_bytes: int, depth: int = MIN_DEPTH) -> None:
        slot_bytes = ring_bytes // depth
        chunk = slot_bytes // SLOT_BYTES_PER_ELEMENT // CHUNK_GRANULE * CHUNK_GRANULE
        if chunk <= 0:
            raise OffloadConfigError(
                f"the nvme staging ring needs at least {min_ring_bytes(depth)} bytes of host_memory, got "
                f"{ring_bytes}; raise host_memory")
        self.chunk_numel = chunk
        self.depth = depth
        self._store = store
        self._slots: List[_Slot] = []
        for index in range(depth):
            buffer = pool.lease(SLOT_BYTES_PER_ELEMENT * chunk)
            raw = buffer.view(torch.uint8, (SLOT_BYTES_PER_ELEMENT * chunk,))
            flat = raw[:3 * 4 * chunk].view(torch.float32)
            sections = (flat[:chunk], flat[chunk:2 * chunk], flat[2 * chunk:])
            self._slots.append(_Slot(index, buffer, raw, sections))
        self._free: List[_Slot] = list(self._slots)
        self._reads: Dict[ChunkKey, _InFlight] = {}
        self._checked_out: Dict[ChunkKey, Optional[_Slot]] = {}  # chunks being updated: from `load` to `store`
        self._writes: Deque[_InFlight] = collections.deque()
        self._announced: Deque[Tuple["FlatGroup", int, int]] = collections.deque()
        self._announced_keys: set = set()
        self._lock = threading.Lock()
        self._slot_returned = threading.Condition(self._lock)
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
                    key = (id(group), a)
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
            with self._lock:
                self._deferred = self._deferred or exc

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
        key = (id(group), start)
        with self._lock:  # [Note: checked out in the same step as taken] until `store` or `abandon`, no
            # read-ahead of this chunk may start (its bytes are about to change)
            entry = self._reads.pop(key, None)
            self._drop_announced(key)
            self._checked_out[key] = None if entry is None else entry.slot
        slot = None if entry is None else entry.slot
        try:
            if entry is None:
                slot = self._take_slot()
                with self._lock:
                    self._checked_out[key] = slot
                self._wait_writes_of(group, start, stop)
                entry = _InFlight(slot, group, start, stop, self._submit(False, slot, group, start, stop))
            self._wait(entry.futures)
        except BaseException:
            with self._lock:
                self._checked_out.pop(key, None)
            if slot is not None:
                self._give_back(slot)
            raise
        self.chunks_loaded += 1
        self._read_ahead()
        return _cut(entry.slot, stop - start)

    def store(self, group: "FlatGroup", start: int, stop: int, sections: Tuple[Tensor, Tensor, Tensor]) -> None:
        """Write the chunk `load` returned back to disk; the slot returns to the ring when the write is done."""
        slot = self._slot_of(sections[0])
        with self._lock:  # submitted and registered at once: `_read_ahead` (other threads) must never see
            # this chunk without its write in flight, or it would read the old bytes (submitting never blocks)
            try:
                futures = self._submit(True, slot, group, start, stop)
            except BaseException:  # nothing of it is in flight (SwapStore.submit waits what it started)
                self._checked_out.pop((id(group), start), None)
                self._free.append(slot)
                self._slot_returned.notify_all()
                raise
            self._writes.append(_InFlight(slot, group, start, stop, futures))
            self._checked_out.pop((id(group), start), None)
        self._read_ahead()

    def weights_of(self, sections: Tuple[Tensor, Tensor, Tensor], group: "FlatGroup") -> Optional[Tensor]:
        """The loaded chunk's compute weights (the update writes the new ones there), or None when the
        group's weights do not live on disk."""
        if id(group) not in self._store.weights:
            return None
        return self._slot_of(sections[0]).weights(group.dtype, sections[0].numel())

    def read_weights(self, group: "FlatGroup", dst: Tensor, copy: Callable[[Tensor, Tensor], None]) -> None:
        """Read the group's disk-resident compute weights, slot by slot, and `copy(dst_piece, staged)` each."""
        self._move_weights(False, group, dst, copy)

    def write_weights(self, group: "FlatGroup", src: Tensor) -> None:
        """Write the group's compute weights (all of `src`) to its weight record, through the slots."""
        self._move_weights(True, group, src, lambda staged, piece: staged.copy_(piece))

    def start_weights_read(self, group: "FlatGroup", itemsize: int) -> Optional[list]:
        """Issue reads of the group's disk-resident weights into free slots without blocking (a prefetch);
        None when that would take the ring's last free slots or a write of the group is still in flight.
        Complete it with `finish_weights_read`, or `cancel_weights_read`."""
        try:
            self._reap_finished_writes()
        except Exception as exc:  # noqa: BLE001 - a prefetch is optional: keep the error for the worker
            with self._lock:
                self._deferred = self._deferred or exc
            return None
        per_slot = self.chunk_numel * SLOT_BYTES_PER_ELEMENT // itemsize
        pieces = [(a, min(a + per_slot, group.numel)) for a in range(0, group.numel, per_slot)]
        with self._lock:
            if len(self._free) < len(pieces) + 2 or any(w.group is group for w in self._writes):
                return None
            taken = []
            for start, stop in pieces:
                slot = self._free.pop()
                staged = slot.raw[:(stop - start) * itemsize].view(group.dtype)
                taken.append((slot, start, stop, staged, self._store.submit_weights(False, group, start, staged)))
        return taken

    def finish_weights_read(self, handle: list, dst: Tensor, copy: Callable[[Tensor, Tensor], None]) -> None:
        try:
            for _slot, start, stop, staged, future in handle:
                self._wait([future])
                copy(dst[start:stop], staged)
        finally:
            self.cancel_weights_read(handle)

    def discard(self, group: "FlatGroup") -> None:
        """Forget this group's announced and read-ahead chunks (its update was skipped). Their slots come back
        once the reads finish; otherwise reads nobody consumes would hold slots and stall later loads."""
        with self._lock:
            keys = [(id(group), a) for a, _b in self.chunks(group)]
            entries = [self._reads.pop(key) for key in keys if key in self._reads]
            for key in keys:
                self._drop_announced(key)
        for entry in entries:
            try:
                self._wait(entry.futures)
            except Exception:
                pass  # the data is dropped; a later read of this range reports any error
            finally:
                self._give_back(entry.slot)

    def cancel_weights_read(self, handle: list) -> None:
        """Return a prefetch's slots (after its reads are done: the kernel writes into them)."""
        for slot, _start, _stop, _staged, future in handle:
            try:
                future.result()
            except Exception:
                pass  # a failed prefetch is dropped; the synchronous read reports the error
            finally:
                self._give_back(slot)
        handle.clear()

    def _move_weights(self, write: bool, group: "FlatGroup", tensor: Tensor, copy) -> None:
        self._wait_writes_of(group, 0, group.numel)
        # Writes go in the updates' chunks, so each piece they seal is one an update's read covers whole and
        # verifies; reads take a slot's worth at a time (several sealed pieces, each verified).
        per_slot = self.chunk_numel * SLOT_BYTES_PER_ELEMENT // tensor.element_size()
        per_piece = self.chunk_numel if write else per_slot
        for start in range(0, group.numel, per_piece):
            stop = min(start + per_piece, group.numel)
            slot = self._take_slot()
            try:
                staged = slot.raw[:(stop - start) * tensor.element_size()].view(tensor.dtype)
                if write:
                    copy(staged, tensor[start:stop])
                future = self._store.submit_weights(write, group, start, staged)
                self._wait([future])
                if not write:
                    copy(tensor[start:stop], staged)
            finally:
                self._give_back(slot)

    @contextlib.contextmanager
    def borrow(self, count: int = 1) -> Iterator[List[Tuple[Tensor, Tensor, Tensor]]]:
        """`count` slots' three fp32 sections (`chunk_numel` elements each) for a caller that moves a record
        itself (checkpoints), given back on exit: memory the ring already holds, so a checkpoint of any size
        needs none of its own. Use it after `drain()`, with no update running (at most the ring's depth)."""
        slots = [self._take_slot() for _ in range(min(count, self.depth))]
        try:
            yield [slot.sections for slot in slots]
        finally:
            for slot in slots:
                self._give_back(slot)

    def abandon(self, sections: Tuple[Tensor, Tensor, Tensor]) -> None:
        """Return a loaded chunk's slot without writing it (its update failed: the disk keeps the old state)."""
        slot = self._slot_of(sections[0])
        with self._lock:
            for key in [k for k, s in self._checked_out.items() if s is slot]:
                del self._checked_out[key]
        self._give_back(slot)

    def write_fresh(self, group: "FlatGroup", fill) -> None:
        """Initialise the group's record chunk by chunk: `fill(start, stop, sections)` writes into the slot."""
        for start, stop in self.chunks(group):
            slot = self._take_slot()
            sections = _cut(slot, stop - start)
            try:
                fill(start, stop, sections)
            except BaseException:
                self._give_back(slot)
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
                self._give_back(entry.slot)
        try:
            self._finish_all_writes()
        except BaseException as exc:
            first = first or exc
        if first is not None:
            raise first
        self._raise_deferred()

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

    # ----- internals ---------------------------------------------------------------------------------
    def _submit(self, write: bool, slot: _Slot, group: "FlatGroup", start: int, stop: int) -> List[IOFuture]:
        weights = slot.weights(group.dtype, stop - start) if id(group) in self._store.weights else None
        return self._store.submit(write, group, start, stop, _cut(slot, stop - start), weights)

    def _take_slot(self) -> _Slot:
        """A free slot; retires the oldest write when none is free (always possible, see the module doc)."""
        while True:
            with self._lock:
                if self._free:
                    return self._free.pop()
                oldest = self._writes[0] if self._writes else None
                if oldest is None:  # only reads ahead hold slots: wait for one to be consumed
                    self._slot_returned.wait(timeout=1.0)
                    continue
            self._finish_write(oldest)

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
                self._give_back(entry.slot)

    def _give_back(self, slot: _Slot) -> None:
        with self._lock:
            self._free.append(slot)
            self._slot_returned.notify_all()

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
                if not self._announced or len(self._free) < 2:
                    return
                group, start, stop = self._announced[0]
                if (id(group), start) in self._checked_out or any(
                        w.group is group and w.start < stop and start < w.stop for w in self._writes):
                    return  # being updated, or its write still in flight: read it once the write is registered
                self._announced.popleft()
                key = (id(group), start)
                self._announced_keys.discard(key)
                slot = self._free.pop()
                try:  # submitting does not block; under the lock, `load` never sees a read without futures
                    futures = self._submit(False, slot, group, start, stop)
                except BaseException:
                    self._free.append(slot)
                    raise
                self._reads[key] = _InFlight(slot, group, start, stop, futures)
                self.chunks_read_ahead += 1

    def _drop_announced(self, key: ChunkKey) -> None:
        if key not in self._announced_keys:
            return
        self._announced_keys.discard(key)
        for item in self._announced:
            if (id(item[0]), item[1]) == key:
                self._announced.remove(item)
                return

    def _slot_of(self, tensor: Tensor) -> _Slot:
        for slot in self._slots:
            if slot.sections[0].data_ptr() == tensor.data_ptr():
                return slot
        raise ValueError("not a view of a ring slot")

    def _wait(self, futures: List[IOFuture]) -> None:
        """Wait for every request of a chunk, then raise the first error: a slot is handed back only when
        the kernel no longer reads into or writes from it, even when one of its requests failed."""
        begin = time.perf_counter()
        try:
            wait_all(futures)
        finally:
            self.io_wait_seconds += time.perf_counter() - begin


def _cut(slot: _Slot, numel: int) -> Tuple[Tensor, Tensor, Tensor]:
    master, exp_avg, exp_avg_sq = slot.sections
    return master[:numel], exp_avg[:numel], exp_avg_sq[:numel]


PREFERRED_SLOT_BYTES = 32 << 20  # large enough that per-chunk overhead vanishes, small enough to pipeline


def _preferred_slot_bytes(largest_record_numel: int) -> int:
    """A slot that holds the largest record whole (one chunk per update), up to PREFERRED_SLOT_BYTES."""
    granules = -(-max(largest_record_numel, 1) // CHUNK_GRANULE)
    unit = CHUNK_GRANULE * SLOT_BYTES_PER_ELEMENT
    return max(min(granules * unit, PREFERRED_SLOT_BYTES) // unit, 1) * unit


def ring_size_for(largest_record_numel: int) -> "RingSize":
    """The least ring that works and the one worth having for records of up to `largest_record_numel`."""
    from offload.planner import RingSize

    return RingSize(min_ring_bytes(), MAX_DEPTH * _preferred_slot_bytes(largest_record_numel))


def ring_depth_for(ring_bytes: int, largest_record_numel: int) -> int:
    """How many slots a ring of `ring_bytes` gets: as many preferred-size slots as fit, MIN..MAX_DEPTH (a
    small ring keeps MIN_DEPTH smaller slots: a record is then simply more chunks)."""
    return max(MIN_DEPTH, min(MAX_DEPTH, ring_bytes // _preferred_slot_bytes(largest_record_numel)))
