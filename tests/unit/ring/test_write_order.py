"""ring_slots.WriteOrder on its own: each ordering rule of the nvme ring, over a real slot pool and requests the
test completes (or fails) by hand. The same rules through the ring and a real swap file: test_ring_order.py."""

from __future__ import annotations

import threading

import pytest

from offload.planner.ring import min_ring_bytes
from offload.scheduler.ring.ring_slots import (
    CHUNK_RECORDS,
    KEEP_FOR_LOAD,
    STATE_RECORD,
    InFlight,
    Records,
    SlotPool,
    WriteOrder,
)
from offload.tiers.disk import RecordKind
from offload.tiers.host import StagingPool

DEPTH = 4


class Request:
    """A request of a write: done when the test says so, or once waited for; fails with `error` if given."""

    def __init__(self, done: bool = False, error: BaseException = None) -> None:
        self.finished = done
        self.error = error
        self.waited = 0

    def done(self) -> bool:
        return self.finished

    def result(self, timeout=None) -> int:
        self.waited += 1
        self.finished = True
        if self.error is not None:
            raise self.error
        return 0


@pytest.fixture
def order():
    """(WriteOrder, its SlotPool) over `DEPTH` slots of the smallest ring."""
    staging = StagingPool(min_ring_bytes(DEPTH))
    slots = SlotPool(staging, min_ring_bytes(DEPTH), DEPTH)
    try:
        yield WriteOrder(slots), slots
    finally:
        slots.close()
        staging.close()


GRADS = frozenset({RecordKind.GRADS})


def _write(order: WriteOrder, slots: SlotPool, group, start: int, stop: int, request: Request,
           records: Records = CHUNK_RECORDS) -> InFlight:
    """Take a slot and register a write of [start, stop) of the group's `records` from it, as `DiskRing.store`
    does (a state chunk's, by default)."""
    slot = order.take()
    write = InFlight(slot, group, records, start, stop, [request])  # type: ignore[list-item]
    with slots.lock:
        order.register_locked(write)
    return write


def test_a_read_of_a_range_waits_for_the_write_of_that_range_only(order):
    order, slots = order
    group, other = object(), object()
    first = _write(order, slots, group, 0, 100, Request())
    second = _write(order, slots, group, 100, 200, Request())
    third = _write(order, slots, other, 0, 100, Request())
    order.wait_for_writes_of(group, CHUNK_RECORDS, 50, 150)  # overlaps the first two writes
    assert [w.futures[0].waited for w in (first, second, third)] == [1, 1, 0]
    assert order.in_flight() == 1 and len(slots.free) == DEPTH - 1
    with slots.lock:
        assert order.writing_locked(other, CHUNK_RECORDS, 99, 100)
        assert not order.writing_locked(other, CHUNK_RECORDS, 100, 200)
        assert not order.writing_locked(group, CHUNK_RECORDS, 0, 200)


def test_a_slot_is_reused_only_after_its_write_is_done(order):
    order, slots = order
    group = object()
    writes = [_write(order, slots, group, 100 * i, 100 * (i + 1), Request()) for i in range(DEPTH)]
    order.reap()  # nothing done yet: every slot stays with its write
    assert not slots.free and order.in_flight() == DEPTH
    writes[1].futures[0].finished = True
    order.reap()  # the oldest is not done: reaping goes oldest first and never blocks
    assert not slots.free
    slot = order.take()  # no free slot: the oldest write is waited for, then its slot is handed out
    assert slot is writes[0].slot and writes[0].futures[0].waited == 1
    order.reap()  # the second write was done: reaped now
    assert slots.free == [writes[1].slot] and order.in_flight() == DEPTH - 2


def test_a_failed_write_gives_its_slot_back_and_raises(order):
    order, slots = order
    write = _write(order, slots, object(), 0, 100, Request(done=True, error=OSError(5, "write failed")))
    with pytest.raises(OSError, match="write failed"):
        order.reap()
    assert order.in_flight() == 0 and write.slot in slots.free


def test_a_write_is_retired_once_when_two_threads_retire_it(order):
    order, slots = order
    request = Request()
    write = _write(order, slots, object(), 0, 100, request)
    threads = [threading.Thread(target=order.retire, args=(write,)) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(10)
    order.retire(write)  # and a third time, after it is gone: a no-op
    assert len(slots.free) == DEPTH and len(set(map(id, slots.free))) == DEPTH


def test_reads_ahead_never_take_the_last_free_slot(order):
    order, slots = order
    group = object()
    with slots.lock:
        ahead = order.take_ahead_locked(DEPTH - KEEP_FOR_LOAD, group, CHUNK_RECORDS, 0, 100)
        assert ahead is not None and len(slots.free) == KEEP_FOR_LOAD
        assert order.take_ahead_locked(1, group, CHUNK_RECORDS, 100, 200) is None  # the last one is the worker's
    slot = order.take()  # which the worker gets
    assert not slots.free
    for taken in ahead + [slot]:
        slots.give_back(taken)
    with slots.lock:
        assert order.take_ahead_locked(DEPTH - 1, group, CHUNK_RECORDS, 0, 100, keep=2) is None
        assert len(slots.free) == DEPTH  # a refusal takes nothing


def test_a_range_is_not_read_ahead_while_its_write_is_in_flight(order):
    order, slots = order
    group = object()
    write = _write(order, slots, group, 0, 100, Request())
    with slots.lock:
        assert order.take_ahead_locked(1, group, CHUNK_RECORDS, 50, 60) is None
        assert order.take_ahead_locked(1, group, CHUNK_RECORDS, 100, 200) is not None  # another range may go
    write.futures[0].finished = True
    order.reap()
    with slots.lock:
        assert order.take_ahead_locked(1, group, CHUNK_RECORDS, 50, 60) is not None


def test_a_write_of_one_record_never_holds_up_another_records_read(order):
    """A gradient parking right after its block's speculative update writes the gradient's record; the update's
    state writes of the same group are in flight, and neither waits for the other (they are different bytes)."""
    order, slots = order
    group = object()
    state = _write(order, slots, group, 0, 100, Request())
    grads = _write(order, slots, group, 0, 100, Request(), GRADS)
    order.wait_for_writes_of(group, GRADS, 0, 100)  # before the gradient's next write, or its read back
    assert (state.futures[0].waited, grads.futures[0].waited) == (0, 1)
    with slots.lock:
        assert order.writing_locked(group, STATE_RECORD, 0, 100) and not order.writing_locked(group, GRADS, 0, 100)
        assert order.take_ahead_locked(1, group, GRADS, 0, 100) is not None  # its gradient may be read ahead
        assert order.take_ahead_locked(1, group, STATE_RECORD, 0, 100) is None  # its state not yet
    order.wait_for_writes_of(group, STATE_RECORD, 0, 100)  # a master read waits for the chunk's write
    assert state.futures[0].waited == 1


def test_an_error_met_on_the_training_thread_is_kept_for_the_worker(order):
    order, slots = order
    _write(order, slots, object(), 0, 100, Request(done=True, error=OSError(5, "write failed")))
    assert order.reap_or_defer() is False  # the training thread goes on
    with order.deferring_errors():
        raise OSError(28, "a later error")  # kept only if none is: the first one is reported
    with pytest.raises(OSError, match="write failed"):
        order.raise_deferred()  # the worker's next load (or drain)
    order.raise_deferred()  # reported once
    assert order.reap_or_defer() is True


def test_waits_are_timed(order):
    order, _slots = order
    order.wait([Request(done=True)])  # type: ignore[list-item]
    assert order.io_wait_seconds > 0
