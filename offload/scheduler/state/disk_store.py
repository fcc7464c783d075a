"""The nvme tier's `StateStore`: a group's master weights and moments in a swap-file record.

Host memory holds only the ring's slots: an update streams the record through the engine's `DiskRing`
chunk by chunk (read ahead, update, write behind), and a checkpoint moves it through two of the ring's
slots, so neither ever holds a whole record. Chunks follow the ring's boundaries, so every piece the swap
checksums sealed is read whole and verified, and a checkpoint load seals exactly the pieces the ring will
read back. See docs/design.md [Note: the nvme step pipeline].
"""

from __future__ import annotations

import contextlib
import functools
from typing import TYPE_CHECKING, Any, Callable, Generator, Iterator, List, Optional, Tuple

import torch
from torch import Tensor

from offload.io.future import wait_all
from offload.optim.moment_format import (
    EXP_AVG,
    EXP_AVG_SQ,
    BlockLayout,
    MomentFormat,
    QuantizedMoment,
    code_nbytes,
    slice_moment,
)
from offload.optim.moments import encode_moment
from offload.scheduler.blocks.block import FlatGroup
from offload.scheduler.state.state_store import Cloned, Fill, Span, StateChunk, SwapSections, Views, decode_views
from offload.tiers.disk import RecordKind, step_seals

if TYPE_CHECKING:
    from offload.scheduler.ring.disk_ring import DiskRing
    from offload.scheduler.ring.ring_slots import SlotSections
    from offload.tiers.disk import SwapStore


