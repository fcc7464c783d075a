"""Host views of one flat group's optimizer state, for saving and loading it one record at a time.

The only module of the checkpoint package that knows how a tier keeps its state: host tensors (cpu
tier), device tensors (gpu tier, copied through host memory) or a swap-file record staged through a
lease of the engine's staging pool (nvme tier), so a checkpoint never holds more than one record.
"""

from __future__ import annotations

import contextlib
from typing import Callable, Iterable, Iterator, Optional, Tuple

import torch
from torch import Tensor

from offload.scheduler.step import DiskGroupState, GroupState
from offload.tiers.disk import state_views

Views = Tuple[Tensor, Tensor, Tensor]  # master, exp_avg, exp_avg_sq: fp32, host, contiguous


class RecordScratch:
    """One host buffer the size of the largest swap record among `states`, reused for every record a save or
    load moves: host memory grows by one record, however many there are (and no allocator churn)."""

    def __init__(self, states: Iterable[Optional[GroupState]]) -> None:
        sizes = [s.swap.records[id(s.group)].nbytes for s in states if isinstance(s, DiskGroupState)]
        self._buffer = torch.empty(max(sizes) // 4, dtype=torch.float32) if sizes else None

    def take(self, nbytes: int) -> Tensor:
        assert self._buffer is not None and nbytes <= 4 * self._buffer.numel()
        return self._buffer[:nbytes // 4]


@contextlib.contextmanager
def _disk_record(state: DiskGroupState, load_from_disk: bool, write_back: bool,
                 commit: Optional[Callable[[Tensor], bool]] = None,
                 scratch: Optional[RecordScratch] = None) -> Iterator[Views]:
    """One swap record in host memory (one at a time: a checkpoint never holds more). The ring is drained
    first, so the file holds the latest state and no read-ahead keeps data a load would make stale."""
    state.settle()
    store = state.swap
    group = state.group
    n = group.trainable_numel
    nbytes = store.records[id(group)].nbytes
    buffer = scratch.take(nbytes) if scratch is not None else torch.empty(nbytes // 4, dtype=torch.float32)
    views = state_views(buffer, n)
    try:
        if load_from_disk:
            store.read(group, buffer)
        yield views
        if write_back:
            if commit is not None and commit(buffer):
                for index, view in enumerate(views):  # the record now holds these bytes (cloned)
                    store.checksums.seal((id(group), index), 0, view)
            else:
                store.write(group, buffer)
    finally:
        del views, buffer


@contextlib.contextmanager
def reading(state: GroupState, scratch: Optional[RecordScratch] = None) -> Iterator[Views]:
    """The group's current state as host tensors (read-only use)."""
    if isinstance(state, DiskGroupState):
        with _disk_record(state, load_from_disk=True, write_back=False, scratch=scratch) as views:
            yield views
        return
    yield tuple(t.detach().to("cpu").contiguous() for t in (state.master, state.exp_avg, state.exp_avg_sq))  # type: ignore[misc]


@contextlib.contextmanager
def writing(state: GroupState, commit: Optional[Callable[[Tensor], bool]] = None,
            scratch: Optional[RecordScratch] = None) -> Iterator[Views]:
    """Host tensors to fill with the group's new state; committed to the tier when the block exits cleanly.
    For a swap record, `commit(record)` may store it another way (a clone) and return True; else it is written."""
    if isinstance(state, DiskGroupState):
        with _disk_record(state, load_from_disk=False, write_back=True, commit=commit, scratch=scratch) as views:
            yield views
        return
    targets = (state.master, state.exp_avg, state.exp_avg_sq)
    if all(t.device.type == "cpu" and t.is_contiguous() for t in targets):
        staged = tuple(torch.empty_like(t) for t in targets)  # the state stays intact if reading fails
    else:
        staged = tuple(torch.empty(t.shape, dtype=t.dtype) for t in targets)
    yield staged  # type: ignore[misc]
    with torch.no_grad():
        for target, source in zip(targets, staged):
            target.copy_(source)


def swap_record(state: GroupState) -> Optional[Tuple[int, int, int]]:
    """(file descriptor, offset, bytes) of the group's swap record, or None when its state is in memory.
    Lets a checkpoint on the same file system clone the record (copy-on-write) instead of writing it."""
    if not isinstance(state, DiskGroupState):
        return None
    store = state.swap
    record = store.records[id(state.group)]
    if record.section_bytes != 4 * record.numel:
        # Layout v2 pads each section to 4 KiB; the checkpoint stores the three kinds back to back, so
        # a whole-record clone would misplace them. Cloning section by section is a follow-up: write instead.
        return None
    return store.record_span(state.group)
