"""The `StateStore` protocol (offload/scheduler/state/state_store.py), the same checks over every store in
stores.STORE_KINDS: the memory store on the host and on the (cpu as) compute device, the disk store over a
real swap file and ring, and a rank's part of a group (`ShardedStore`) over each of those."""

from __future__ import annotations

import pytest
import torch

from offload.scheduler.state.state_store import overwrite_master
from tests.unit.state.stores import (
    STORE_KINDS,
    CallLog,
    open_store,
    pattern,
    read_all,
    ring_slots_all_back,
    set_state,
)


@pytest.fixture(params=STORE_KINDS)
def case(request, tmp_path):
    with open_store(request.param, str(tmp_path)) as opened:
        yield opened


def _patterns(case, salt: float):
    return tuple(pattern(case.lo, case.hi, section, salt) for section in range(3))


def _assert_state(case, expected) -> None:
    spans, *sections = read_all(case.store)
    assert spans == case.store.chunks()
    for name, got, want in zip(("master", "exp_avg", "exp_avg_sq"), sections, expected):
        assert torch.equal(got, want), f"{case.kind}: {name} differs"


def test_store_reports_its_kernel_compute_copy_and_read_ahead(case):
    store = case.store
    assert store.uses_cpu_kernel is case.uses_cpu_kernel
    assert store.writes_compute_copy is case.writes_compute_copy
    assert store.reads_ahead is case.reads_ahead
    assert (store.swap_sections() is not None) == (case.kind == "disk")  # only a whole record is cloned


def test_chunks_cover_the_stores_part_of_the_trainable_range_in_order(case):
    chunks = case.store.chunks()
    assert chunks[0][0] == case.lo and chunks[-1][1] == case.hi
    assert all(start < stop for start, stop in chunks)
    assert all(a[1] == b[0] for a, b in zip(chunks, chunks[1:])), chunks  # contiguous, no overlap
    if case.ring is not None:
        assert len(chunks) > 1 and max(b - a for a, b in chunks) <= case.ring.chunk_numel


def test_a_new_store_holds_the_groups_weights_and_zero_moments(case):
    weights = case.group.device_buffer[case.lo:case.hi].clone()
    zeros = torch.zeros(case.hi - case.lo)
    _assert_state(case, (weights, zeros, zeros))


def test_load_and_store_round_trip_every_chunk(case):
    set_state(case.store, salt=1.0)
    for start, stop in case.store.chunks():
        chunk = case.store.load(start, stop)
        assert (chunk.start, chunk.stop) == (start, stop)
        for section, view in enumerate((chunk.master, chunk.exp_avg, chunk.exp_avg_sq)):
            assert torch.equal(view, pattern(start, stop, section, 1.0)), (case.kind, start, section)
        case.store.store(chunk)
    _assert_state(case, _patterns(case, 1.0))
    assert ring_slots_all_back(case)


def test_abandon_writes_nothing_back_and_returns_the_chunk(case):
    set_state(case.store, salt=1.0)
    for start, stop in case.store.chunks():
        chunk = case.store.load(start, stop)
        if case.load_copies:  # a slot: what the failed update left in it must not reach the state
            for view in (chunk.master, chunk.exp_avg, chunk.exp_avg_sq):
                view.fill_(-1.0)
        case.store.abandon(chunk)
    _assert_state(case, _patterns(case, 1.0))
    assert ring_slots_all_back(case)
    set_state(case.store, salt=2.0)  # and the store still updates
    _assert_state(case, _patterns(case, 2.0))


def test_announce_then_discard_or_load_loses_no_data(case):
    set_state(case.store, salt=1.0)
    case.store.drain()
    case.store.announce()
    if case.ring is not None:
        assert case.ring.stats()["nvme_chunks_read_ahead"] > 0
    case.store.discard()  # the update will not run: the reads ahead give their slots back now
    assert ring_slots_all_back(case, settle=False)
    _assert_state(case, _patterns(case, 1.0))

    case.store.announce()
    set_state(case.store, salt=2.0)  # loads what was read ahead, stores new values
    case.store.announce()  # reads ahead what was just written, once it is written
    for start, stop in case.store.chunks():
        chunk = case.store.load(start, stop)
        assert torch.equal(chunk.exp_avg, pattern(start, stop, 1, 2.0)), (case.kind, start)
        case.store.store(chunk)
    case.store.announce()
    case.store.discard()
    _assert_state(case, _patterns(case, 2.0))
    assert ring_slots_all_back(case)


def test_reading_yields_every_chunk_in_order_with_the_current_values(case):
    set_state(case.store, salt=3.0)
    case.store.drain()
    _assert_state(case, _patterns(case, 3.0))  # spans == chunks(), in order, each with its values


def test_write_replaces_the_state_chunk_by_chunk(case):
    set_state(case.store, salt=1.0)
    filled = []

    def fill(start, stop, views):
        filled.append((start, stop))
        for section, view in enumerate(views):
            assert view.numel() == stop - start
            view.copy_(pattern(start, stop, section, 5.0))

    case.store.write(fill)
    assert filled == case.store.chunks()
    _assert_state(case, _patterns(case, 5.0))
    for start, stop in case.store.chunks():  # the update path sees the new state too
        chunk = case.store.load(start, stop)
        assert torch.equal(chunk.master, pattern(start, stop, 0, 5.0))
        case.store.store(chunk)
    assert ring_slots_all_back(case)


def test_overwrite_master_changes_only_the_given_ranges_and_keeps_the_moments(case):
    set_state(case.store, salt=1.0)
    n = case.group.trainable_numel
    weights = -torch.arange(n, dtype=torch.float64)  # the group's whole trainable range, another dtype
    ranges = [(100, 200), (2000, 2100), (3000, 3400)]  # across a chunk boundary; partly outside a shard
    logged = CallLog(case.store)
    overwrite_master(logged, weights, ranges)  # type: ignore[arg-type]

    master, exp_avg, exp_avg_sq = _patterns(case, 1.0)
    for a, b in ranges:
        a, b = max(a, case.lo), min(b, case.hi)
        if a < b:
            master[a - case.lo:b - case.lo] = weights[a:b].float()
    _assert_state(case, (master, exp_avg, exp_avg_sq))
    touched = [s for s, e in case.store.chunks() if any(a < e and b > s for a, b in ranges)]
    assert [start for what, start in logged.calls if what == "load"] == touched  # the others are not read
    assert [start for what, start in logged.calls if what == "store"] == touched
    assert ring_slots_all_back(case)
