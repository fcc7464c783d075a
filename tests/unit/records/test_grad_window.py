"""The nvme tier's gradient window on its own: `WindowedGradAccumulator` takes its buffer from a `GradPool` at
the first gradient and gives it back at `release` (offload/scheduler/grads/grad_home.py), and the pool waits
while full only when an update will give bytes back (offload/scheduler/grads/grad_window.py)."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from offload.errors import OffloadError
from offload.scheduler.records.held_grad import is_held
from offload.tiers.grad_window import GradPool
from tests.unit.records.groups import grad_of, make_group, make_home, piece

GROUP_BYTES = 23 * 4  # the test group's trainable range, fp32


class FakeUpdates:
    """`has_work()`: whether an update is queued or running (the step worker's answer), set by the test."""

    def __init__(self, working: bool) -> None:
        self.working = working

    def on_own_thread(self) -> bool:
        return False

    def has_work(self) -> bool:
        return self.working


def _in_thread(target) -> threading.Thread:
    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    return thread


def _returns_at_once(target) -> None:
    """Run `target` in a thread: it must return within a second, not wait for bytes (a hang fails here)."""
    thread = _in_thread(target)
    thread.join(1.0)
    assert not thread.is_alive(), "waited for bytes that nothing would give back"


def test_the_buffer_is_taken_at_the_first_gradient_and_given_back_at_release():
    group = make_group()
    pool = GradPool(1 << 20)
    home, _copies = make_home("windowed", group, pool=pool)
    assert home.grad is None and home.nbytes == 0 and pool.in_use == 0
    home.accumulate(1, grad_of(group, 1))
    assert pool.in_use == GROUP_BYTES and home.nbytes == GROUP_BYTES and pool.peak == GROUP_BYTES
    home.release()
    assert pool.in_use == 0 and home.grad is None and home.nbytes == 0
    assert home.ready_indices() == [] and home.lost == {1}
    home.release()  # nothing to give back twice
    assert pool.in_use == 0


def test_adding_to_a_released_gradient_raises_naming_the_parameter():
    group = make_group()
    home, _copies = make_home("windowed", group)
    home.accumulate(0, grad_of(group, 0))
    home.release()
    with pytest.raises(OffloadError, match=r"'blk\.p0' was given back after its update"):
        home.accumulate(0, grad_of(group, 0))
    g1 = grad_of(group, 1)
    home.accumulate(1, g1)  # one that had no gradient takes a new buffer
    assert torch.equal(piece(home, 1), g1.reshape(-1))
    g0 = grad_of(group, 0)
    home.accumulate(0, g0, fresh=True)  # its `.grad` was cleared outside the engine: a new gradient
    assert torch.equal(piece(home, 0), g0.reshape(-1))


def test_zero_to_none_after_release_forgets_the_released_gradients():
    group = make_group()
    home, _copies = make_home("windowed", group)
    home.accumulate(0, grad_of(group, 0))
    home.release()
    home.zero(set_to_none=True)
    assert home.lost == set() and home.pool.in_use == 0
    g = grad_of(group, 0)
    home.accumulate(0, g)
    assert torch.equal(piece(home, 0), g.reshape(-1))


def test_zero_keeping_zeros_after_release_holds_zeros_without_a_buffer():
    group = make_group()
    home, _copies = make_home("windowed", group)
    home.accumulate(0, grad_of(group, 0))
    home.release()
    home.zero(set_to_none=False)  # torch would keep a zero gradient for it
    assert is_held(group.trainable_slots[0].param.grad) and group.trainable_slots[1].param.grad is None
    assert home.ready_indices() == [0] and home.grad is None and home.pool.in_use == 0
    assert home.norms() == [(group.trainable_slots[0].param, 0.0)] and home.all_finite()
    g = grad_of(group, 0)
    home.accumulate(0, g)  # a new buffer of zeros, added to
    assert torch.equal(piece(home, 0), g.reshape(-1)) and home.pool.in_use == GROUP_BYTES


@pytest.mark.parametrize("bound", [None, False])
def test_acquire_past_the_budget_with_no_update_to_wait_for_goes_over_and_counts_it(bound):
    pool = GradPool(100)
    if bound is not None:
        pool.bind(FakeUpdates(bound))
    pool.acquire(80)
    _returns_at_once(lambda: pool.acquire(40))  # nothing would give bytes back
    assert pool.in_use == 120 and pool.peak == 120 and pool.over_budget_events == 1


def test_a_first_acquire_larger_than_the_budget_is_not_over_budget():
    pool = GradPool(10)
    pool.bind(FakeUpdates(True))
    _returns_at_once(lambda: pool.acquire(50))  # the window is empty: one block's gradient always fits
    assert pool.in_use == 50 and pool.over_budget_events == 0


def test_acquire_without_waiting_goes_over_even_while_an_update_runs():
    pool = GradPool(100)
    pool.bind(FakeUpdates(True))
    pool.acquire(80)
    _returns_at_once(lambda: pool.acquire(40, wait=False))  # the worker: nothing else would free bytes for it
    assert pool.in_use == 120 and pool.over_budget_events == 1


def test_acquire_waits_while_full_until_an_update_gives_bytes_back():
    pool = GradPool(100)
    pool.bind(FakeUpdates(True))
    pool.acquire(80)
    waiter = _in_thread(lambda: pool.acquire(40))
    time.sleep(0.3)
    assert waiter.is_alive() and pool.in_use == 80, "acquired past the budget while an update could free bytes"
    pool.release(80)
    waiter.join(10)
    assert not waiter.is_alive()
    assert pool.in_use == 40 and pool.over_budget_events == 0


def test_a_waiting_acquire_goes_over_once_no_update_is_left():
    pool = GradPool(100)
    updates = FakeUpdates(True)
    pool.bind(updates)
    pool.acquire(80)
    waiter = _in_thread(lambda: pool.acquire(40))
    time.sleep(0.2)
    assert waiter.is_alive()
    updates.working = False  # the last update finished without giving bytes back
    waiter.join(10)
    assert not waiter.is_alive()
    assert pool.in_use == 120 and pool.over_budget_events == 1


def test_a_windowed_home_waits_for_another_homes_release_when_the_window_is_full():
    pool = GradPool(GROUP_BYTES)  # room for one group's gradient
    pool.bind(FakeUpdates(True))
    first_group, second_group = make_group(name="a"), make_group(name="b")
    first, _copies = make_home("windowed", first_group, pool=pool)
    second, _copies = make_home("windowed", second_group, pool=pool)
    first.accumulate(0, grad_of(first_group, 0))
    g = grad_of(second_group, 0)
    waiter = _in_thread(lambda: second.accumulate(0, g))
    time.sleep(0.3)
    assert waiter.is_alive() and second.grad is None
    first.release()  # the first group's update is done
    waiter.join(10)
    assert not waiter.is_alive()
    assert torch.equal(piece(second, 0), g.reshape(-1))
    assert pool.in_use == GROUP_BYTES and pool.over_budget_events == 0


def test_a_buffer_given_back_is_reused_zeroed_and_the_spares_stay_within_the_budget():
    """Reusing a given-back buffer saves a page fault per 4 KiB of a fresh mapping; in use plus spares never pass
    the budget, and a buffer something else still views is never handed out again."""
    pool = GradPool(3000)
    first = pool.take_zeros(250, torch.float32)  # 1000 bytes
    first.fill_(7.0)
    address = first.data_ptr()
    pool.give_back(first)
    assert pool.in_use == 0 and pool.spare_bytes == 1000
    again = pool.take_zeros(250, torch.float32)
    assert again.data_ptr() == address and bool((again == 0).all())  # the same pages, zeros
    assert pool.spare_bytes == 0 and pool.in_use == 1000
    other = pool.take_zeros(100, torch.float32)  # another size: a fresh mapping
    assert other.data_ptr() != address
    pool.give_back(again)
    pool.give_back(other)
    assert pool.spare_bytes == 1400
    big = pool.take_zeros(600, torch.float32)  # 2400 bytes in use: the spares (1400) no longer fit beside it
    assert pool.in_use + pool.spare_bytes <= pool.budget_bytes
    viewed = pool.take_zeros(50, torch.float32)
    view = viewed[10:20]
    pool.give_back(viewed)  # a view still reads its memory: not kept
    assert all(t.data_ptr() != viewed.data_ptr() for t in pool._spares)
    del view
    pool.give_back(big)
    assert pool.in_use == 0 and pool.spare_bytes <= pool.budget_bytes
    assert pool.peak <= pool.budget_bytes  # the host bytes held at most, buffers in use and spares together
