"""Each `StateStore` built on its own over a small flat group, for the protocol tests and the AdamW tests.

`STORE_KINDS` is the list the parametrized tests run over: a new store is checked by adding a case here.
A case knows the store's part of the group's trainable range, `[lo, hi)`, and the flags it must report.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Iterator, List, Optional, Tuple

import torch
from torch import nn

from offload.distributed.data_parallel import Shard
from offload.planner.ring import min_ring_bytes
from offload.scheduler.blocks.block import Block, FlatGroup, ParamSlot
from offload.scheduler.ring.disk_ring import DiskRing
from offload.scheduler.state.disk_store import DiskStore
from offload.scheduler.state.sharded_store import ShardedStore, ShardGroup
from offload.scheduler.state.state_store import MemoryStore, StateStore
from offload.tiers.disk import SwapStore
from offload.tiers.host import StagingPool
from offload.tiers.swap_layout import plan_swap_layout

# Trainable parameters 0..4500, 4500..4600, 4600..6600, then a frozen one: with the smallest ring (chunks of
# 2048 elements) the disk store has four chunks, and chunks and parameters cross each other's boundaries.
TRAINABLE_SHAPES: Tuple[Tuple[int, ...], ...] = ((30, 150), (100,), (40, 50))
FROZEN_SHAPES: Tuple[Tuple[int, ...], ...] = ((7,),)
SHARD = Shard(n=6600, size=3300, rank=1, world=2)  # rank 1's part: [3300, 6600), two chunks on disk

STORE_KINDS = ["memory-host", "memory-device", "disk", "sharded-memory", "sharded-disk"]


def make_group(seed: int = 0, name: str = "h.0") -> Tuple[Block, FlatGroup]:
    """A block of one fp32 flat group whose parameters point into its device buffer (the cpu here)."""
    gen = torch.Generator().manual_seed(seed)
    slots: List[ParamSlot] = []
    offset = 0
    for i, shape in enumerate(TRAINABLE_SHAPES + FROZEN_SHAPES):
        trainable = i < len(TRAINABLE_SHAPES)
        param = nn.Parameter(torch.randn(shape, generator=gen), requires_grad=trainable)
        slots.append(ParamSlot(f"{name}.p{i}", param, param.shape, offset, param.numel(), trainable))
        offset += param.numel()
    group = FlatGroup(torch.float32, slots, name)
    buffer = torch.empty(group.numel, dtype=group.dtype)
    for slot in slots:
        buffer[slot.offset:slot.offset + slot.numel].copy_(slot.param.detach().reshape(-1))
    group.device_buffer = buffer
    group.point_params_at(buffer)
    return Block(name, 0, [group]), group


@dataclass
class StoreCase:
    kind: str
    store: StateStore
    group: FlatGroup
    lo: int  # the store's part of the group's trainable range
    hi: int
    uses_cpu_kernel: bool
    writes_compute_copy: bool
    reads_ahead: bool
    swap: Optional[SwapStore] = None  # the swap file of a disk store
    ring: Optional[DiskRing] = None  # and the ring it streams through
    load_copies: bool = True  # `load` hands out copies (a ring slot), not the state itself


@contextlib.contextmanager
def _disk(directory: str, block: Block, shard: Optional[Shard]) -> Iterator[Tuple[DiskRing, SwapStore]]:
    numel_of = None if shard is None else (lambda group: shard.numel)
    records, size = plan_swap_layout([g.shape(block.name) for g in block.groups], numel_of)
    swap = SwapStore(directory, records, size)
    pool = StagingPool(min_ring_bytes())
    ring = DiskRing(swap, pool, min_ring_bytes(), 4)
    with ring.borrow(ring.depth) as slots:  # slots that held other groups' state before, as in an engine
        for sections in slots:
            for section in sections:
                section.fill_(float("nan"))
    try:
        yield ring, swap
    finally:
        try:
            ring.drain()
            ring.close()
        finally:
            swap.close()
            pool.close()


@contextlib.contextmanager
def open_store(kind: str, directory: str, seed: int = 0) -> Iterator[StoreCase]:
    """The store of `kind` over a fresh group (`make_group(seed)`); a disk store's swap file in `directory`."""
    block, group = make_group(seed)
    n, cpu = group.trainable_numel, torch.device("cpu")
    if kind == "memory-host":
        yield StoreCase(kind, MemoryStore(group, cpu, on_host=True), group, 0, n, True, True, False, load_copies=False)
    elif kind == "memory-device":  # the gpu tier's path (the compute device is the cpu here): fp32 aliased
        yield StoreCase(kind, MemoryStore(group, cpu, on_host=False), group, 0, n, False, False, False,
                        load_copies=False)
    elif kind == "disk":
        with _disk(directory, block, None) as (ring, swap):
            yield StoreCase(kind, DiskStore(group, ring), group, 0, n, True, True, True, swap, ring)
    elif kind == "sharded-memory":
        inner = MemoryStore(ShardGroup(group, SHARD), cpu, on_host=True)  # type: ignore[arg-type]
        yield StoreCase(kind, ShardedStore(inner, SHARD), group, SHARD.lo, SHARD.hi, True, True, False,
                        load_copies=False)
    elif kind == "sharded-disk":
        with _disk(directory, block, SHARD) as (ring, swap):
            inner = DiskStore(ShardGroup(group, SHARD), ring)  # type: ignore[arg-type]
            yield StoreCase(kind, ShardedStore(inner, SHARD), group, SHARD.lo, SHARD.hi, True, True, True, swap,
                            ring)
    else:
        raise ValueError(kind)


