"""One flat group's optimizer state moved in chunks, for saving and loading it without a copy of its own.

The only module of the checkpoint package that knows how a tier keeps its state: host tensors (cpu
tier: one chunk, the tensors themselves), device tensors (gpu tier: one chunk, copied through host
memory) or a swap-file record (nvme tier: the ring's chunks, through two slots of the ring, so a
checkpoint holds at most two chunks of a record however large the record is, and overlaps the swap file's
I/O with the checkpoint's). Chunks follow the ring's
boundaries, so every piece the swap checksums sealed is read whole and verified, and a load seals exactly
the pieces the ring will read back.
"""

from __future__ import annotations

import contextlib
from typing import Callable, Iterator, List, NamedTuple, Optional, Sequence, Tuple

import torch
from torch import Tensor

from offload.io.future import wait_all
from offload.scheduler.block import FlatGroup
from offload.scheduler.step import DiskGroupState, GroupState

Views = Tuple[Tensor, Tensor, Tensor]  # master, exp_avg, exp_avg_sq: fp32, host, contiguous
Chunk = Tuple[int, int, Views]  # elements [start, stop) of the group's trainable range, and their state
Cloned = Sequence[int]  # per section, how many leading elements the swap file already holds (cloned)


class SwapSections(NamedTuple):
    """Where a disk-resident record's three sections are, for copy-on-write clones section by section."""

    fd: int
    offsets: Tuple[int, int, int]  # file offset of each section (4 KiB-aligned)
    nbytes: int  # data bytes of each section (4 x numel; the padding after it is not state)


def swap_sections(state: GroupState) -> Optional[SwapSections]:
    """The group's swap-record sections, or None when its state is in memory. The ring is drained first,
    so the file holds the current state and nothing reads ahead while a caller clones to or from it."""
    if not isinstance(state, DiskGroupState):
        return None
    state.settle()
    fd, offsets, nbytes = state.swap.section_spans(state.group)
    return SwapSections(fd, offsets, nbytes)


@contextlib.contextmanager
def reading(state: GroupState) -> Iterator[Iterator[Chunk]]:
    """The group's current state as host chunks, in order (read-only; a chunk's views are valid until the
    next one is taken)."""
    if isinstance(state, DiskGroupState):
        state.settle()
        with state.staging(2) as slots:
            chunks = _disk_chunks(state, slots)
            try:
                yield chunks
            finally:
                chunks.close()  # a read still in flight into the other slot finishes before it goes back
        return
    views = tuple(t.detach().to("cpu").contiguous() for t in (state.master, state.exp_avg, state.exp_avg_sq))
    yield iter([(0, state.group.trainable_numel, views)])  # type: ignore[list-item]


def _disk_chunks(state: DiskGroupState, slots: List[Views]) -> Iterator[Chunk]:
    """Chunk i is read into one slot while the caller writes chunk i-1 from the other (when the ring lends
    two), so the swap file's reads overlap the checkpoint's writes. Each read covers a ring chunk exactly,
    so it verifies every piece the swap checksums sealed."""
    chunks = state.chunks()

    def read(i: int):
        start, stop = chunks[i]
        views = tuple(section[:stop - start] for section in slots[i % len(slots)])
        return views, state.swap.submit(False, state.group, start, stop, views)  # type: ignore[arg-type]

    pending = read(0) if chunks else None
    try:
        for i, (start, stop) in enumerate(chunks):
            assert pending is not None
            views, futures = pending
            pending = None
            wait_all(futures)
            if i + 1 < len(chunks) and len(slots) > 1:
                pending = read(i + 1)
            yield start, stop, views  # type: ignore[misc]
            if pending is None and i + 1 < len(chunks):
                pending = read(i + 1)  # one slot: the next read starts once the caller is done with this one
    finally:
        if pending is not None:
            try:
                wait_all(pending[1])
            except Exception:  # noqa: BLE001 - dropped: nobody reads this chunk; the caller's error stands
                pass


def write(state: GroupState, fill: Callable[[int, int, Views], None], cloned: Cloned = (0, 0, 0)) -> None:
    """Give the group new state: `fill(start, stop, views)` writes each chunk's values into host views,
    which then go to the tier. `cloned[i]`: the swap file already holds that many leading elements of
    section i (cloned copy-on-write); they are sealed, not written. Host state is filled in place (the
    load verified the files first); a `fill` that fails anyway (an I/O error) leaves the group partly
    written, which the load reports."""
    if isinstance(state, DiskGroupState):
        state.settle()
        with state.staging(2) as slots:  # chunk i is filled while chunk i-1 is being written
            in_flight: List[Callable[[], None]] = []
            try:
                for i, (start, stop) in enumerate(state.chunks()):
                    if len(in_flight) == len(slots):
                        in_flight.pop(0)()  # this slot's previous write is done before it is filled again
                    views = tuple(section[:stop - start] for section in slots[i % len(slots)])
                    fill(start, stop, views)  # type: ignore[arg-type]
                    in_flight.append(_store_chunk(state, start, stop, views, cloned))  # type: ignore[arg-type]
                while in_flight:
                    in_flight.pop(0)()
            finally:
                for finish in in_flight:  # an error above: no slot goes back with a write still reading it
                    try:
                        finish()
                    except Exception:  # noqa: BLE001 - the first error is already on its way up
                        pass
        return
    targets = (state.master, state.exp_avg, state.exp_avg_sq)
    if all(t.device.type == "cpu" and t.is_contiguous() for t in targets):
        # straight into the state: the load's first pass verified every byte before anything changes
        fill(0, state.group.trainable_numel, targets)  # type: ignore[arg-type]
        return
    staged = tuple(torch.empty(t.shape, dtype=t.dtype) for t in targets)  # device state: through the host
    fill(0, state.group.trainable_numel, staged)  # type: ignore[arg-type]
    with torch.no_grad():
        for target, source in zip(targets, staged):
            target.copy_(source)


def _store_chunk(state: DiskGroupState, start: int, stop: int, views: Views, cloned: Cloned) -> Callable[[], None]:
    """Start writing the chunk's sections, except what a clone already put in the file; the returned
    function waits for the writes and seals the whole chunk of each section as one piece (the ring reads it
    back as one)."""
    store, group = state.swap, state.group
    futures, adopted = [], []
    for index, (view, below) in enumerate(zip(views, cloned)):
        if below <= start:
            futures.append(store.submit_section(True, group, index, start, view))
            continue
        if below < stop:  # the unaligned tail of a cloned section
            futures.append(store.submit_section(True, group, index, below, view[below - start:]))
        adopted.append((index, view))

    def finish() -> None:
        wait_all(futures)
        for index, view in adopted:  # after the tail's write: one seal replaces the tail's
            store.adopt(group, index, start, view)

    return finish


def pieces(group: FlatGroup, start: int, stop: int, view: Tensor) -> List[Tuple[int, int, int, Tensor]]:
    """The parameters a chunk [start, stop) of one section covers: (trainable slot index, first element of
    the piece within the parameter, first element within the group, the piece's view of `view`)."""
    out = []
    for index, slot in enumerate(group.trainable_slots):
        lo, hi = max(start, slot.offset), min(stop, slot.offset + slot.numel)
        if lo < hi:
            out.append((index, lo - slot.offset, lo, view[lo - start:hi - start]))
    return out
