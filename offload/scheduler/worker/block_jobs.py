"""What the step worker runs for a block: its AdamW update, or its gradient norms for clipping.

The pipeline (pipeline.py) makes the jobs on the training thread (jobs.py); their bodies are here, apart
from the phases that schedule them. In data-parallel mode (data_parallel.py) a block's update first
averages its gradients across the ranks into this rank's part, and ends by gathering every rank's part
(grad_sync.py).
"""

from __future__ import annotations

import time
from typing import Optional

from offload.scheduler.modes.grad_sync import GradSync
from offload.scheduler.worker.jobs import NormJob, UpdateJob
from offload.scheduler.records.module_weights import ModuleWeights
from offload.scheduler.grads.nonfinite import NonFiniteSkips
from offload.scheduler.phases.step_stats import StepCounters
from offload.trace import Tracer


class BlockJobs:
    """The bodies of `UpdateJob` and `NormJob`, with what they report to: the counters, the non-finite
    skips, the module's weight writes."""

    def __init__(self, tracer: Tracer, counters: StepCounters, weights: ModuleWeights, num_threads: int,
                 sync: Optional[GradSync]) -> None:
        self.tracer = tracer
        self.counters = counters
        self.weights = weights
        self.num_threads = num_threads
        self.sync = sync
        self.nonfinite = NonFiniteSkips()

    def run_block_update(self, job: UpdateJob) -> None:
        """On the worker: AdamW over each group of the block; a group with non-finite gradients (no
        clipping: the global norm does not decide) keeps its state, counted and warned once per step."""
        start = time.perf_counter()
        with self.tracer.span("update", job.block.block.name):
            if self.sync is not None:
                self._run_data_parallel_update(job, self.sync)
            else:
                self._run_update(job)
        self.counters.update_seconds += time.perf_counter() - start

    def _run_update(self, job: UpdateJob) -> None:
        for part in job.parts:
            state = part.runtime.state
            assert state is not None
            if job.check_finite and not state.grads.all_finite(self.num_threads):
                self.nonfinite.record(job.step, job.block.block.name)
                state.store.discard()  # its announced reads would otherwise hold ring slots
                state.grads.release()
                continue
            part.runtime.home.release_source()  # the last upload of `out` has read it
            state.update(part.ready, part.hypers, job.grad_scale, part.out, self.num_threads)
            state.grads.release()  # the gradient window (nvme, declared accumulation) gets its bytes back
            self.weights.note_writes_during_update(part.runtime, job.block)

    def _run_data_parallel_update(self, job: UpdateJob, sync: GradSync) -> None:
        """Average the block's gradients into this rank's part, step that part, gather every rank's part.
        Every rank takes the same decisions (which parameters step, whether to skip), so their weights stay
        bit-identical. See data_parallel.py."""
        readies = sync.reduce(job.block, job.step, [part.ready for part in job.parts])
        skip = job.check_finite and sync.nonfinite(job.block)
        if skip:
            self.nonfinite.record(job.step, job.block.block.name)
        for part, ready in zip(job.parts, readies):
            state = part.runtime.state
            assert state is not None and part.out is not None
            if ready and not skip:
                part.runtime.home.release_source()
                state.update(ready, part.hypers, job.grad_scale, part.out, self.num_threads)
                sync.gather(state, part.out)
                self.weights.note_writes_during_update(part.runtime, job.block)
            else:
                state.store.discard()
            state.grads.release()
        job.block.forget_averages()

    def run_block_norms(self, job: NormJob) -> None:
        """On the worker: the block's gradient norms; data-parallel, this rank's share of the squared norm
        of the averaged gradients."""
        if self.sync is not None:
            self.sync.reduce(job.block, self.counters.steps)
            job.block.shard_sumsq = self.sync.shard_sumsq(job.block)
            return
        job.block.norms = [n for state in job.block.states for n in state.grads.norms()]
