"""The update worker: queued work runs by priority, one block's work in submission order, errors per block."""

from __future__ import annotations

import subprocess
import sys
import threading
from pathlib import Path

import pytest

from offload import _native
from offload.errors import OffloadError
from offload.scheduler.worker.step_worker import BEFORE_UPDATES, StepWorker


def test_queued_updates_run_in_priority_order_and_same_block_in_order():
    gate, started = threading.Event(), threading.Event()
    ran, seen = [], []

    class Ring:  # what the ring is told to read ahead, in order; nothing read ahead yet
        def queued(self, block_indices):
            seen.append(block_indices)

        def reading_order(self, block_indices):
            return []

    ring = Ring()
    worker = StepWorker(1, observer=ring)
    try:
        worker.submit(99, lambda: (started.set(), gate.wait()), priority=0)  # hold the thread
        started.wait()
        for block, priority in [(7, 7), (5, 5), (0, 0), (5, 5), (3, 3)]:
            worker.submit(block, lambda b=block: ran.append(b), priority=priority)
        gate.set()
        worker.wait_all()
        assert ran == [0, 3, 5, 5, 7]
        assert seen[0] == [3, 5, 5, 7]
    finally:
        worker.close()


def _run_queued(jobs, read_ahead):
    """The order the worker runs `jobs` ((block, priority), submitted while it is busy) in, when the ring has
    begun reading ahead the blocks `read_ahead`, in that order (until each block's job runs)."""
    gate, started = threading.Event(), threading.Event()
    ran = []

    class Ring:
        def queued(self, block_indices):
            pass

        def reading_order(self, block_indices):
            return [b for b in read_ahead if b in block_indices and b not in ran]

    ring = Ring()  # the worker holds its observer weakly
    worker = StepWorker(1, observer=ring)
    try:
        worker.submit(99, lambda: (started.set(), gate.wait()), priority=0)
        started.wait()
        for block, priority in jobs:
            worker.submit(block, lambda b=block: ran.append(b), priority=priority)
        gate.set()
        worker.wait_all()
    finally:
        worker.close()
    return ran


def test_a_block_whose_state_is_read_ahead_runs_before_a_later_one_of_better_priority():
    """The ring reads ahead for the backward in reverse forward order: block 13's chunks are in when block 12
    (better priority) arrives; 13 runs first instead of holding its ring slots to the end of the step."""
    assert _run_queued([(13, 13), (12, 12), (11, 11)], read_ahead=[13, 12]) == [13, 12, 11]
    assert _run_queued([(13, 13), (12, 12), (11, 11)], read_ahead=[12]) == [12, 11, 13]
    assert _run_queued([(3, 3), (5, 5), (5, 5)], read_ahead=[5]) == [5, 3, 5]  # a block's jobs in order


def test_jobs_of_one_priority_keep_submission_order_whatever_was_read_ahead():
    """Data-parallel ranks give every job priority 0: their collectives must run in the same order on every
    rank, which the reads ahead of one rank do not decide."""
    assert _run_queued([(1, 0), (2, 0), (3, 0)], read_ahead=[3, 2]) == [1, 2, 3]


def test_parkings_run_before_every_update_in_submission_order_and_are_never_jumped():
    """One process parks a block's gradients at priority BEFORE_UPDATES: an update run ahead of a parking may
    need a buffer of the gradient window that the parking would give back (the worker cannot wait for that)."""
    park = BEFORE_UPDATES
    assert _run_queued([(13, 13), (12, park), (11, park), (2, 2)], read_ahead=[13]) == [12, 11, 13, 2]
    assert _run_queued([(5, 5), (4, park), (4, 4)], read_ahead=[4]) == [4, 4, 5]  # a block's jobs in order


def test_an_error_of_the_rings_reading_order_fails_the_job_that_runs_next_not_the_thread():
    gate, started = threading.Event(), threading.Event()

    class Ring:
        def queued(self, block_indices):
            pass

        def reading_order(self, block_indices):
            raise RuntimeError("ring broken")

    ring = Ring()
    worker = StepWorker(1, observer=ring)
    try:
        worker.submit(99, lambda: (started.set(), gate.wait()), priority=0)
        started.wait()
        worker.submit(1, lambda: None, priority=1)
        worker.submit(2, lambda: None, priority=2)
        gate.set()
        with pytest.raises(RuntimeError, match="ring broken"):
            worker.wait(1)
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


_EXIT_WHILE_BUSY = """
import time, torch
from offload import _native
from offload.scheduler.worker.step_worker import BEFORE_UPDATES, StepWorker
buf = torch.zeros(16 << 20, dtype=torch.uint8)
worker = StepWorker(1)
def busy():  # about 1 s, nearly all of it inside native calls that released the GIL
    end = time.perf_counter() + 1.0
    while time.perf_counter() < end:
        _native._C.crc32c(buf.data_ptr(), buf.numel(), 0)
worker.submit(0, busy)
worker.submit(1, busy)  # queued: dropped at exit
time.sleep(0.2)
raise SystemExit(3)  # the user's script ends (an uncaught error) while an update runs
"""


@pytest.mark.skipif(_native._C is None, reason="needs a native call that releases the GIL")
def test_interpreter_exit_during_an_update_exits_cleanly():
    """Without the at-exit stop, the daemon worker is killed inside the native call as Python finalizes:
    "terminate called without an active exception" and SIGABRT instead of the script's own exit."""
    done = subprocess.run([sys.executable, "-c", _EXIT_WHILE_BUSY], capture_output=True, text=True, timeout=120,
                          cwd=str(Path(__file__).resolve().parent.parent))
    assert "terminate called" not in done.stderr
    assert done.returncode == 3, done.stderr


def test_updates_dropped_by_the_exit_stop_are_named_not_reported_as_failures():
    """What interpreter exit runs (`_at_exit`) cancels queued updates: a later wait for one names that, and
    close() (an atexit handler of the user's that runs after it) does not raise CancelledError."""
    gate, started = threading.Event(), threading.Event()
    worker = StepWorker(1)
    worker.submit(0, lambda: (started.set(), gate.wait(5)))
    started.wait()
    worker.submit(1, lambda: None)  # queued behind the running one: dropped
    worker.submit(2, lambda: None)
    threading.Timer(0.1, gate.set).start()
    worker._at_exit()  # the finalizer: drops 1 and 2, waits for 0
    worker.wait(0)  # the running update finished normally
    with pytest.raises(OffloadError, match="dropped when the interpreter began to exit"):
        worker.wait(1)
    worker.close()  # block 2's cancelled update is not a failure to raise
