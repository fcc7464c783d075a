"""Compute weights read from a group's fp32 master weights in its state record, through the nvme ring's slots
(`disk_weights="master"`: docs/design.md [Note: weights from the master]).

A block whose weights the plan leaves on disk needs no copy of them in the swap file when its master weights are
there already: every fetch reads the master section of the state record, a chunk at a time, and casts it into the
compute buffer. An update writes the master, so the next fetch reads the new weights with nothing else to write;
the cast is the one an update makes of the master (round to nearest even), so the weights are the same bits as a
copy's. The cost is the read: 4 B/param of master instead of the copy's 2 (bf16), in the forward and the backward.

The reads follow `record_moves.RecordMoves`' rules (the ring's ordering, ring_slots.WriteOrder): a read first
retires the ring's writes of the group in flight, a prefetch takes its slots with `take_ahead_locked` (never the
last free ones), and each read covers whole chunks of the ring (`DiskRing.chunks`), the pieces the state's writes
sealed, so every read is verified.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable, List, Optional, Tuple

import torch
from torch import Tensor

from offload.scheduler.ring.record_moves import PieceRead, cancel_piece_reads, finish_piece_reads, start_piece_reads
from offload.scheduler.ring.ring_slots import STATE_RECORD
from offload.tiers.disk import RecordKind

if TYPE_CHECKING:
    from offload.io.future import IOFuture
    from offload.scheduler.blocks.block import FlatGroup
    from offload.scheduler.ring.ring_slots import Slot, SlotPool, WriteOrder
    from offload.tiers.disk import SwapStore

Chunks = Callable[["FlatGroup"], List[Tuple[int, int]]]


class MasterReads:
    """Reads of groups' master weights (the live copy of the state record) over `slots`, ordered after the state's
    writes by `order`; `chunks`: the ring's chunks of a group, as its state is written."""

    def __init__(self, slots: "SlotPool", order: "WriteOrder", store: "SwapStore", chunks: Chunks) -> None:
        self._slots = slots
        self._order = order
        self._store = store
        self._chunks = chunks

    def read_into(self, group: "FlatGroup", dst: Tensor, copy: Callable[[Tensor, Tensor], None]) -> None:
        """Read the group's master chunk by chunk and `copy(dst_piece, staged fp32)` each (the copy casts)."""
        _check_whole(group)
        self._order.wait_for_writes_of(group, STATE_RECORD, 0, group.numel)
        for start, stop in self._chunks(group):
            slot = self._order.take()
            try:
                staged = _staged(slot, start, stop)
                self._order.wait([self._store.read(RecordKind.STATE, group.key, start, (staged, None, None))])
                copy(dst[start:stop], staged)
            finally:
                self._slots.give_back(slot)

    def start_read(self, group: "FlatGroup", itemsize: int) -> Optional[List[PieceRead]]:
        """Issue the reads of the group's master into free slots without blocking (a prefetch); None when that
        would take the ring's last free slots or a write of the group is in flight. `itemsize` (the compute
        dtype's) is unused: the master is fp32. Complete with `finish_read`, or `cancel_read`."""
        _check_whole(group)

        def read(slot: "Slot", start: int, stop: int) -> Tuple[Tensor, "IOFuture"]:
            staged = _staged(slot, start, stop)
            return staged, self._store.read(RecordKind.STATE, group.key, start, (staged, None, None))
        return start_piece_reads(self._order, self._slots, group, STATE_RECORD, self._chunks(group), read)

    def finish_read(self, handle: List[PieceRead], dst: Tensor, copy: Callable[[Tensor, Tensor], None]) -> None:
        """Wait for a prefetch's reads and `copy(dst_piece, staged)` each; its slots go back."""
        finish_piece_reads(self._order, self._slots, handle, dst, copy)

    def cancel_read(self, handle: List[PieceRead]) -> None:
        """Return a prefetch's slots (after its reads are done: the kernel writes into them)."""
        cancel_piece_reads(self._slots, handle)


def _check_whole(group: "FlatGroup") -> None:
    """Only a group whose every element trains has a master for each (frozen ones keep a copy of their own)."""
    assert group.trainable_numel == group.numel, "weights from the master need every parameter of the group trained"


def _staged(slot: "Slot", start: int, stop: int) -> Tensor:
    """The slot's first bytes as the fp32 master elements [start, stop)."""
    return slot.raw[:(stop - start) * 4].view(torch.float32)
