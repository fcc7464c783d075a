"""DiskRing: chunked read-update-write through a bounded ring; order changes never deadlock or lose data."""

from __future__ import annotations

import contextlib

import pytest
import torch
from torch import nn

from offload.optim.moment_format import INT8_BLOCK, MomentFormat
from offload.planner.ring import (
    AREA_ALIGNMENT,
    CHUNK_GRANULE,
    MAX_READ_AHEAD_DEPTH,
    RingSlots,
    chunk_granule,
    chunk_numel_for,
    min_ring_bytes,
    read_ahead_bytes,
    ring_depth_for,
    ring_size_for,
    slot_bytes_per_element,
    slot_layout,
)
from offload.scheduler.blocks.block import build_blocks
from offload.scheduler.ring.disk_ring import DiskRing
from offload.tiers.disk import SwapStore
from offload.tiers.host import StagingPool
from offload.tiers.swap_layout import plan_swap_layout


def _groups(model):
    blocks = build_blocks(model, torch.float32)
    for block in blocks:
        for group in block.groups:
            group.device_buffer = torch.zeros(group.numel)
    return blocks, [g for b in blocks for g in b.groups]


@contextlib.contextmanager
def _ring(tmp_path, model, ring_bytes):
    """(ring, flat groups) over a swap file for `model`'s blocks; everything closed after."""
    blocks, groups = _groups(model)
    records, size = plan_swap_layout([g.shape(b.name) for b in blocks for g in b.groups])
    store = SwapStore(str(tmp_path), records, size)
    pool = StagingPool(ring_bytes)
    try:
        yield DiskRing(store, pool, ring_bytes), groups
    finally:
        store.close()
        pool.close()


def test_out_of_order_loads_with_the_smallest_ring(tmp_path):
    model = nn.Sequential(*[nn.Linear(64, 100) for _ in range(4)])  # 6500 elements: several chunks each
    with _ring(tmp_path, model, min_ring_bytes()) as (ring, groups):
        assert ring.chunk_numel == CHUNK_GRANULE and len(ring.chunks(groups[0])) > 1
        for value, group in enumerate(groups):
            ring.write_fresh(group, lambda a, b, sec, v=value: [t.fill_(v + a) for t in sec])
        ring.announce(groups)  # announced in one order ...
        for round_ in range(2):
            for value, group in reversed(list(enumerate(groups))):  # ... loaded in another
                for start, stop in ring.chunks(group):
                    sections = ring.load(group, start, stop)
                    assert all(bool((t == value + start + round_).all()) for t in sections)
                    for t in sections:
                        t.add_(1)
                    ring.store(group, start, stop, sections)
        ring.drain()


def test_an_announcement_while_a_chunk_is_being_loaded_never_reads_it_ahead(tmp_path):
    """The training thread may announce a group at any moment of the worker's `load`: a read-ahead started
    before the chunk counts as checked out would keep its pre-update bytes for the next update (once seen
    as a swap-checksum mismatch in the nvme parity tests)."""
    with _ring(tmp_path, nn.Sequential(nn.Linear(64, 100)), 4 * min_ring_bytes()) as (ring, groups):
        group = groups[0]
        ring.write_fresh(group, lambda a, b, sec: [t.fill_(1.0) for t in sec])
        ring.drain()
        take_slot = ring._order.take
        ring._order.take = lambda: (ring.announce([group]), take_slot())[1]  # the worst moment to announce
        for expected in (1.0, 2.0, 3.0):
            for start, stop in ring.chunks(group):
                sections = ring.load(group, start, stop)
                assert all(bool((t == expected).all()) for t in sections), (expected, start)
                for t in sections:
                    t.add_(1)
                ring.store(group, start, stop, sections)
        ring.drain()


def test_ring_depth_grows_with_the_budget_in_whole_record_slots():
    record = 3 * CHUNK_GRANULE  # a record of three granules: its preferred slot is 3 x 2048 x 16 bytes
    slot = 3 * CHUNK_GRANULE * 16
    assert ring_size_for(record).preferred == 8 * slot
    assert ring_depth_for(min_ring_bytes(), record) == 4  # too small for whole records: 4 smaller slots
    assert ring_depth_for(6 * slot, record) == 6
    assert ring_depth_for(100 * slot, record) == 100  # a read-ahead ring (planner.read_ahead_bytes)
    assert ring_depth_for(5000 * slot, record) == MAX_READ_AHEAD_DEPTH


