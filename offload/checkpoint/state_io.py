"""Host views of one flat group's optimizer state, for saving and loading it one record at a time.

The only module of the checkpoint package that knows how a tier keeps its state: host tensors (cpu
tier), device tensors (gpu tier, copied through host memory) or a swap-file record staged through a
lease of the engine's staging pool (nvme tier), so a checkpoint never holds more than one record.
"""

from __future__ import annotations

import contextlib
from typing import Callable, Iterator, Optional, Tuple

import torch
from torch import Tensor

from offload.scheduler.step import LEASE_TIMEOUT_S, DiskGroupState, GroupState
from offload.tiers.disk import state_views

Views = Tuple[Tensor, Tensor, Tensor]  # master, exp_avg, exp_avg_sq: fp32, host, contiguous


@contextlib.contextmanager
def _disk_record(state: DiskGroupState, load_from_disk: bool, write_back: bool,
                 commit: Optional[Callable[[Tensor], bool]] = None) -> Iterator[Views]:
    n = state.group.trainable_numel
    lease = state._pool.lease(3 * 4 * n, wait=True, timeout=LEASE_TIMEOUT_S)
    buffer = lease.view(torch.float32, (3 * n,))
    try:
        if load_from_disk:
            state._store.read(state.group, buffer)
        yield state_views(buffer, n)
        if write_back:
            if commit is not None and commit(buffer):
                state._store.checksums.seal(id(state.group), buffer)  # the record now holds these bytes
            else:
                state._store.write(state.group, buffer)
    finally:
        del buffer
        lease.release()


@contextlib.contextmanager
def reading(state: GroupState) -> Iterator[Views]:
    """The group's current state as host tensors (read-only use)."""
    if isinstance(state, DiskGroupState):
        with _disk_record(state, load_from_disk=True, write_back=False) as views:
            yield views
        return
    yield tuple(t.detach().to("cpu").contiguous() for t in (state.master, state.exp_avg, state.exp_avg_sq))  # type: ignore[misc]


@contextlib.contextmanager
def writing(state: GroupState, commit: Optional[Callable[[Tensor], bool]] = None) -> Iterator[Views]:
    """Host tensors to fill with the group's new state; committed to the tier when the block exits cleanly.
    For a swap record, `commit(record)` may store it another way (a clone) and return True; else it is written."""
    if isinstance(state, DiskGroupState):
        with _disk_record(state, load_from_disk=False, write_back=True, commit=commit) as views:
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
    record = state._store.records[id(state.group)]
    return state._store._file.buffered_fd, record.offset, record.nbytes
