"""The nvme ring's ordering rules as the chunk path meets them: DiskRing over a real swap file, its writes
held in flight or failed on command through its store (gated_swap.GatedSwap), every request logged."""

from __future__ import annotations

import threading

import pytest
from torch import nn

from offload.planner.ring import min_ring_bytes
from offload.scheduler.ring.ring_slots import KEEP_FOR_LOAD
from tests.unit.ring.gated_swap import check_no_slot_reused_in_flight, gated_ring


def _fill(value: float):
    return lambda start, stop, sections: [t.fill_(value + start) for t in sections]


def _one_layer():
    return nn.Sequential(nn.Linear(64, 100))  # 6500 elements: one chunk of a 4 x min ring, 4 of the min ring


def _update(ring, group, start, stop, expected: float) -> None:
    """One chunk's update as adamw runs it: load, check, change, store."""
    sections = ring.load(group, start, stop)
    assert all(bool((t == expected).all()) for t in sections), (group.key, start, expected)
    for t in sections:
        t.add_(1)
    ring.store(group, start, stop, sections)


def _read_every_chunk(ring, monkeypatch) -> None:
    """No slot is taken for the chunk it still holds ([Note: clean chunks]): every load reads the disk."""
    monkeypatch.setattr(ring._slots, "pop_clean_locked", lambda key, stop: None)


def _index(events, what, key, start) -> int:
    return next(i for i, e in enumerate(events) if e[:3] == (what, key, start))


def test_a_read_of_a_chunk_starts_after_the_write_of_that_chunk_is_done(tmp_path, monkeypatch):
    with gated_ring(tmp_path, _one_layer(), min_ring_bytes()) as (ring, swap, groups):
        _read_every_chunk(ring, monkeypatch)
        group = groups[0]
        swap.hold_writes = True
        ring.write_fresh(group, _fill(1.0))  # four chunks, each write in flight in one of the four slots
        start, stop = ring.chunks(group)[2]
        _update(ring, group, start, stop, 1.0 + start)
        events = swap.events
        assert _index(events, "write done", group.key, start) < _index(events, "read", group.key, start)
        check_no_slot_reused_in_flight(events)
        swap.finish_writes()
        ring.drain()


def test_a_chunk_whose_write_is_done_is_loaded_from_its_slot_without_a_read(tmp_path):
    """[Note: clean chunks] The slot a write leaves still holds the chunk: the next load takes it, unless the
    slot went to another chunk, a drain came between, or the group's shadow was committed."""
    with gated_ring(tmp_path, _one_layer(), min_ring_bytes()) as (ring, swap, groups):
        group = groups[0]
        swap.hold_writes = True
        ring.write_fresh(group, _fill(1.0))
        chunks = ring.chunks(group)
        start, stop = chunks[2]
        _update(ring, group, start, stop, 1.0 + start)  # waits for the chunk's write, then takes its slot
        assert ring.stats()["nvme_chunks_clean"] == 1
        assert not any(e[:3] == ("read", group.key, start) for e in swap.events)
        swap.finish_writes()
        for a, b in chunks:  # every chunk once more: all four were left clean in their slots
            _update(ring, group, a, b, 1.0 + a + (1 if a == start else 0))
        assert ring.stats()["nvme_chunks_clean"] == 1 + len(chunks)
        assert not any(e[0] == "read" for e in swap.events)
        ring.drain()  # forgets them: whoever drains may change the swap file
        reads = sum(e[0] == "read" for e in swap.events)
        _update(ring, group, *chunks[0], 2.0 + chunks[0][0])
        assert sum(e[0] == "read" for e in swap.events) == reads + 1
        ring.drain()


def test_an_announced_chunk_is_read_ahead_only_once_its_write_is_done(tmp_path, monkeypatch):
    with gated_ring(tmp_path, _one_layer(), 4 * min_ring_bytes()) as (ring, swap, groups):
        _read_every_chunk(ring, monkeypatch)
        group = groups[0]
        (start, stop), = ring.chunks(group)
        swap.hold_writes = True
        ring.write_fresh(group, _fill(1.0))
        ring.announce([group])
        assert ring.stats()["nvme_chunks_read_ahead"] == 0, "read ahead while its write is in flight"
        swap.finish_writes()
        ring.announce([group])  # the write is reaped, the announced chunk read ahead
        assert ring.stats()["nvme_chunks_read_ahead"] == 1
        assert _index(swap.events, "write done", group.key, 0) < _index(swap.events, "read", group.key, 0)
        _update(ring, group, start, stop, 1.0)
        ring.drain()


