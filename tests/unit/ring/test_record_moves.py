"""Disk-resident compute weights through the nvme ring's slots (ring/weight_io.py): round trips of several
slots' worth, their order after the chunk writes of their group, and prefetches that leave the chunk path
its slots. A real swap file; writes held in flight on command through gated_swap.GatedSwap."""

from __future__ import annotations

import torch
from torch import nn

from offload.planner.ring import min_ring_bytes
from offload.scheduler.ring.record_moves import KEEP_FOR_CHUNKS
from tests.unit.ring.gated_swap import check_no_slot_reused_in_flight, gated_ring


def _copy(dst, src):
    dst.copy_(src)


def test_weights_round_trip_through_the_slots_in_several_pieces(tmp_path):
    model = nn.Sequential(nn.Linear(256, 101))  # 25957 elements: several slots' worth
    for dtype in (torch.float32, torch.bfloat16):
        directory = tmp_path / str(dtype)
        directory.mkdir()
        with gated_ring(directory, model, min_ring_bytes(), weights_on_disk=True, dtype=dtype) as (ring, swap, groups):
            group = groups[0]
            weights = torch.randn(group.numel).to(dtype)
            ring.weights.write_from(group, weights)
            back = torch.empty_like(weights)
            ring.weights.read_into(group, back, _copy)
            assert torch.equal(back, weights)
            writes = [e for e in swap.events if e[0] == "write weights"]
            reads = [e for e in swap.events if e[0] == "read weights"]
            assert [e[2] for e in writes] == list(range(0, group.numel, ring.chunk_numel))  # the updates' chunks
            per_slot = ring.chunk_numel * 16 // weights.element_size()
            assert [e[2] for e in reads] == list(range(0, group.numel, per_slot))  # a slot's worth each
            assert len(ring._slots.free) == ring.depth


def test_a_weight_read_starts_after_the_chunk_writes_of_its_group(tmp_path):
    with gated_ring(tmp_path, nn.Sequential(nn.Linear(64, 100)), min_ring_bytes(), weights_on_disk=True) as (
            ring, swap, groups):
        group = groups[0]
        ring.weights.write_from(group, torch.zeros(group.numel))
        swap.hold_writes = True
        ring.write_fresh(group, lambda a, b, sections: [t.fill_(1.0) for t in sections])  # weights ride along
        assert ring.weights.start_read(group, 4) is None, "a prefetch while a write of the group is in flight"
        weights = torch.empty(group.numel)
        ring.weights.read_into(group, weights, _copy)
        events = swap.events
        first_read = next(i for i, e in enumerate(events) if e[0] == "read weights")
        for start, _stop in ring.chunks(group):
            assert events.index(next(e for e in events if e[:3] == ("write done", group.key, start))) < first_read
        check_no_slot_reused_in_flight(events)
        ring.drain()


def test_a_prefetch_reads_ahead_and_gives_its_slots_back(tmp_path):
    with gated_ring(tmp_path, nn.Sequential(nn.Linear(64, 100)), min_ring_bytes(), weights_on_disk=True) as (
            ring, _swap, groups):
        group = groups[0]
        weights = torch.randn(group.numel)
        ring.weights.write_from(group, weights)
        handle = ring.weights.start_read(group, 4)
        assert handle is not None and len(ring._slots.free) == ring.depth - len(handle)
        back = torch.empty_like(weights)
        ring.weights.finish_read(handle, back, _copy)
        assert torch.equal(back, weights) and len(ring._slots.free) == ring.depth
        handle = ring.weights.start_read(group, 4)
        ring.weights.cancel_read(handle)
        assert not handle and len(ring._slots.free) == ring.depth


def test_a_prefetch_leaves_the_chunk_path_its_slots(tmp_path):
    model = nn.Sequential(nn.Linear(64, 100), nn.Linear(256, 101))
    with gated_ring(tmp_path, model, min_ring_bytes(), weights_on_disk=True) as (ring, _swap, groups):
        small, large = groups
        pieces = -(-large.numel // (ring.chunk_numel * 4))
        assert pieces + KEEP_FOR_CHUNKS > ring.depth
        assert ring.weights.start_read(large, 4) is None, "would take the slots the worker needs"
        assert len(ring._slots.free) == ring.depth
        handle = ring.weights.start_read(small, 4)  # one piece: leaves KEEP_FOR_CHUNKS free
        assert handle is not None and len(ring._slots.free) >= KEEP_FOR_CHUNKS
        ring.weights.cancel_read(handle)


def test_a_parked_gradients_writes_stay_in_flight_and_its_read_waits_for_them(tmp_path):
    """A gradient parked on disk does not hold the worker while it is written (its pieces' writes are
    registered in flight, as an update's chunks are); reading it back first waits for them."""
    with gated_ring(tmp_path, nn.Sequential(nn.Linear(256, 101)), min_ring_bytes(), grads_on_disk=True) as (
            ring, swap, groups):
        group = groups[0]
        swap.hold_writes = True
        grad = torch.randn(group.trainable_numel)
        ring.grads.write_from(group, grad)  # returns with its writes still held
        started = sum(e[0] == "write grads" for e in swap.events)
        done = sum(e[0] == "write grads done" for e in swap.events)
        assert ring._order.in_flight() > 0 and done < started, (done, started)  # only those a slot was needed for
        swap.finish_writes()
        back = torch.empty_like(grad)
        ring.grads.read_into(group, back, _copy)
        assert torch.equal(back, grad)
        check_no_slot_reused_in_flight(swap.events)
        ring.drain()
        assert len(ring._slots.free) == ring.depth
