"""The update worker: queued work runs by priority, one block's work in submission order, errors per block."""

from __future__ import annotations

import threading

import pytest

from offload.errors import OffloadError
from offload.scheduler.worker import StepWorker


def test_queued_updates_run_in_priority_order_and_same_block_in_order():
    gate, started = threading.Event(), threading.Event()
    ran = []
    worker = StepWorker(1)
    try:
        worker.submit(99, lambda: (started.set(), gate.wait()), priority=0)  # hold the thread
        started.wait()
        for block, priority in [(7, 7), (5, 5), (0, 0), (5, 5), (3, 3)]:
            worker.submit(block, lambda b=block: ran.append(b), priority=priority)
        seen = []
        worker._on_next = seen.append  # the order the ring is told to read ahead
        gate.set()
        worker.wait_all()
        assert ran == [0, 3, 5, 5, 7]
        assert seen[0] == [3, 5, 5, 7]
    finally:
        worker.close()


def test_an_error_surfaces_at_the_wait_for_its_block_only():
    worker = StepWorker(1)
    try:
        worker.submit(1, lambda: 1 / 0)
        worker.submit(2, lambda: None)
        worker.wait(2)
        with pytest.raises(ZeroDivisionError):
            worker.wait(1)
        with pytest.raises(OffloadError, match="failed earlier.*ZeroDivisionError"):
            worker.wait(2)  # every later wait: the state is inconsistent until a checkpoint is loaded
        worker.clear_failure()
        worker.submit(2, lambda: None)
        worker.wait(2)
    finally:
        worker.close()
