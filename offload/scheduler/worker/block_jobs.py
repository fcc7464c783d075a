"""What the step worker runs for a block: its AdamW update, or its gradient norms for clipping.

The records make the jobs on the training thread (jobs.py); their bodies are here. How a block's gradients
become the ones it steps on is the gradient reduction's (modes/reduction.py): as they are, or averaged
across the data-parallel ranks into this rank's part, with every rank's new weights gathered after.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, List

from offload.scheduler.grads.nonfinite import NonFiniteSkips
from offload.scheduler.worker.jobs import GroupUpdate, ParkJob, UpdateJob
from offload.trace import Tracer

if TYPE_CHECKING:
    from offload.scheduler.modes.reduction import GradReduction
    from offload.scheduler.phases.step_stats import StepCounters


class BlockJobs:
    """The bodies of `UpdateJob` and `ParkJob`, with what they report to: the counters and the non-finite
    skips. `num_threads` caps the CPU Adam's threads."""

    def __init__(self, tracer: Tracer, counters: "StepCounters", num_threads: int,
                 reduction: "GradReduction") -> None:
        self.tracer = tracer
        self.counters = counters
        self.num_threads = num_threads
        self.reduction = reduction
        self.nonfinite = NonFiniteSkips()

    def run_update(self, job: UpdateJob) -> None:
        """On the worker: AdamW over each group of the block."""
        start = time.perf_counter()
        with self.tracer.span("update", job.block.block.name):
            self.reduction.update(job, self)
        self.counters.update_seconds += time.perf_counter() - start

    def run_park(self, job: ParkJob) -> None:
        if job.norms:
            self.reduction.norms(job.block, self.counters.steps)
        for state in job.block.states:
            state.grads.park()

    def step_group(self, job: UpdateJob, part: GroupUpdate, ready: List[int]) -> None:
        """AdamW over one group's ready parameters; a write through a parameter meanwhile is noted."""
        state = part.runtime.state
        assert state is not None
        part.runtime.home.release_source()  # the last upload of `out` has read it
        state.update(ready, part.hypers, job.grad_scale, part.out, self.num_threads, part.out_base)
        part.runtime.note_writes_during_update(job.block)

    def skip_group(self, part: GroupUpdate) -> None:
        """The group is not updated this step: its announced reads would otherwise hold ring slots."""
        state = part.runtime.state
        assert state is not None
        state.store.discard()
