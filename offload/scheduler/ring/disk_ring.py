"""The nvme step pipeline: a bounded ring of staging slots through which disk-resident optimizer state flows.

An update of a disk-resident group goes chunk by chunk: `load` a chunk (its read usually issued earlier,
while the previous chunk was being updated), update it in the slot, `store` it (the write is issued and
left in flight). So the disk reads chunk i+1 and writes chunk i-1 while the CPU updates chunk i. Chunks
are element ranges of a record, at most one slot long: a record larger than a slot is processed in pieces,
never rejected. See docs/design.md [Note: the nvme step pipeline].

The pieces: `SlotPool` (ring_slots.py) holds the slots; `WriteOrder` (same file) owns the writes in flight
and the ordering rules (a read of a range waits for the in-flight write of that range; a slot is reused
only after its write has completed; reads ahead never take the last free slot, so the chunk the worker
needs next can always get one; a write error met on the training thread is raised on the worker). This
file keeps what only chunks have: announcements, reads ahead and the chunks checked out for an update;
`RecordMoves` (record_moves.py) moves disk-resident compute weights through the same slots and the same
`WriteOrder`. Neither path calls the other: the ring only hands the weight moves on.
"""

from __future__ import annotations

import contextlib
import functools
from typing import TYPE_CHECKING, Any, Callable, Dict, Iterator, List, Optional, Tuple

from torch import Tensor

from offload.io.future import wait_all
from offload.optim.moment_format import BlockLayout, MomentFormat
from offload.planner.ring import MIN_DEPTH
from offload.scheduler.ring.master_reads import MasterReads
from offload.scheduler.ring.record_moves import RecordMoves
from offload.scheduler.ring.ring_slots import (
    CHUNK_RECORDS,
    KEEP_FOR_LOAD,
    STATE_RECORD,
    ChunkKey,
    CleanChunk,
    InFlight,
    Slot,
    SlotPool,
    SlotSections,
    WriteOrder,
)
from offload.tiers.disk import ChunkSeals, RecordKind
from offload.trace import Tracer

if TYPE_CHECKING:
    from offload.io.future import IOFuture
    from offload.scheduler.blocks.block import FlatGroup
    from offload.tiers.disk import SwapStore
    from offload.tiers.host import StagingPool


