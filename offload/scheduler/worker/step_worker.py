"""StepWorker: one background thread that runs block updates, the block needed soonest first.

Updates are submitted as gradients complete (during backward that is roughly reverse forward order), but
the next forward needs the first blocks first. When updates queue up (the disk or the CPU is the
bottleneck), running them in order of `priority` (the block's position in the forward order) lets the next
forward start as soon as its first block is ready instead of after every queued update. Work for the same
block always runs in submission order (equal priority, then sequence). Before each job the worker reports
the order of what is still queued (its `QueueObserver`), so the nvme ring reads ahead in the order it will be used.

One exception: a block whose state the nvme ring has begun to read ahead runs before the blocks whose reads
began later or not at all (`QueueObserver.reading_order`). The ring reads ahead for the coming backward in
reverse forward order, from the forward on; a block that arrived later with a better priority would otherwise
run first, again and again, while the earlier block's chunks hold their ring slots to the end of the step, and
the disk reads ahead through the slots left (1.2B parameters, `bench_scale`: 78-85% of the worker's loads found
their chunk read ahead, 97-99% with this rule). It jumps only jobs of another priority: jobs of one priority (a
data-parallel rank's, whose collectives must line up with the other ranks') keep their submission order.

Jobs of negative priority (`BEFORE_UPDATES`: one process's gradient parkings) run before every other, in submission
order, and are never jumped: they give the gradient window's bytes back, and an update run ahead of them may need
a buffer of that window to read its gradient back, which the worker cannot wait for (it would wait for itself).
"""

from __future__ import annotations

import os
import sys
import threading
import time
import weakref
from concurrent.futures import Future
from typing import Callable, Dict, List, Optional, Protocol, Tuple

import torch

from offload.errors import OffloadError
from offload.trace import Tracer

Job = Tuple[float, int, int, Callable[[], object], Future]  # (priority, sequence, block index, work, future)


class QueueObserver(Protocol):
    """Told, before each job, the block indices still queued, in the order they will run (the nvme ring
    reads their state ahead: modes/disk_traffic.py)."""

    def queued(self, block_indices: List[int]) -> None: ...

    def reading_order(self, block_indices: List[int]) -> List[int]:
        """Of these blocks, those whose state is being read or was read ahead, in the order those reads began."""
        ...


BEFORE_UPDATES = -1  # a priority that runs a job before every update and is never jumped (see the module's doc)
EXIT_JOIN_SECONDS = 60.0  # how long interpreter exit waits for the update that is running


