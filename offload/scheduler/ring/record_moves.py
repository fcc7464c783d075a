"""Reads and writes of a group's arrays on disk, through the nvme ring's slots: its compute weights, or its
spilled gradient.

When the plan puts a block's weights on disk, every fetch reads them from the swap file and every update's
new weights are written back; when gradients spill, a gradient that must wait is written to its record and
read back for the next micro-batch or the update. Both go through the staging ring's slots
(ring_slots.SlotPool), a slot's worth at a time. They follow the ring's ordering rules, which live in one object
shared with the chunk path (ring_slots.WriteOrder): a read or write of a group's record first retires the ring's
writes of that record in flight, slots come from `WriteOrder.take`, a prefetch takes its slots with
`take_ahead_locked` (never the ring's last free slots, so the chunk the step worker needs next can always get
one), and an error a prefetch meets on the training thread is kept for the worker. This class knows nothing of the chunk path (disk_ring.py),
which only hands these moves on.

Thread safety: the pool's lock guards the free list and the writes in flight; a prefetch checks both and
takes its slots in one step under it. Waits on I/O happen outside it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable, List, NamedTuple, Optional, Tuple

from torch import Tensor

from offload.io.future import wait_all
from offload.scheduler.ring.ring_slots import KEEP_FOR_LOAD, InFlight, Records
from offload.tiers.disk import RecordKind

if TYPE_CHECKING:
    from offload.io.future import IOFuture
    from offload.scheduler.blocks.block import FlatGroup
    from offload.scheduler.ring.ring_slots import Slot, SlotPool, WriteOrder
    from offload.tiers.disk import SwapStore

# A prefetch leaves one more slot free than a chunk's read ahead: the worker's next `load`, and one chunk read
# ahead of it, so prefetching weights on the training thread never stops the update's reads from overlapping.
KEEP_FOR_CHUNKS = KEEP_FOR_LOAD + 1


class PieceRead(NamedTuple):
    """One piece of a prefetch: a slot, the elements [start, stop) it receives as `staged`, and its read."""

    slot: "Slot"
    start: int
    stop: int
    staged: Tensor
    future: "IOFuture"


class RecordMoves:
    """The moves of one kind of array record (`RecordKind.WEIGHTS` or `GRADS`) over `slots`, ordered after the
    state's writes by `order`."""

    def __init__(self, slots: "SlotPool", order: "WriteOrder", store: "SwapStore", kind: RecordKind) -> None:
        assert kind is not RecordKind.STATE
        self._slots = slots
        self._order = order
        self._store = store
        self._kind = kind
        self._records: Records = frozenset({kind})

    def _numel(self, group: "FlatGroup") -> int:
        """The array's elements: the whole group's weights, or its (padded, data-parallel) trainable range."""
        records = self._store.weights if self._kind is RecordKind.WEIGHTS else self._store.grads
        return records[group.key].numel

    def read_into(self, group: "FlatGroup", dst: Tensor, copy: Callable[[Tensor, Tensor], None]) -> None:
        """Read the group's record (its weights or its gradient), slot by slot, and `copy(dst_piece, staged)` each.
        Reads take a slot's worth at a time (several of the pieces `write_from` sealed, each verified)."""
        self._order.wait_for_writes_of(group, self._records, 0, group.numel)
        for start, stop in _pieces(self._numel(group), self._per_slot(dst.element_size())):
            slot = self._order.take()
            try:
                staged = _staged(slot, start, stop, dst)
                self._order.wait([self._store.read(self._kind, group.key, start, staged)])
                copy(dst[start:stop], staged)
            finally:
                self._slots.give_back(slot)

    def write_from(self, group: "FlatGroup", src: Tensor) -> None:
        """Write the group's record (all of `src`: its weights or its gradient), through the slots. A gradient's
        pieces are copied into slots and their writes registered in flight, as an update's chunks are, so a
        parked gradient's writes overlap the worker's next update instead of holding it (a read of the record or
        a drain waits for them); weights are written through before this returns, since a prefetch of them may
        follow at once and would find the range still being written. Writes go in the updates' chunks, so each
        piece they seal is one an update's read covers whole and verifies. Weights with a shadow copy are
        written to both copies: a speculative update writes only the trainable range of the shadow, so the
        frozen rest must already be there when a commit makes it the live copy."""
        self._order.wait_for_writes_of(group, self._records, 0, group.numel)
        copies = (False, True) if self._kind is RecordKind.WEIGHTS and self._store.has_weight_shadow(group.key) \
            else (False,)
        for start, stop in _pieces(self._numel(group), self._slots.chunk_numel):
            slot = self._order.take()
            try:
                staged = _staged(slot, start, stop, src)
                staged.copy_(src[start:stop])
            except BaseException:
                self._slots.give_back(slot)
                raise
            with self._slots.lock:  # submitted and registered at once: a prefetch never sees the range unwritten
                futures: List["IOFuture"] = []
                try:
                    for shadow in copies:
                        futures.append(self._store.write(self._kind, group.key, start, staged, shadow=shadow))
                except BaseException:  # what was submitted finishes before the slot goes back
                    try:
                        wait_all(futures)
                    finally:
                        self._slots.give_back_locked(slot)
                    raise
                self._order.register_locked(InFlight(slot, group, self._records, start, stop, futures))
        if self._kind is RecordKind.WEIGHTS:
            self._order.wait_for_writes_of(group, self._records, 0, group.numel)

    def start_read(self, group: "FlatGroup", itemsize: int) -> Optional[List[PieceRead]]:
        """Issue reads of the group's disk-resident weights into free slots without blocking (a prefetch);
        None when that would take the ring's last free slots (`KEEP_FOR_CHUNKS` stay) or a write of the record
        is still in flight. Complete it with `finish_weights_read`, or `cancel_weights_read`."""
        pieces = _pieces(self._numel(group), self._per_slot(itemsize))

        def read(slot: "Slot", start: int, stop: int) -> Tuple[Tensor, "IOFuture"]:
            staged = slot.raw[:(stop - start) * itemsize].view(group.dtype)
            return staged, self._store.read(self._kind, group.key, start, staged)
        return start_piece_reads(self._order, self._slots, group, self._records, pieces, read)

    def finish_read(self, handle: List[PieceRead], dst: Tensor,
                            copy: Callable[[Tensor, Tensor], None]) -> None:
        """Wait for a prefetch's reads and `copy(dst_piece, staged)` each; its slots go back."""
        finish_piece_reads(self._order, self._slots, handle, dst, copy)

    def cancel_read(self, handle: List[PieceRead]) -> None:
        """Return a prefetch's slots (after its reads are done: the kernel writes into them)."""
        cancel_piece_reads(self._slots, handle)

    def _per_slot(self, itemsize: int) -> int:
        """Elements of `itemsize` bytes one read takes through a slot: as many whole chunks as its bytes hold
        (`write_from` seals a chunk's worth at a time, and a read verifies whole pieces)."""
        chunks = self._slots.slot_bytes // (self._slots.chunk_numel * itemsize)
        assert chunks >= 1, "a slot's weight room holds a chunk of any compute dtype (<= 4 bytes an element)"
        return chunks * self._slots.chunk_numel