def test_no_slot_is_reused_while_its_write_is_in_flight(tmp_path):
    model = nn.Sequential(*[nn.Linear(64, 100) for _ in range(3)])
    with gated_ring(tmp_path, model, min_ring_bytes()) as (ring, swap, groups):
        swap.hold_writes = True  # every write stays in flight until the ring must wait for it
        for group in groups:
            ring.write_fresh(group, _fill(1.0))
        for round_ in range(2):
            ring.announce(groups)
            for group in reversed(groups):
                for start, stop in ring.chunks(group):
                    _update(ring, group, start, stop, 1.0 + start + round_)
        check_no_slot_reused_in_flight(swap.events)
        swap.finish_writes()
        ring.drain()


def test_reads_ahead_leave_a_slot_for_the_next_needed_chunk(tmp_path):
    """More chunks announced than slots, then updated in another order: the worker always finds a slot."""
    model = nn.Sequential(*[nn.Linear(64, 100) for _ in range(4)])  # 16 chunks, 4 slots
    with gated_ring(tmp_path, model, min_ring_bytes()) as (ring, swap, groups):
        for group in groups:
            ring.write_fresh(group, _fill(1.0))
        ring.flush_writes()
        ring.announce(groups)
        assert ring.stats()["nvme_chunks_read_ahead"] == ring.depth - KEEP_FOR_LOAD
        assert len(ring._slots.free) == KEEP_FOR_LOAD

        def updates() -> None:
            for group in reversed(groups):  # none of these chunks was read ahead first
                for start, stop in reversed(ring.chunks(group)):
                    _update(ring, group, start, stop, 1.0 + start)

        worker = threading.Thread(target=updates, daemon=True)
        worker.start()
        worker.join(30)
        assert not worker.is_alive(), "the worker found no slot: deadlock"
        ring.drain()
        assert len(ring._slots.free) == ring.depth


def test_a_write_error_reaped_by_an_announcement_is_raised_by_the_workers_next_load(tmp_path):
    with gated_ring(tmp_path, _one_layer(), 4 * min_ring_bytes()) as (ring, swap, groups):
        group = groups[0]
        (start, stop), = ring.chunks(group)
        swap.hold_writes, swap.fail_writes = True, OSError(5, "write failed")
        ring.write_fresh(group, _fill(1.0))
        swap.hold_writes, swap.fail_writes = False, None
        swap.finish_writes()
        ring.announce([group])  # the training thread reaps the failed write: nothing raised here
        with pytest.raises(OSError, match="write failed"):
            ring.load(group, start, stop)
        _update(ring, group, start, stop, 1.0)  # reported once; the ring still works (the bytes landed)
        ring.drain()


def test_a_write_error_reaped_by_a_weight_prefetch_is_raised_by_drain(tmp_path):
    with gated_ring(tmp_path, _one_layer(), 4 * min_ring_bytes(), weights_on_disk=True) as (ring, swap, groups):
        group = groups[0]
        swap.hold_writes, swap.fail_writes = True, OSError(5, "write failed")
        ring.write_fresh(group, _fill(1.0))
        swap.hold_writes, swap.fail_writes = False, None
        swap.finish_writes()
        assert ring.weights.start_read(group, 4) is None  # a prefetch meets the error: kept, not raised
        with pytest.raises(OSError, match="write failed"):
            ring.drain()
        ring.drain()  # reported once


def test_the_ring_tells_which_groups_it_reads_ahead_in_the_order_it_began(tmp_path, monkeypatch):
    """What the update worker runs first (step_worker.py): the groups whose chunks are read ahead and not yet
    loaded, in the order their reads were issued; a group leaves once its chunks are loaded."""
    model = nn.Sequential(*[nn.Linear(64, 100) for _ in range(3)])
    with gated_ring(tmp_path, model, 4 * min_ring_bytes()) as (ring, swap, groups):
        _read_every_chunk(ring, monkeypatch)
        for group in groups:
            ring.write_fresh(group, _fill(1.0))
        ring.flush_writes()
        keys = [g.key for g in groups]
        assert ring.reading_order(keys) == []
        ring.announce([groups[2], groups[0]])
        assert ring.reading_order(keys) == [groups[2].key, groups[0].key]
        assert ring.reading_order([groups[0].key, groups[1].key]) == [groups[0].key]
        for start, stop in ring.chunks(groups[2]):
            _update(ring, groups[2], start, stop, 1.0 + start)
        assert ring.reading_order(keys) == [groups[0].key]
        ring.drain()
        assert ring.reading_order(keys) == []
