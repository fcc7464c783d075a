"""`StepWorker.soon`: work the training thread hands to the worker's thread, run before its next job, once."""

from __future__ import annotations

import threading

from offload.scheduler.worker.step_worker import StepWorker


def test_a_chore_runs_on_the_worker_before_its_next_job_and_once_however_often_asked():
    worker = StepWorker(1)
    try:
        gate, ran = threading.Event(), []
        worker.submit(0, gate.wait)  # the worker is busy: chores wait for it
        chore = lambda: ran.append(("chore", threading.current_thread().name))  # noqa: E731
        for _ in range(3):
            worker.soon(chore)
        worker.submit(1, lambda: ran.append(("job", threading.current_thread().name)))
        assert ran == []
        gate.set()
        worker.wait_all()
        assert ran == [("chore", "offload-step"), ("job", "offload-step")]
        # asked on the worker's own thread: at once
        worker.submit(2, lambda: worker.soon(lambda: ran.append(("inline", threading.current_thread().name))))
        worker.wait_all()
        assert ran[-1] == ("inline", "offload-step")
    finally:
        worker.close()
    after = []
    worker.soon(lambda: after.append(threading.current_thread().name))  # closed: nobody else will run it
    assert after == [threading.current_thread().name]