class StepWorker:
    """One thread; one future per block. `num_threads` caps torch's intra-op threads *of this thread only*
    (OpenMP's thread count is per thread): when the CPU also computes, two full OpenMP teams spinning on the
    same cores slow both down several-fold. Every wait goes through `wait(block_index)`, so an exception
    raised in an update surfaces at the next use of that block, and every later wait raises too (`failure`):
    some blocks were updated and some not, so training on would silently use inconsistent state.
    [Note: a failed update poisons the engine]"""

    def __init__(self, num_threads: int, observer: Optional[QueueObserver] = None,
                 tracer: Optional[Tracer] = None) -> None:
        self.num_threads = num_threads
        self._tracer = tracer if tracer is not None else Tracer()
        self._queue: List[Job] = []
        self._pending: Dict[int, Future] = {}
        self._sequence = 0
        self._stopping = threading.Event()
        self.failure: Optional[BaseException] = None  # the first update that raised, until `clear_failure`
        self._lock = threading.Condition()
        # [Note: an engine dropped without close()] a running thread is a GC root: it holds the queue, never
        # this worker, and the observer only weakly (it reaches the blocks, hence this worker), so a dropped
        # engine's pipeline and worker can be collected, and this worker's finalizer then stops the thread.
        self._thread = threading.Thread(target=_serve, name="offload-step", daemon=True,
                                        args=(self._lock, self._queue, self._stopping, num_threads,
                                              None if observer is None else weakref.ref(observer)))
        self._thread.start()
        # [Note: stop the worker before the interpreter exits] a daemon thread still inside a native call
        # (an Adam step, a disk wait) when Python finalizes is killed as it takes the GIL back, unwinding
        # through C++ that cannot unwind: "terminate called without an active exception" and a core dump
        # instead of the user's traceback. At exit, queued updates are dropped and the current one finishes.
        self._at_exit = weakref.finalize(self, _stop_thread, self._lock, self._queue, self._stopping, self._thread,
                                         os.getpid())

    def submit(self, block_index: int, work: Callable[[], object], priority: float = 0.0) -> Future:
        """Queue `work` for the block; lower `priority` runs earlier, same block in submission order."""
        future: Future = Future()
        with self._lock:
            if self._stopping.is_set():
                raise RuntimeError("the step worker is closed")
            self._sequence += 1
            self._queue.append((priority, self._sequence, block_index, work, future))
            self._pending[block_index] = future
            self._lock.notify()
        return future

    def has_work(self) -> bool:
        """Whether any submitted work is still queued or running."""
        return any(not future.done() for future in list(self._pending.values()))

    def wait(self, block_index: int, detail: str = "") -> float:
        """Block until the block's last submitted work is done; re-raise its exception here. After any update
        has failed, every wait raises (OffloadError naming the first failure) until `clear_failure`. Returns the
        seconds it blocked (a "wait for update" span, about `detail`, when it did)."""
        with self._lock:
            future = self._pending.pop(block_index, None)
        blocked = 0.0
        if future is not None:
            try:
                if future.cancelled():
                    raise OffloadError("this block's update was dropped when the interpreter began to exit")
                if not future.done():
                    start = time.perf_counter()
                    with self._tracer.span("wait for update", detail):
                        future.result()
                    blocked = time.perf_counter() - start
                future.result()
            except BaseException as exc:
                if not _update_raised(future, exc):  # [Note: Ctrl-C in a wait] the update itself runs on
                    with self._lock:
                        self._pending.setdefault(block_index, future)
                    raise
                if self.failure is None:
                    self.failure = exc
                    raise
                # a later failure: reported as the consequence of the first, below
        self.raise_if_failed()
        return blocked

    def raise_if_failed(self) -> None:
        """Raise OffloadError naming the first failed update, if any update has failed."""
        if self.failure is not None:
            raise OffloadError(
                f"an optimizer update failed earlier ({type(self.failure).__name__}: {self.failure}); the weights "
                "and optimizer state are no longer consistent (some blocks were updated, some not): load a "
                "checkpoint with engine.load(path) to continue, or close() the engine") from self.failure

    def fail(self, exc: BaseException) -> None:
        """Mark the state inconsistent because of `exc` (a failure outside an update: a partly done load, a
        swap write that failed on the training thread); the first failure stays the one named."""
        if self.failure is None:
            self.failure = exc

    def collect_failure(self) -> None:
        """Finish all queued work; an error of it that nobody has seen yet becomes the failure."""
        errors = self._drain_pending()
        if errors:
            self.fail(errors[0])

    def clear_failure(self) -> None:
        """Finish all queued work, dropping its errors, and forget the failure (the state is about to be
        replaced by a checkpoint load)."""
        self._drain_pending()
        self.failure = None

    def wait_all(self) -> None:
        for index in list(self._pending):
            self.wait(index)
        self.raise_if_failed()

    def close(self) -> None:
        """Finish the queued work and stop the thread. Raises the first failed update if it was never
        reported; failures after a reported one are its consequences and are not raised again."""
        try:
            errors = self._drain_pending()
            if errors and self.failure is None:
                self.failure = errors[0]
                raise errors[0]
        finally:
            with self._lock:
                self._stopping.set()
                self._lock.notify()
            self._thread.join()
            self._at_exit.detach()

    def _drain_pending(self) -> List[BaseException]:
        """Wait for every queued job; return their errors in submission order of the blocks."""
        with self._lock:
            pending = list(self._pending.items())
            self._pending.clear()
        errors: List[BaseException] = []
        for position, (_block, future) in enumerate(pending):
            if future.cancelled():  # dropped at interpreter exit (`_stop_thread`): not a failed update
                continue
            try:
                future.result()
            except BaseException as exc:
                if not _update_raised(future, exc):  # [Note: Ctrl-C in a wait]: the updates are still owed
                    with self._lock:
                        for block, owed in pending[position:]:
                            self._pending.setdefault(block, owed)
                    raise
                errors.append(exc)
        return errors

    def on_own_thread(self) -> bool:
        """Whether the caller is this worker's thread (which must not wait for itself)."""
        return threading.current_thread() is self._thread