def start_piece_reads(order: "WriteOrder", slots: "SlotPool", group: "FlatGroup", records: Records,
                      pieces: List[Tuple[int, int]],
                      read: Callable[["Slot", int, int], Tuple[Tensor, "IOFuture"]]) -> Optional[List[PieceRead]]:
    """A prefetch: `read(slot, start, stop)` (the staged view, the read's future) for each piece of the group's
    `records`, into free slots without blocking; None when that would take the ring's last free slots
    (`KEEP_FOR_CHUNKS` stay) or a write of them is still in flight (any prefetch of pieces: a record's, or a
    master's, master_reads.py)."""
    if not order.reap_or_defer():  # a prefetch is optional: a write's error goes to the worker
        return None
    with slots.lock:
        taken_slots = order.take_ahead_locked(len(pieces), group, records, 0, group.numel, keep=KEEP_FOR_CHUNKS)
        if taken_slots is None:
            return None
        taken: List[PieceRead] = []
        try:
            for slot, (start, stop) in zip(taken_slots, pieces):
                staged, future = read(slot, start, stop)
                taken.append(PieceRead(slot, start, stop, staged, future))
        except BaseException:
            for slot in taken_slots[len(taken):]:  # no read targets these
                slots.give_back_locked(slot)
            raise
    return taken


def finish_piece_reads(order: "WriteOrder", slots: "SlotPool", handle: List[PieceRead], dst: Tensor,
                       copy: Callable[[Tensor, Tensor], None]) -> None:
    """Wait for a prefetch's reads and `copy(dst_piece, staged)` each; its slots go back (any prefetch of pieces:
    a record's, or a master's, master_reads.py)."""
    try:
        for piece in handle:
            order.wait([piece.future])
            copy(dst[piece.start:piece.stop], piece.staged)
    finally:
        cancel_piece_reads(slots, handle)


def cancel_piece_reads(slots: "SlotPool", handle: List[PieceRead]) -> None:
    """Return a prefetch's slots (after its reads are done: the kernel writes into them)."""
    for piece in handle:
        try:
            piece.future.result()
        except Exception:  # noqa: BLE001, S110 - a failed prefetch is dropped; a synchronous read reports it
            pass
        finally:
            slots.give_back(piece.slot)
    handle.clear()


def _pieces(numel: int, per_piece: int) -> List[Tuple[int, int]]:
    return [(start, min(start + per_piece, numel)) for start in range(0, numel, per_piece)]


def _staged(slot: "Slot", start: int, stop: int, like: Tensor) -> Tensor:
    """The slot's first bytes as elements [start, stop) of `like`'s dtype."""
    return slot.raw[:(stop - start) * like.element_size()].view(like.dtype)
