"""Disk traffic: what the step does with the swap file besides loading and storing state, by tier.

On the memory tiers there is none (`NoDiskTraffic`). On the nvme tier (`RingTraffic`) the ring reads
optimizer state ahead in the order the updates will want it (from the forward on, for the updates the
last backward starts; and, on the worker, for what is still queued), and the phases flush its writes and
drain it around checkpoints and at close. See docs/design.md [Note: the nvme step pipeline].
"""

from __future__ import annotations

from typing import List, Protocol

from offload.scheduler.records.block_record import BlockRecord
from offload.scheduler.ring.disk_ring import DiskRing


class DiskTraffic(Protocol):
    """What the phases ask of the disk, whatever the tier."""

    def serve(self, records: List[BlockRecord]) -> None:
        """The blocks' records, by block index (made after the modes: the worker and the modes come first)."""

    def read_ahead_for_backward(self, blocks: List[BlockRecord]) -> None:
        """The updates of these blocks will run in this order, starting during the coming backward."""

    def queued(self, block_indices: List[int]) -> None:
        """The worker's queue, in the order it will run (the worker calls this before each job)."""

    def reading_order(self, block_indices: List[int]) -> List[int]:
        """Of these blocks, those whose state is being read or was read ahead, in the order those reads began."""

    def flush_writes(self) -> None:
        """Every write in flight on disk (their errors raise here); reads ahead are kept."""

    def drain(self) -> None:
        """Every write on disk and every read ahead dropped: each staging slot back."""


class NoDiskTraffic:
    """The cpu and gpu tiers: the state is in memory."""

    def serve(self, records: List[BlockRecord]) -> None:
        pass

    def read_ahead_for_backward(self, blocks: List[BlockRecord]) -> None:
        pass

    def queued(self, block_indices: List[int]) -> None:
        pass

    def reading_order(self, block_indices: List[int]) -> List[int]:
        return []

    def flush_writes(self) -> None:
        pass

    def drain(self) -> None:
        pass


class RingTraffic:
    """The nvme tier: the state streams through `ring`."""

    def __init__(self, ring: DiskRing) -> None:
        self._ring = ring
        self._records: List[BlockRecord] = []

    def serve(self, records: List[BlockRecord]) -> None:
        self._records = records

    def read_ahead_for_backward(self, blocks: List[BlockRecord]) -> None:
        self._ring.announce(_disk_groups(blocks))

    def queued(self, block_indices: List[int]) -> None:
        if self._records:
            self._ring.announce(_disk_groups([self._records[i] for i in block_indices]), replace=True)

    def reading_order(self, block_indices: List[int]) -> List[int]:
        if not self._records:
            return []
        block_of = {group.key: i for i in block_indices for group in _disk_groups([self._records[i]])}
        return list(dict.fromkeys(block_of[key] for key in self._ring.reading_order(list(block_of))))

    def flush_writes(self) -> None:
        self._ring.flush_writes()

    def drain(self) -> None:
        self._ring.drain()


def _disk_groups(records: List[BlockRecord]) -> list:
    """The flat groups of these blocks whose state the ring reads ahead, in block order (as their stores
    see them: a rank's part in data-parallel mode)."""
    return [state.store.group for record in records for state in record.states if state.store.reads_ahead]