class DiskStore:
    """A swap-file record, written with the group's current weights and zero moments when made."""

    uses_cpu_kernel = True
    writes_compute_copy = True
    reads_ahead = True

    def __init__(self, group: FlatGroup, ring: "DiskRing") -> None:
        assert group.device_buffer is not None, "allocate the device buffer first"
        self.group = group
        self.moments = ring.moments
        self._ring = ring
        self.blocks = ring.blocks(group)  # int8: blocks start over at each parameter (None: fp32, bf16)
        weights = group.device_buffer

        def fill(start: int, stop: int, sections: "SlotSections") -> None:
            master, exp_avg, exp_avg_sq = sections
            master.copy_(weights[start:stop])
            on_disk = ring.weights_of(sections, group)
            if on_disk is not None:
                on_disk.copy_(weights[start:stop])
            for moment in (exp_avg, exp_avg_sq):
                for part in (moment if isinstance(moment, QuantizedMoment) else (moment,)):
                    part.zero_()  # zero codes at scale 0: exactly 0.0

        ring.write_fresh(group, fill)

    @property
    def on_host(self) -> bool:
        return True  # its gradient accumulator is; the state itself is on disk

    @property
    def seals_in_step(self) -> bool:
        """The swap file's seals are CRC-32C (the native core), which the compressed-moment step computes in the
        pass that writes the chunk (`StateChunk.crcs`)."""
        return self._ring.swap.checksums.algorithm == "crc32c"

    @property
    def swap(self) -> "SwapStore":
        """The swap file holding this record."""
        return self._ring.swap

    @property
    def nbytes_in_memory(self) -> int:
        return 0

    # ----- update side -----
    def chunks(self) -> List[Span]:
        """The element ranges the ring moves this record in."""
        return self._ring.chunks(self.group)

    def announce(self) -> None:
        """Start reading this record ahead of its update (called when the update is scheduled)."""
        self._ring.announce([self.group])

    @property
    def shadowed(self) -> bool:
        """Whether the swap file has a second copy of this record (speculative updates write it)."""
        return self._ring.swap.has_shadow(self.group.key)

    def add_shadow(self) -> None:
        assert self.shadowed, "the swap layout gives a shadowed block's records their second copy"

    def load(self, start: int, stop: int, shadow: bool = False) -> StateChunk:
        """The live record's chunk in a slot; `shadow`: its `store` goes to the shadow copy."""
        sections = self._ring.load(self.group, start, stop)
        return StateChunk(start, stop, *sections, weights=self._ring.weights_of(sections, self.group), shadow=shadow,
                          blocks=None if self.blocks is None else self.blocks.sub(start, stop))

    def store(self, chunk: StateChunk) -> None:
        sections = (chunk.master, chunk.exp_avg, chunk.exp_avg_sq)
        seals = None if chunk.crcs is None else step_seals(chunk.crcs.tolist(), sections, chunk.weights is not None)
        self._ring.store(self.group, chunk.start, chunk.stop, sections, shadow=chunk.shadow, seals=seals)

    def commit_shadow(self) -> None:
        """The shadow copy (written by a speculative update) becomes the live record: a switch of which copy reads
        go to, no byte moved. Reads issued ahead of the switch are dropped (they read the old copy)."""
        self._ring.commit_shadow(self.group)

    def live_copy(self) -> int:
        """Which copy of the record is live (0 or 1); the other is the shadow a speculative update writes."""
        return self._ring.swap.live_copy(self.group.key)

    def read_first_moments(self, old_copy: int, into: Callable[[int, int, Tensor, Tensor], None]) -> None:
        """Chunk by chunk, the first moment of copy `old_copy` and of the other (`DiskRing.read_first_moments`)."""
        self._ring.read_first_moments(self.group, old_copy, into)

    def abandon(self, chunk: StateChunk) -> None:
        """The update failed: the slot goes back unwritten and the disk keeps the old state."""
        self._ring.abandon((chunk.master, chunk.exp_avg, chunk.exp_avg_sq))

    def discard(self) -> None:
        """The announced update will not run (non-finite gradients): release the reads started for it."""
        self._ring.discard(self.group)

    def drain(self) -> None:
        """Finish every write in flight and drop reads ahead: the swap file then holds the current state."""
        self._ring.drain()

    # ----- checkpoint side -----
    def swap_sections(self) -> Optional[SwapSections]:
        """The record's sections in the swap file, for copy-on-write clones (after `drain`): a checkpoint's save
        and load clone each section's values or codes (compressed moments' too); int8 scales are written."""
        self.drain()
        fd, offsets, nbytes = self._ring.swap.section_spans(self.group.key)
        code = code_nbytes(self.moments, 1)
        return SwapSections(fd, offsets, nbytes, (4, code, code))

    @contextlib.contextmanager
    def reading(self, encoded: bool = False) -> Iterator[Iterator[Tuple[int, int, Views]]]:
        """The record as host chunks in order (read-only; a chunk's views are valid until the next one);
        compressed moments decoded to fp32, or (`encoded`) as the record keeps them."""
        self.drain()
        with self._ring.borrow(2) as slots:
            chunks = self._read_chunks(slots, encoded)
            try:
                yield chunks
            finally:
                chunks.close()  # a read still in flight into the other slot finishes before it goes back

    def _read_chunks(self, slots: List["SlotSections"],
                     encoded: bool = False) -> Generator[Tuple[int, int, Views], None, None]:
        """Chunk i is read into one slot while the caller writes chunk i-1 from the other (when the ring lends
        two), so the swap file's reads overlap the checkpoint's writes. Compressed moments are decoded to
        fp32 (the checkpoint side's form) before the chunk is handed out."""
        chunks = self.chunks()
        swap = self._ring.swap

        def read(i: int) -> Tuple[Any, List[Any]]:
            start, stop = chunks[i]
            views = self._cut(slots[i % len(slots)], start, stop)
            return views, [swap.read(RecordKind.STATE, self.group.key, start, views)]

        pending = read(0) if chunks else None
        try:
            for i, (start, stop) in enumerate(chunks):
                assert pending is not None
                views, futures = pending
                pending = None
                wait_all(futures)
                if self.moments is not MomentFormat.FP32 and not encoded:
                    master, exp_avg, exp_avg_sq = views
                    views = decode_views(self.moments, master, exp_avg, exp_avg_sq, self._chunk_blocks(start, stop))
                fp32 = views
                if i + 1 < len(chunks) and len(slots) > 1:
                    pending = read(i + 1)
                yield start, stop, fp32
                if pending is None and i + 1 < len(chunks):
                    pending = read(i + 1)  # one slot: the next read starts once the caller is done with this one
        finally:
            if pending is not None:
                try:
                    wait_all(pending[1])
                except Exception:  # noqa: BLE001 - dropped: nobody reads this chunk; the caller's error stands
                    pass

    def write(self, fill: Fill, cloned: Cloned = (0, 0, 0), encoded: bool = False) -> None:
        """New state chunk by chunk: chunk i is filled while chunk i-1 is written. `cloned[i]`: the swap file
        already holds that many leading elements (values or codes) of section i (cloned copy-on-write); they are
        sealed, not written. A `fill` that fails leaves the record partly written, which the load reports."""
        self.drain()
        with self._ring.borrow(2) as slots:
            in_flight: List[Callable[[], None]] = []
            try:
                for i, (start, stop) in enumerate(self.chunks()):
                    if len(in_flight) == len(slots):
                        in_flight.pop(0)()  # this slot's previous write is done before it is filled again
                    views = self._cut(slots[i % len(slots)], start, stop)
                    if self.moments is MomentFormat.FP32 or encoded:  # the state as the record keeps it
                        fill(start, stop, views)  # type: ignore[arg-type]
                    else:
                        _fill_encoded(fill, start, stop, views, self.moments, self._chunk_blocks(start, stop))
                    futures = [self._ring.swap.write(RecordKind.STATE, self.group.key, start, views, in_file=cloned)]
                    in_flight.append(functools.partial(wait_all, futures))
                while in_flight:
                    in_flight.pop(0)()
            finally:
                for finish in in_flight:  # an error above: no slot goes back with a write still reading it
                    try:
                        finish()
                    except Exception:  # noqa: BLE001 - the first error is already on its way up
                        pass

    def _chunk_blocks(self, start: int, stop: int) -> Optional[BlockLayout]:
        return None if self.blocks is None else self.blocks.sub(start, stop)

    def _cut(self, sections: "SlotSections", start: int, stop: int) -> "SlotSections":
        """A borrowed slot's sections, cut to the chunk [start, stop): its elements and (int8) its blocks' scales."""
        master, exp_avg, exp_avg_sq = sections
        numel, blocks = stop - start, self.blocks
        if blocks is None or not isinstance(exp_avg, QuantizedMoment) or not isinstance(exp_avg_sq, QuantizedMoment):
            return (master[:numel], slice_moment(exp_avg, self.moments, 0, numel),
                    slice_moment(exp_avg_sq, self.moments, 0, numel))
        scales = blocks.scales_before(stop) - blocks.scales_before(start)
        return (master[:numel], QuantizedMoment(exp_avg.codes[:numel], exp_avg.scales[:scales]),
                QuantizedMoment(exp_avg_sq.codes[:numel], exp_avg_sq.scales[:scales]))



def _fill_encoded(fill: Fill, start: int, stop: int, sections: "SlotSections", moments: MomentFormat,
                  blocks: Optional[BlockLayout]) -> None:
    """`fill` a chunk of a record with compressed moments: the master weights straight into the slot, the
    moments into fp32 staging, then encoded into the slot."""
    master, exp_avg, exp_avg_sq = sections
    staged = (torch.empty(stop - start, dtype=torch.float32), torch.empty(stop - start, dtype=torch.float32))
    fill(start, stop, (master, *staged))
    for which, moment, values in ((EXP_AVG, exp_avg, staged[0]), (EXP_AVG_SQ, exp_avg_sq, staged[1])):
        encode_moment(values, moments, which, moment, blocks)
