"""Gradient reduction: how a block's gradients become the ones it steps on, chosen once at placement.

`LocalReduction`, one process: as they are. `DataParallelReduction`, several ranks (distributed/
data_parallel.py has the why): each block's update first averages its gradients across the ranks into this
rank's part (grad_sync.py), steps that part and gathers every rank's new weights; the worker then runs
jobs in submission order, the same on every rank, since each runs collectives; clipping sums the parts'
squared norms across the ranks. Both offer the same operations, so the phases and the records never ask
which one runs.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, List, Optional, Protocol, Tuple

from offload.distributed.data_parallel import DataParallel
from offload.distributed.guard import refuse_ranks_unknown_at_wrap
from offload.errors import OffloadError
from offload.scheduler.modes.grad_sync import GradSync
from offload.scheduler.modes.norms import clip_scale_of, global_norm
from offload.scheduler.worker.step_worker import StepWorker

if TYPE_CHECKING:
    from offload.scheduler.records.block_runtime import BlockRuntime
    from offload.scheduler.records.slot_table import SlotTable
    from offload.scheduler.worker.block_jobs import BlockJobs
    from offload.scheduler.worker.jobs import UpdateJob


class GradReduction(Protocol):
    zero_waits: bool  # zero_grad() waits for each block's pending job (it reads the gradients)

    def refuse_unknown_ranks(self) -> None:
        """At forward and step(): a process group that is not the one the engine was made for is refused."""

    def priority(self, forward_position: int) -> int:
        """The worker's priority of a block's job, from its position in the forward."""

    def runs_every_update(self, has_trainable: bool) -> bool:
        """Whether a block's update runs even when no parameter of it has a gradient here."""

    def check_arrival(self, block: "BlockRuntime") -> None:
        """A gradient of the block arrives: one already averaged across the ranks is taken back first."""

    def check_torch_reads(self, block: "BlockRuntime") -> None:
        """Torch code reads the block's held gradients (a clip): refused where they are not what it expects."""

    def update(self, job: "UpdateJob", jobs: "BlockJobs") -> None:
        """On the worker: the block's AdamW update."""

    def norms(self, block: "BlockRuntime", step: int) -> None:
        """On the worker: what clipping needs of the block's gradients."""

    def global_norm(self, blocks: List["BlockRuntime"], slots: "SlotTable", max_norm: float) -> Tuple[float, float]:
        """(total norm, gradient scale) over every rank's gradients (the worker is idle)."""


class LocalReduction:
    """One process: each block steps on its own gradients."""

    zero_waits = False

    def refuse_unknown_ranks(self) -> None:
        refuse_ranks_unknown_at_wrap(None)

    def priority(self, forward_position: int) -> int:
        return forward_position  # the block the next forward needs first runs first (step_worker.py)

    def runs_every_update(self, has_trainable: bool) -> bool:
        return False

    def check_arrival(self, block: "BlockRuntime") -> None:
        pass

    def check_torch_reads(self, block: "BlockRuntime") -> None:
        pass

    def update(self, job: "UpdateJob", jobs: "BlockJobs") -> None:
        """A group with non-finite gradients (no clipping: the global norm does not decide) keeps its state,
        counted and warned once per step."""
        for part in job.parts:
            state = part.runtime.state
            assert state is not None
            if job.check_finite and not state.grads.all_finite(jobs.num_threads):
                jobs.nonfinite.record(job.step, job.block.block.name)
                jobs.skip_group(part)
            else:
                jobs.step_group(job, part, part.ready)
            state.grads.release()  # the gradient window (nvme, declared accumulation) gets its bytes back

    def norms(self, block: "BlockRuntime", step: int) -> None:
        block.norms = [n for state in block.states for n in state.grads.norms()]

    def global_norm(self, blocks: List["BlockRuntime"], slots: "SlotTable", max_norm: float) -> Tuple[float, float]:
        return global_norm(blocks, slots, max_norm)


class DataParallelReduction:
    """Several ranks, one process group (`dp`): see the module docstring. Every rank takes the same decisions
    (which parameters step, whether to skip), so their weights stay bit-identical."""

    zero_waits = True  # the averaging reads the gradients on the worker

    def __init__(self, dp: DataParallel, worker: StepWorker, num_threads: Optional[int]) -> None:
        self.dp = dp
        self.sync = GradSync(dp, num_threads)
        self._worker = worker

    def refuse_unknown_ranks(self) -> None:
        refuse_ranks_unknown_at_wrap(self.dp)

    def priority(self, forward_position: int) -> int:
        return 0  # submission order: every rank runs the collectives of the same blocks in the same order

    def runs_every_update(self, has_trainable: bool) -> bool:
        return has_trainable  # another rank may have gradients for the block; every rank runs its job

    def check_arrival(self, block: "BlockRuntime") -> None:
        """A gradient arriving after the block's average (a spilled gradient parks averaged, with clipping; a
        clip before this backward): the average is taken back into this rank's share of the sum (grad_sync.py),
        averaged again when the block completes or at step(). (After an early update `receive_grad` refuses.)"""
        if block.reduced:
            self.sync.take_back(block)

    def check_torch_reads(self, block: "BlockRuntime") -> None:
        raise OffloadError(
            "torch.nn.utils.clip_grad_norm_ over a data-parallel engine's gradients would measure this rank's own "
            "gradients, not their average across the ranks: clip with engine.clip_grad_norm_(max_norm) (the norm "
            "across the ranks, torch's maths) or pass max_grad_norm= to offload.wrap")

    def update(self, job: "UpdateJob", jobs: "BlockJobs") -> None:
        """Average the block's gradients into this rank's part, step that part, gather every rank's part."""
        readies = self.sync.reduce(job.block, job.step, [part.ready for part in job.parts])
        skip = job.check_finite and self.sync.nonfinite(job.block)
        if skip:
            jobs.nonfinite.record(job.step, job.block.block.name)
        for part, ready in zip(job.parts, readies):
            state = part.runtime.state
            assert state is not None
            if ready and not skip:
                jobs.step_group(job, part, ready)
                if not part.runtime.home.partitioned:  # sharded weights: the next fetch gathers the new ones
                    assert part.out is not None
                    self.sync.gather(state, part.out)
            else:
                jobs.skip_group(part)
            state.grads.release()
        job.block.forget_averages()

    def norms(self, block: "BlockRuntime", step: int) -> None:
        """This rank's share of the squared norm of the block's averaged gradients."""
        self.sync.reduce(block, step)
        block.shard_sumsq = self.sync.shard_sumsq(block)

    def global_norm(self, blocks: List["BlockRuntime"], slots: "SlotTable", max_norm: float) -> Tuple[float, float]:
        """Each block's averaged gradient, reduced on the worker first, then the parts' squares summed across
        the ranks (the same total on every rank)."""
        for runtime in blocks:
            if runtime.states and runtime.shard_sumsq is None:
                runtime.park_grads(norms=True)
        self._worker.wait_all()
        local = sum(runtime.shard_sumsq or 0.0 for runtime in blocks)
        return clip_scale_of(math.sqrt(self.dp.sum_all(local)), max_norm)
