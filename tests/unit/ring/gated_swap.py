"""A real SwapStore in a test's directory, seen through `GatedSwap`: a wrapper the ring takes as its store,
which logs every request it starts and, on command, keeps writes in flight or makes them fail.

Fault injection goes through this one object (the ring's `store` argument): nothing is patched, so every
other ring and engine in the process is untouched.
"""

from __future__ import annotations

import contextlib
from typing import Iterator, List, Optional, Tuple

import torch
from torch import nn

from offload.scheduler.blocks.block import FlatGroup, build_blocks
from offload.scheduler.ring.disk_ring import DiskRing
from offload.tiers.disk import RecordKind, SwapStore
from offload.tiers.host import StagingPool
from offload.tiers.swap_layout import plan_grad_layout, plan_swap_layout, plan_weight_layout

# (what, group key, first element, address of the slot's bytes); what: "read", "write", "write done" (all of
# its requests waited for), "read weights", "write weights", "write weights done"
Event = Tuple[str, str, int, int]


class HeldWrite:
    """One request of a write (`write`, shared by the requests of one chunk), whose future reports itself
    done only when the test says so (`GatedSwap.finish_writes`) or once someone waits for it: a disk slower
    than anything the ring does without blocking. The write is logged done when all its requests were waited
    for."""

    def __init__(self, inner, write: "_Write") -> None:
        self._inner = inner
        self._write = write
        self.finished = False
        self._waited = False

    def done(self) -> bool:
        return self.finished

    def result(self, timeout=None) -> int:
        self.finished = True
        try:
            return self._inner.result(timeout)
        finally:
            if not self._waited:
                self._waited = True
                self._write.one_waited()


class _Write:
    def __init__(self, swap: "GatedSwap", event: Event, requests: int, error: Optional[BaseException]) -> None:
        self._swap = swap
        self._event = event
        self._left = requests
        self.error = error

    def one_waited(self) -> None:
        self._left -= 1
        if self._left == 0:
            self._swap.events.append((self._event[0] + " done",) + self._event[1:])
        if self.error is not None:
            raise self.error


class GatedSwap:
    """`swap`'s reads and writes, logged in `events` in the order they start (and writes when they are done).

    `hold_writes`: writes started from now on stay in flight until waited for or `finish_writes()`.
    `fail_writes`: writes started from now on raise this error when waited for (their bytes still land).
    """

    def __init__(self, swap: SwapStore) -> None:
        self.swap = swap
        self.weights = swap.weights
        self.grads = swap.grads
        self.events: List[Event] = []
        self.hold_writes = False
        self.fail_writes: Optional[BaseException] = None
        self._held: List[HeldWrite] = []

    def finish_writes(self) -> None:
        """Every held write completes now (the ring's non-blocking reaping can then retire it)."""
        for request in self._held:
            request.finished = True
        self._held.clear()

    def read(self, kind: RecordKind, key: str, start: int, data):
        if kind is RecordKind.STATE:
            self.events.append(("read", key, start, data[0].data_ptr()))
        elif kind is RecordKind.WEIGHTS:
            self.events.append(("read weights", key, start, data.data_ptr()))
        return self.swap.read(kind, key, start, data)

    def write(self, kind: RecordKind, key: str, start: int, data, shadow: bool = False, crcs=None):
        if kind is RecordKind.STATE:
            event: Event = ("write", key, start, data[0].data_ptr())
        else:
            event = ("write weights" if kind is RecordKind.WEIGHTS else "write grads", key, start, data.data_ptr())
        return self._written(event, [self.swap.write(kind, key, start, data, shadow, crcs)])[0]

    def has_weight_shadow(self, key: str) -> bool:
        return self.swap.has_weight_shadow(key)

    def _written(self, event: Event, futures: list) -> list:
        self.events.append(event)
        if not self.hold_writes and self.fail_writes is None:
            self.events.append((event[0] + " done",) + event[1:])  # logged as started: the ring may not wait
            return futures
        write = _Write(self, event, len(futures), self.fail_writes)
        requests = [HeldWrite(f, write) for f in futures]
        if self.hold_writes:
            self._held.extend(requests)
        else:
            for request in requests:
                request.finished = True  # complete; fails when waited for
        return requests


def groups_of(model: nn.Module, dtype: torch.dtype = torch.float32):
    blocks = build_blocks(model, dtype)
    for block in blocks:
        for group in block.groups:
            group.device_buffer = torch.zeros(group.numel, dtype=group.dtype)
    return blocks, [g for b in blocks for g in b.groups]


@contextlib.contextmanager
def gated_ring(tmp_path, model: nn.Module, ring_bytes: int, depth: int = 4, weights_on_disk: bool = False,
               dtype: torch.dtype = torch.float32, grads_on_disk: bool = False) -> Iterator[Tuple[DiskRing, GatedSwap, List[FlatGroup]]]:
    """(ring, its GatedSwap, the model's flat groups) over a real swap file in `tmp_path`; the compute weights
    on disk too when `weights_on_disk`, a
    gradient record per group when `grads_on_disk`. Everything is closed after."""
    blocks, groups = groups_of(model, dtype)
    shapes = [g.shape(b.name) for b in blocks for g in b.groups]
    records, size = plan_swap_layout(shapes)
    weights = None
    if weights_on_disk:
        weights, size = plan_weight_layout(shapes, size)
    grads = None
    if grads_on_disk:
        grads, size = plan_grad_layout(shapes, size)
    swap = SwapStore(str(tmp_path), records, size, weights, grads)
    pool = StagingPool(ring_bytes)
    gated = GatedSwap(swap)
    try:
        yield DiskRing(gated, pool, ring_bytes, depth), gated, groups  # type: ignore[arg-type]
    finally:
        swap.close()
        pool.close()


def check_no_slot_reused_in_flight(events: List[Event]) -> None:
    """Every request into or out of a slot's bytes starts after the last write from them is done."""
    writing = {}  # slot address -> (group key, first element) of the write in flight from it
    for what, key, start, address in events:
        if what.endswith(" done"):
            if writing.get(address) == (key, start):
                del writing[address]
            continue
        assert address not in writing, f"{what} of {key}@{start} into a slot still writing {writing[address]}"
        if what.startswith("write"):
            writing[address] = (key, start)