def _serve(lock: threading.Condition, queue: List[Job], stopping: threading.Event, num_threads: int,
           observer: "Optional[weakref.ref[QueueObserver]]") -> None:
    """The worker thread: run queued jobs by priority until stopped and the queue is empty. Holds no reference
    to the StepWorker, and none to a finished job (its update holds the pipeline) while it waits."""
    torch.set_num_threads(num_threads)
    while True:
        with lock:
            while not queue and not stopping.is_set():
                lock.wait()
            if not queue:
                return
            waiting = [job[2] for job in queue] if len(queue) > 1 else []
        told = None if observer is None else observer()
        reading: List[int] = []
        failed: Optional[BaseException] = None
        if told is not None and waiting:
            try:
                reading = told.reading_order(waiting)  # the ring's lock, not held with ours
            except BaseException as exc:  # reported with the job that runs next, as `queued`'s errors are
                failed = exc
        with lock:
            if not queue:  # dropped at interpreter exit meanwhile
                told = failed = None
                continue
            queue.sort(key=lambda job: (job[0], job[1]))
            _priority, _seq, _block, work, future = queue.pop(_next_job(queue, reading))
            upcoming = [job[2] for job in queue]
        if future.set_running_or_notify_cancel():
            try:
                if failed is not None:
                    raise failed
                if told is not None and upcoming:
                    told.queued(upcoming)  # may raise an earlier write's error: reported with this job
                future.set_result(work())
            except BaseException as exc:
                future.set_exception(exc)
        work = future = told = failed = None  # type: ignore[assignment]  # not kept alive while waiting


def _next_job(queue: List[Job], reading: List[int]) -> int:
    """Where in `queue` (sorted by priority, then submission) the next job is: the first job of the block whose
    reads ahead began first (`reading`), when no job of its priority and none of negative priority comes before
    it; else the first."""
    for block in reading[:1]:
        position = next((i for i, job in enumerate(queue) if job[2] == block), None)
        if position is not None and all(0 <= job[0] != queue[position][0] for job in queue[:position]):
            return position
    return 0


def _update_raised(future: Future, exc: BaseException) -> bool:
    """Whether `exc` is the update's own error (or its cancellation), not an interrupt of the wait for it: a
    KeyboardInterrupt reaches the waiting thread while the update goes on, and must not poison the engine."""
    if not future.done():
        return False
    return future.cancelled() or future.exception() is exc


def _stop_thread(lock: threading.Condition, queue: List[Job], stopping: threading.Event,
                 thread: threading.Thread, owner_pid: int) -> None:
    """At interpreter exit, or when a worker never closed is collected (weakref.finalize runs it then, unless
    `close` did already): drop the queued updates, let the running one finish, and join the thread while
    Python is still whole. Not in a forked child: the thread does not exist there, and the lock may have been
    held at the fork. Not joined from the thread itself (a collection that ran there): it ends on its own."""
    if os.getpid() != owner_pid:
        return
    with lock:
        for job in queue:
            job[4].cancel()
        queue.clear()
        stopping.set()
        lock.notify_all()
    if thread is threading.current_thread():
        return
    thread.join(timeout=EXIT_JOIN_SECONDS)
    if thread.is_alive():
        print(f"offload: an optimizer update was still running {EXIT_JOIN_SECONDS:.0f} s after the interpreter "
              "began to exit (a stalled disk?); exiting anyway", file=sys.stderr)
