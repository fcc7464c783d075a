"""Reads and writes of disk-resident compute weights, through the nvme ring's slots.

When the plan puts a block's weights on disk, every fetch reads them from the swap file and every update's
new weights are written back: both go through the staging ring's slots (offload/scheduler/ring_slots.py), a
slot's worth at a time. They follow the ring's ordering rules (offload/scheduler/disk_ring.py): a read of a
group waits for the ring's writes of it in flight, and a prefetch never takes the ring's last free slots, so
the chunk the step worker needs next can always get one.

Thread safety: the ring's lock (the pool's `lock`) guards the free list and the ring's writes in flight; a
prefetch checks both and takes its slots in one step under it. Waits on I/O happen outside it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable, Optional

from torch import Tensor

from offload.planner import SLOT_BYTES_PER_ELEMENT

if TYPE_CHECKING:
    from offload.scheduler.blocks.block import FlatGroup
    from offload.scheduler.ring.disk_ring import DiskRing
    from offload.scheduler.ring.ring_slots import SlotPool
    from offload.tiers.disk import SwapStore


class DiskWeightIO:
    """The compute-weight moves of `ring`, over its slot pool: its waits (`DiskRing._wait`) and its writes in
    flight (`_wait_writes_of`, `_reap_finished_writes`, `_writing`) order them after the state's writes."""

    def __init__(self, ring: "DiskRing", slots: "SlotPool", store: "SwapStore") -> None:
        self._ring = ring
        self._slots = slots
        self._store = store

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
            self._ring._reap_finished_writes()
        except Exception as exc:  # noqa: BLE001 - a prefetch is optional: keep the error for the worker
            self._ring._defer(exc)
            return None
        per_slot = self._slots.chunk_numel * SLOT_BYTES_PER_ELEMENT // itemsize
        pieces = [(a, min(a + per_slot, group.numel)) for a in range(0, group.numel, per_slot)]
        with self._slots.lock:
            if len(self._slots.free) < len(pieces) + 2 or self._ring._writing(group):
                return None
            taken = []
            for start, stop in pieces:
                slot = self._slots.free.pop()
                staged = slot.raw[:(stop - start) * itemsize].view(group.dtype)
                taken.append((slot, start, stop, staged, self._store.read_weights(group, start, staged)))
        return taken

    def finish_weights_read(self, handle: list, dst: Tensor, copy: Callable[[Tensor, Tensor], None]) -> None:
        try:
            for _slot, start, stop, staged, future in handle:
                self._ring._wait([future])
                copy(dst[start:stop], staged)
        finally:
            self.cancel_weights_read(handle)

    def cancel_weights_read(self, handle: list) -> None:
        """Return a prefetch's slots (after its reads are done: the kernel writes into them)."""
        for slot, _start, _stop, _staged, future in handle:
            try:
                future.result()
            except Exception:
                pass  # a failed prefetch is dropped; the synchronous read reports the error
            finally:
                self._slots.give_back(slot)
        handle.clear()

    def _move_weights(self, write: bool, group: "FlatGroup", tensor: Tensor, copy) -> None:
        self._ring._wait_writes_of(group, 0, group.numel)
        # Writes go in the updates' chunks, so each piece they seal is one an update's read covers whole and
        # verifies; reads take a slot's worth at a time (several sealed pieces, each verified).
        per_slot = self._slots.chunk_numel * SLOT_BYTES_PER_ELEMENT // tensor.element_size()
        per_piece = self._slots.chunk_numel if write else per_slot
        for start in range(0, group.numel, per_piece):
            stop = min(start + per_piece, group.numel)
            slot = self._slots.take()
            try:
                staged = slot.raw[:(stop - start) * tensor.element_size()].view(tensor.dtype)
                if write:
                    copy(staged, tensor[start:stop])
                submit = self._store.write_weights if write else self._store.read_weights
                future = submit(group, start, staged)
                self._ring._wait([future])
                if not write:
                    copy(tensor[start:stop], staged)
            finally:
                self._slots.give_back(slot)