class DiskRing:
    """`depth` slots leased once from `pool` (their total is the ring budget, see ring_slots.SlotPool) and the
    chunk I/O in flight over them, ordered by one `WriteOrder`; the weight moves of disk-resident compute
    weights (record_moves.py) share the slots and the order.

    Thread safety: the engine's thread announces and the step worker loads and stores; one lock (the slot
    pool's) guards the bookkeeping, and waits on I/O happen outside it.
    """

    def __init__(self, store: "SwapStore", pool: "StagingPool", ring_bytes: int, depth: int = MIN_DEPTH,
                 tracer: Optional[Tracer] = None, moments: MomentFormat = MomentFormat.FP32) -> None:
        self.moments = moments  # how the slots and the swap records keep the Adam moments
        self._slots = SlotPool(pool, ring_bytes, depth, moments)
        self._order = WriteOrder(self._slots, tracer)  # every wait for the disk is a "disk wait" span
        self._store = store
        self._weights = RecordMoves(self._slots, self._order, store, RecordKind.WEIGHTS)
        self._grads = RecordMoves(self._slots, self._order, store, RecordKind.GRADS)
        self.masters = MasterReads(self._slots, self._order, store, self.chunks)  # weights read from the master
        self._reads: Dict[ChunkKey, InFlight] = {}  # reads issued ahead, not yet loaded
        self._checked_out: Dict[ChunkKey, Optional[Slot]] = {}  # chunks being updated: from `load` to `store`
        self._announced: Dict[ChunkKey, Tuple["FlatGroup", int, int]] = {}  # to read ahead, in this order
        self.chunks_loaded = 0
        self.chunks_read_ahead = 0
        self.chunks_clean = 0  # loads and reads ahead served by a slot that still held the chunk: no read

    @property
    def chunk_numel(self) -> int:
        """Elements of one chunk: a slot's three sections (master, exp_avg, exp_avg_sq in the ring's moment format)
        hold this many each; as many as the slot's bytes allow in that format."""
        return self._slots.chunk_numel

    @property
    def depth(self) -> int:
        """How many slots the ring has."""
        return self._slots.depth

    @property
    def io_wait_seconds(self) -> float:
        """Seconds spent waiting for the disk (chunks and weight moves)."""
        return self._order.io_wait_seconds

    # ----- chunks ------------------------------------------------------------------------------------
    @property
    def swap(self) -> "SwapStore":
        """The swap file this ring reads and writes."""
        return self._store

    def chunks(self, group: "FlatGroup") -> List[Tuple[int, int]]:
        """Element ranges [start, stop) covering the group's trainable range, each at most one slot (int8: cut
        where the group's blocks start, with at most the slot's scales)."""
        n = group.trainable_numel
        blocks = self.blocks(group)
        if blocks is not None:
            return blocks.cuts(self.chunk_numel)
        return [(start, min(start + self.chunk_numel, n)) for start in range(0, n, self.chunk_numel)]

    def blocks(self, group: "FlatGroup") -> Optional[BlockLayout]:
        """The int8 block layout of the group's record (blocks start over at each parameter, or each parameter's
        part on this rank), told to the swap file on first use; None for fp32 and bf16 moments."""
        if self.moments is not MomentFormat.INT8:
            return None
        blocks = self._store.blocks.get(group.key)
        if blocks is None:
            blocks = self._store.blocks[group.key] = BlockLayout.of_segments(group.trainable_numel,
                                                                               group.trainable_segments)
        return blocks

    def _cut(self, slot: Slot, group: "FlatGroup", start: int, stop: int) -> SlotSections:
        """A slot's sections cut to the chunk [start, stop) of the group: its elements, and its blocks' scales."""
        blocks = self.blocks(group)
        return slot.cut(stop - start, None if blocks is None else blocks.scales_before(stop) - blocks.scales_before(start))

    def announce(self, groups: List["FlatGroup"], replace: bool = False) -> None:
        """These groups will be updated soon, in this order: read their chunks ahead as slots allow. A chunk
        already announced or read ahead is not announced again; `replace` drops earlier announcements not
        yet read (the order changed)."""
        with self._slots.lock:
            if replace:
                self._announced.clear()
            for group in groups:
                for a, b in self.chunks(group):
                    key = (group.key, a)
                    if key not in self._announced and key not in self._reads:
                        self._announced[key] = (group, a, b)
        with self._order.deferring_errors():  # the training thread: errors fail the worker's next load
            self._read_ahead()

    def reading_order(self, keys: List[str]) -> List[str]:
        """Of these groups, those with chunks read ahead and not yet loaded (in flight or done), in the order
        the first of each group's reads was issued."""
        wanted = set(keys)
        with self._slots.lock:  # `_reads` is in issue order
            return list(dict.fromkeys(key for key, _start in self._reads if key in wanted))

    # ----- the worker's side -------------------------------------------------------------------------
    def load(self, group: "FlatGroup", start: int, stop: int) -> SlotSections:
        """Views (master, exp_avg, exp_avg_sq) of elements [start, stop) in a slot, read from disk; hand the
        slot back with `store` (or `abandon` on failure). When the group's compute weights live on disk,
        the slot's weight area (`weights_of`) is read too, and `store` writes it back."""
        self._order.raise_deferred()
        key = (group.key, start)
        with self._slots.lock:  # [Note: checked out in the same step as taken] until `store` or `abandon`,
            # no read-ahead of this chunk may start (its bytes are about to change)
            entry = self._reads.pop(key, None)
            self._announced.pop(key, None)
            self._checked_out[key] = None if entry is None else entry.slot
        slot = None if entry is None else entry.slot
        try:
            if entry is None:
                self._order.wait_for_writes_of(group, CHUNK_RECORDS, start, stop)  # its slot may then hold the chunk
                with self._slots.lock:
                    slot = self._take_clean_locked(group, start, stop)
                    self._checked_out[key] = slot
                if slot is not None:
                    entry = InFlight(slot, group, CHUNK_RECORDS, start, stop, [])
                else:
                    slot = self._order.take()
                    with self._slots.lock:
                        self._checked_out[key] = slot
                    entry = InFlight(slot, group, CHUNK_RECORDS, start, stop, self._read_chunk(slot, group, start, stop))
            self._order.wait(entry.futures)
        except BaseException:
            with self._slots.lock:
                self._checked_out.pop(key, None)
            if slot is not None:
                self._slots.give_back(slot)
            raise
        self.chunks_loaded += 1
        self._read_ahead()
        return self._cut(entry.slot, group, start, stop)

    def store(self, group: "FlatGroup", start: int, stop: int, sections: SlotSections, shadow: bool = False,
              seals: Optional[ChunkSeals] = None) -> None:
        """Write the chunk `load` returned back to disk (to the group's shadow copy: `shadow`, a speculative
        update); the slot returns to the ring when the write is done. `seals`: the checksums of the state's pieces
        and of the compute weights' (when they move with the chunk), computed by the update, else the swap file
        computes them."""
        slot = self._slots.slot_of(sections[0])
        with self._slots.lock:  # submitted and registered at once: `_read_ahead` (other threads) must never
            # see this chunk without its write in flight, or it would read the old bytes (submitting never blocks)
            try:
                futures = self._write_chunk(slot, group, start, stop, shadow, seals)
            except BaseException:  # nothing of it is in flight (`_chunk_io` waits what it started)
                self._checked_out.pop((group.key, start), None)
                self._slots.give_back_locked(slot)
                raise
            self._slots.forget_clean_locked((group.key, start))
            clean = None if shadow or group.key in self._store.weights else CleanChunk((group.key, start), stop)
            self._order.register_locked(InFlight(slot, group, CHUNK_RECORDS, start, stop, futures, clean))
            self._checked_out.pop((group.key, start), None)
        self._read_ahead()

    def read_first_moments(self, group: "FlatGroup", old_copy: int,
                           into: Callable[[int, int, Tensor, Tensor], None]) -> None:
        """The first moment of the group's two state copies, chunk by chunk: `into(start, stop, m_old, m_new)`
        gets the one of copy `old_copy` (0 or 1, `SwapStore.live_copy`) and the other's, read into a slot's two
        moment areas (fp32 moments only), after the writes in flight of the group. What a gradient resting in
        the moments is rebuilt from (records/grad_in_moments.py); the master weights and second moments are not
        read."""
        assert self.moments is MomentFormat.FP32
        self._order.wait_for_writes_of(group, STATE_RECORD, 0, group.numel)
        live = self._store.live_copy(group.key)
        for start, stop in self.chunks(group):
            slot = self._order.take()
            try:
                _master, old, new = self._cut(slot, group, start, stop)
                futures = [self._store.read(RecordKind.STATE, group.key, start, (None, old, None),
                                            shadow=old_copy != live)]
                futures.append(self._store.read(RecordKind.STATE, group.key, start, (None, new, None),
                                                shadow=old_copy == live))
                self._order.wait(futures)
                into(start, stop, old, new)  # type: ignore[arg-type]
            finally:
                self._slots.give_back(slot)

    def weights_of(self, sections: SlotSections, group: "FlatGroup") -> Optional[Tensor]:
        """The loaded chunk's compute weights (the update writes the new ones there), or None when the
        group's weights do not live on disk."""
        if group.key not in self._store.weights:
            return None
        return self._slots.slot_of(sections[0]).weights(group.dtype, sections[0].numel())

    def discard(self, group: "FlatGroup") -> None:
        """Forget this group's announced and read-ahead chunks (its update was skipped). Their slots come back
        once the reads finish; otherwise reads nobody consumes would hold slots and stall later loads."""
        with self._slots.lock:
            keys = [(group.key, a) for a, _b in self.chunks(group)]
            entries = [self._reads.pop(key) for key in keys if key in self._reads]
            for key in keys:
                self._announced.pop(key, None)
        for entry in entries:
            try:
                self._order.wait(entry.futures)
            except Exception:  # noqa: BLE001, S110 - the data is dropped; a later read of the range reports it
                pass
            finally:
                self._slots.give_back(entry.slot)

    def commit_shadow(self, group: "FlatGroup") -> None:
        """The group's shadow copies in the swap file (a speculative update's state, and its weights when they
        live on disk) become its live ones: the reads ahead of its old copies are dropped, then the swap file
        switches copies (no byte moved)."""
        self.discard(group)
        with self._slots.lock:  # slots holding the old copy's chunks no longer stand for the live record
            for start, _stop in self.chunks(group):
                self._slots.forget_clean_locked((group.key, start))
        self._store.flip(group.key)

    @contextlib.contextmanager
    def borrow(self, count: int = 1) -> Iterator[List[SlotSections]]:
        """`count` slots' three sections (`chunk_numel` elements each, in the ring's moment format) for a caller that moves a record
        itself (checkpoints), given back on exit: memory the ring already holds, so a checkpoint of any size
        needs none of its own. Use it after `drain()`, with no update running (at most the ring's depth)."""
        slots = [self._order.take() for _ in range(min(count, self.depth))]
        try:
            yield [slot.sections for slot in slots]
        finally:
            for slot in slots:
                self._slots.give_back(slot)

    def abandon(self, sections: SlotSections) -> None:
        """Return a loaded chunk's slot without writing it (its update failed: the disk keeps the old state)."""
        slot = self._slots.slot_of(sections[0])
        with self._slots.lock:
            for key in [k for k, s in self._checked_out.items() if s is slot]:
                del self._checked_out[key]
        self._slots.give_back(slot)

    def write_fresh(self, group: "FlatGroup", fill: Callable[[int, int, SlotSections], None]) -> None:
        """Initialise the group's record chunk by chunk: `fill(start, stop, sections)` writes into the slot."""
        for start, stop in self.chunks(group):
            slot = self._order.take()
            sections = self._cut(slot, group, start, stop)
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
        with self._slots.lock:
            reads, self._reads = list(self._reads.values()), {}
            self._announced.clear()
            self._slots.forget_clean_locked()  # the caller may change the swap file itself
        first: Optional[BaseException] = None
        for entry in reads:
            try:
                self._order.wait(entry.futures)
            except BaseException as exc:  # noqa: B902 - raised below, once every slot is back
                first = first or exc
            finally:
                self._slots.give_back(entry.slot)
        try:
            self._order.retire_all()
        except BaseException as exc:  # noqa: B902 - raised below
            first = first or exc
        with self._slots.lock:
            self._slots.forget_clean_locked()  # the writes just retired left their chunks behind
        if first is not None:
            raise first
        self._order.raise_deferred()

    def close(self) -> None:
        """After `drain` (close): give the slots' host memory back to the staging pool now, not whenever the
        last reference to the ring (a store, a weight home) goes."""
        self._slots.close()

    def flush_writes(self) -> None:
        """Wait for every write in flight (the swap file then holds the current state) and raise the first
        error of any of them. Reads issued ahead stay (by then only those of groups that got no update:
        their state does not change, so the reads stay valid); `drain` drops them."""
        self._order.retire_all()
        self._order.raise_deferred()
        with self._order.deferring_errors():
            self._read_ahead()  # announced chunks that waited for these writes

    def stats(self) -> Dict[str, float]:
        """Chunk size, chunks updated, how many were read ahead, seconds the worker waited on the disk."""
        return {"nvme_chunk_numel": self.chunk_numel, "nvme_ring_slots": self.depth,
                "nvme_chunks_moved": self.chunks_loaded, "nvme_chunks_read_ahead": self.chunks_read_ahead,
                "nvme_chunks_clean": self.chunks_clean,
                "nvme_io_wait_seconds": self.io_wait_seconds}

    @property
    def weights(self) -> RecordMoves:
        """The moves of disk-resident compute weights through this ring's slots, in its write order."""
        return self._weights

    @property
    def grads(self) -> RecordMoves:
        """The moves of spilled gradients through this ring's slots, in its write order."""
        return self._grads

    # ----- internals ---------------------------------------------------------------------------------
    def _take_clean_locked(self, group: "FlatGroup", start: int, stop: int) -> Optional[Slot]:
        """The free slot that still holds the chunk's live bytes (its last write is done), or None; counted."""
        slot = self._slots.pop_clean_locked((group.key, start), stop)
        if slot is not None:
            self.chunks_clean += 1
        return slot

    def _read_chunk(self, slot: Slot, group: "FlatGroup", start: int, stop: int) -> List["IOFuture"]:
        return self._chunk_io(self._store.read, slot, group, start, stop)

    def _write_chunk(self, slot: Slot, group: "FlatGroup", start: int, stop: int, shadow: bool,
                     seals: Optional[ChunkSeals] = None) -> List["IOFuture"]:
        state, weights = seals if seals is not None else (None, None)
        extra = tuple({} if crcs is None else {"crcs": crcs} for crcs in (state, weights))
        return self._chunk_io(functools.partial(self._store.write, shadow=shadow), slot, group, start, stop,
                              (extra[0], extra[1]))

    def _chunk_io(self, move: Callable[..., "IOFuture"], slot: Slot, group: "FlatGroup", start: int,
                  stop: int, extra: Tuple[Dict[str, Any], Dict[str, Any]] = ({}, {})) -> List["IOFuture"]:
        """A chunk's state in one request, and its compute weights in another when they live on disk (they
        move with the chunk); the first's I/O is finished before an error of the second's submission leaves.
        `extra`: keyword arguments of `move` for the state's request and the weights'."""
        futures = [move(RecordKind.STATE, group.key, start, self._cut(slot, group, start, stop), **extra[0])]
        weights = self._weight_area(slot, group, start, stop)
        if weights is not None:
            try:
                futures.append(move(RecordKind.WEIGHTS, group.key, start, weights, **extra[1]))
            except BaseException:
                wait_all(futures)
                raise
        return futures

    def _weight_area(self, slot: Slot, group: "FlatGroup", start: int, stop: int) -> Optional[Tensor]:
        """The slot's room for the chunk's compute weights when they live on disk (they move with the chunk)."""
        return slot.weights(group.dtype, stop - start) if group.key in self._store.weights else None

    def _read_ahead(self) -> None:
        """Issue reads of announced chunks, in order, while `WriteOrder.take_ahead_locked` lends a slot (never
        the last free one) and the chunk is neither checked out nor being written."""
        self._order.reap()
        while True:
            with self._slots.lock:
                if not self._announced:
                    return
                key, (group, start, stop) = next(iter(self._announced.items()))
                if key in self._checked_out:
                    return  # being updated: read it once its write is registered and done
                clean = self._take_clean_locked(group, start, stop) if len(self._slots.free) > KEEP_FOR_LOAD else None
                if clean is not None:  # no read: the slot still holds the chunk
                    del self._announced[key]
                    self._reads[key] = InFlight(clean, group, CHUNK_RECORDS, start, stop, [])
                    continue
                taken = self._order.take_ahead_locked(1, group, CHUNK_RECORDS, start, stop)
                if taken is None:
                    return  # no slot to spare, or its write still in flight
                del self._announced[key]
                slot = taken[0]
                try:  # submitting does not block; under the lock, `load` never sees a read without futures
                    futures = self._read_chunk(slot, group, start, stop)
                except BaseException:
                    self._slots.give_back_locked(slot)
                    raise
                self._reads[key] = InFlight(slot, group, CHUNK_RECORDS, start, stop, futures)
                self.chunks_read_ahead += 1