@pytest.mark.parametrize("moments", list(MomentFormat))
def test_a_slot_holds_as_many_elements_as_its_bytes_allow_in_the_moment_format(moments):
    """The most granules whose layout (each area 4 KiB-aligned) fits the slot's bytes: one granule more would not
    fit; chunks stay multiples of the granule (so of INT8_BLOCK: a chunk never starts inside a quantization block)."""
    granule = chunk_granule(moments)
    assert granule % INT8_BLOCK == 0
    for slot_bytes in (min_ring_bytes(1, moments), 1 << 20, (8 << 20) + 12345, 32 << 20):
        chunk = chunk_numel_for(slot_bytes, moments)
        assert chunk > 0 and chunk % granule == 0, (slot_bytes, chunk)
        layout = slot_layout(moments, chunk)
        assert layout.nbytes <= slot_bytes < slot_layout(moments, chunk + granule).nbytes
        assert all(offset % AREA_ALIGNMENT == 0 for offset in layout)
        assert layout.weights + 4 * chunk <= layout.nbytes  # room for compute weights of up to 4 bytes an element
    assert chunk_numel_for(min_ring_bytes(1, moments) - 1, moments) == 0
    assert chunk_numel_for(32 << 20, moments) * slot_bytes_per_element(moments) <= 32 << 20


def test_an_int8_slot_holds_over_one_and_a_half_times_the_elements_of_an_fp32_one():
    """fp32 16 B an element (master, m, v, the weights' room), bf16 12, int8 4 + 2 x (1 + 4/256) + 4."""
    assert [slot_bytes_per_element(m) for m in MomentFormat] == [16, 12, 10.03125]
    assert chunk_numel_for(32 << 20, MomentFormat.FP32) == (32 << 20) // 16  # as before: no padding in fp32
    for ring_bytes, depth in ((4 << 20, 4), (256 << 20, 8), (2 << 30, 64)):
        fp32, int8 = (RingSlots.fit(ring_bytes, depth, m) for m in (MomentFormat.FP32, MomentFormat.INT8))
        assert fp32.nbytes <= ring_bytes and int8.nbytes <= ring_bytes
        assert int8.in_flight_numel >= 1.5 * fp32.in_flight_numel, (ring_bytes, fp32, int8)


def test_host_memory_no_weight_needs_deepens_the_ring_up_to_the_state_itself():
    """[Note: the read-ahead ring]: the forward reads ahead as much of the coming backward's state as host
    memory left over holds, in whole slots; never more than the state, and nothing without a budget."""
    slot = 1 << 20
    assert read_ahead_bytes(None, 8 * slot, 100 * slot, slot) == 0
    assert read_ahead_bytes(50 * slot + 5, 8 * slot, 100 * slot, slot) == 50 * slot
    assert read_ahead_bytes(500 * slot, 8 * slot, 100 * slot, slot) == 92 * slot  # the state is 100 slots
    assert read_ahead_bytes(500 * slot, 5 * slot, 100 * slot, slot) == 0  # not even the preferred ring


def test_a_write_error_met_by_the_training_thread_is_raised_by_the_workers_next_load(tmp_path):
    """announce() runs in hooks on the training thread; a failed write it reaps must fail an update (which
    poisons the engine), not escape from the middle of scheduling a step."""
    import pytest

    with _ring(tmp_path, nn.Sequential(nn.Linear(64, 100)), 4 * min_ring_bytes()) as (ring, groups):
        group = groups[0]
        ring.write_fresh(group, lambda a, b, sec: [t.fill_(1.0) for t in sec])
        real_reap = ring._order.reap

        def failing_reap():
            ring._order.reap = real_reap
            raise OSError(5, "write failed")

        ring._order.reap = failing_reap
        ring.announce([group])  # does not raise on the training thread
        start, stop = ring.chunks(group)[0]
        with pytest.raises(OSError, match="write failed"):
            ring.load(group, start, stop)
        sections = ring.load(group, start, stop)  # reported once; the ring still works
        assert bool((sections[0] == 1.0).all())
        ring.abandon(sections)
        ring.drain()


def test_flush_writes_keeps_the_reads_ahead_and_drain_drops_them(tmp_path):
    """`engine.synchronize()` flushes writes: reads that waited for them start, reads ahead stay in flight
    (and see the flushed bytes); `drain` (checkpoints, close) gives every slot back."""
    with _ring(tmp_path, nn.Sequential(nn.Linear(64, 100)), 4 * min_ring_bytes()) as (ring, groups):
        group = groups[0]
        first = ring.chunks(group)[0]
        reap = ring._order.reap
        ring._order.reap = lambda: None  # the writes count as in flight, however fast the disk
        ring.write_fresh(group, lambda a, b, sec: [t.fill_(1.0) for t in sec])
        ring.announce([group])
        ring._order.reap = reap
        assert (group.key, first[0]) not in ring._reads, "a read must wait for the write of its range"
        ring.flush_writes()
        assert not ring._order.in_flight(), "flush waits for every write"
        assert (group.key, first[0]) in ring._reads, "flush starts the reads that waited"
        ring.flush_writes()
        assert (group.key, first[0]) in ring._reads, "flushing writes keeps the reads ahead"
        sections = ring.load(group, *first)
        assert all(bool((t == 1.0).all()) for t in sections)
        ring.store(group, *first, sections)
        ring.drain()
        assert not ring._reads and not ring._order.in_flight() and len(ring._slots.free) == ring.depth