def read_all(store: StateStore) -> Tuple[List[Tuple[int, int]], torch.Tensor, torch.Tensor, torch.Tensor]:
    """The spans `reading()` yields, and its three sections concatenated (copied: a chunk's views are valid
    only until the next one)."""
    spans, parts = [], ([], [], [])
    with store.reading() as chunks:
        for start, stop, views in chunks:
            spans.append((start, stop))
            for part, view in zip(parts, views):
                assert view.numel() == stop - start
                part.append(view.detach().clone())
    return spans, torch.cat(parts[0]), torch.cat(parts[1]), torch.cat(parts[2])


def pattern(lo: int, hi: int, section: int, salt: float = 0.0) -> torch.Tensor:
    """Distinct values for elements [lo, hi) of a section: a wrong offset or section shows."""
    return torch.arange(lo, hi, dtype=torch.float32) * 1e-3 + section * 10.0 + salt


def set_state(store: StateStore, salt: float) -> None:
    """Give every chunk `pattern(..., salt)` through load/store."""
    for start, stop in store.chunks():
        chunk = store.load(start, stop)
        for section, view in enumerate((chunk.master, chunk.exp_avg, chunk.exp_avg_sq)):
            view.copy_(pattern(start, stop, section, salt))
        store.store(chunk)


def ring_slots_all_back(case: StoreCase, settle: bool = True) -> bool:
    """Whether every slot of a disk store's ring is free (once its writes are done and its reads ahead
    dropped, when `settle`); true for a store without a ring."""
    if settle:
        case.store.drain()
    return case.ring is None or len(case.ring._slots.free) == case.ring.depth


class CallLog:
    """A store seen through a log of its update-side calls: ("load" | "store" | "abandon", start)."""

    def __init__(self, inner: StateStore) -> None:
        self._inner = inner
        self.calls: List[Tuple[str, int]] = []

    def __getattr__(self, name: str):
        return getattr(self._inner, name)

    def load(self, start: int, stop: int, shadow: bool = False):
        self.calls.append(("load", start))
        return self._inner.load(start, stop, shadow)

    def store(self, chunk) -> None:
        self.calls.append(("store", chunk.start))
        self._inner.store(chunk)

    def abandon(self, chunk) -> None:
        self.calls.append(("abandon", chunk.start))
        self._inner.abandon(chunk)
