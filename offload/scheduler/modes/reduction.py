"""Gradient reduction: how a block's gradients become the ones it steps on, chosen once at placement (the
`GradReduction` protocol of records/block_record.py, what a block's record asks).

`LocalReduction`, one process: as they are. `DataParallelReduction`, several ranks (distributed/
data_parallel.py has the why): before each block's update its gradients are averaged across the ranks into
this rank's part (grad_sync.py), the record steps that part and this mode sends every rank's new weights to the
others; the worker then runs jobs in submission order, the same on every rank, since each runs collectives;
clipping sums the parts' squared norms across the ranks. Both offer the same operations, so the phases and
the records never ask which one runs.
"""

from __future__ import annotations

import math
from typing import List, Optional, Protocol, Tuple

from torch import Tensor

from offload.distributed.data_parallel import DataParallel
from offload.distributed.guard import refuse_ranks_unknown_at_wrap
from offload.errors import OffloadError
from offload.scheduler.modes.clipping import clip_scale_of, global_norm
from offload.scheduler.modes.grad_sync import GradSync
from offload.scheduler.records.block_record import BlockRecord, GradReduction, UpdateJob
from offload.scheduler.records.group import GroupState
from offload.scheduler.records.slot_table import SlotTable
from offload.scheduler.worker.step_worker import BEFORE_UPDATES, StepWorker


class Reduction(GradReduction, Protocol):
    """What the phases and the clipping mode ask of the reduction, besides what the records ask."""

    def refuse_unknown_ranks(self) -> None:
        """At forward and step(): a process group that is not the one the engine was made for is refused."""

    def global_norm(self, blocks: List[BlockRecord], slots: SlotTable, max_norm: float) -> Tuple[float, float]:
        """(total norm, gradient scale) over every rank's gradients (the worker is idle)."""

    def everywhere(self, flags: List[bool]) -> List[bool]:
        """Whether each flag holds on every rank (the same answer on every rank; as many flags on every rank)."""


class LocalReduction:
    """One process: each block steps on its own gradients."""

    zero_waits = False

    def everywhere(self, flags: List[bool]) -> List[bool]:
        return flags

    def refuse_unknown_ranks(self) -> None:
        refuse_ranks_unknown_at_wrap(1)

    def priority(self, forward_position: int) -> int:
        return forward_position  # the block the next forward needs first runs first (step_worker.py)

    def park_priority(self) -> int:
        return BEFORE_UPDATES  # they give the gradient window back, which an update may need (step_worker.py)

    def runs_every_update(self, has_trainable: bool) -> bool:
        return False

    def take_back_average(self, block: BlockRecord) -> None:
        pass  # never averaged: `block.reduced` stays False in one process

    def check_torch_reads(self, block: BlockRecord) -> None:
        pass

    def ready_to_step(self, block: BlockRecord, job: UpdateJob) -> List[Optional[List[int]]]:
        """A group with non-finite gradients (no clipping: the global norm does not decide) keeps its state,
        counted and warned once per step."""
        readies: List[Optional[List[int]]] = []
        for part in job.parts:
            state = part.group.state
            assert state is not None
            finite = not job.check_finite or state.grads.all_finite(block.services.num_threads)
            readies.append(part.ready if finite else None)
        if any(ready is None for ready in readies):
            block.services.nonfinite.record(job.step, block.block.name)  # once per block, as the count says
        return readies

    def send_new_weights(self, state: GroupState, out: Optional[Tensor]) -> None:
        pass

    def norms(self, block: BlockRecord, step: int) -> None:
        block.norms = [n for state in block.states for n in state.grads.norms(block.services.num_threads)]

    def global_norm(self, blocks: List[BlockRecord], slots: SlotTable, max_norm: float) -> Tuple[float, float]:
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
        refuse_ranks_unknown_at_wrap(self.dp.world)

    def everywhere(self, flags: List[bool]) -> List[bool]:
        return [not dropped for dropped in self.dp.union_of([not flag for flag in flags])]

    def priority(self, forward_position: int) -> int:
        return 0  # submission order: every rank runs the collectives of the same blocks in the same order

    def park_priority(self) -> int:
        return 0  # submission order: a backward's parkings come before the updates that read their gradients back

    def runs_every_update(self, has_trainable: bool) -> bool:
        return has_trainable  # another rank may have gradients for the block; every rank runs its job

    def take_back_average(self, block: BlockRecord) -> None:
        """A gradient arriving after the block's average (a spilled gradient parks averaged, with clipping; a
        clip before this backward): the average is taken back into this rank's share of the sum (grad_sync.py),
        averaged again when the block completes or at step(). (After an early update `receive_grad` refuses.)"""
        self.sync.take_back(block)

    def check_torch_reads(self, block: BlockRecord) -> None:
        raise OffloadError(
            "torch.nn.utils.clip_grad_norm_ over a data-parallel engine's gradients would measure this rank's own "
            "gradients, not their average across the ranks: clip with engine.clip_grad_norm_(max_norm) (the norm "
            "across the ranks, torch's maths) or pass max_grad_norm= to offload.wrap")

    def ready_to_step(self, block: BlockRecord, job: UpdateJob) -> List[Optional[List[int]]]:
        """The block's gradients averaged into this rank's part; every rank skips the block together when any
        rank's part is not finite (no clipping)."""
        readies = self.sync.reduce(block, job.step, [part.ready for part in job.parts])
        if job.check_finite and self.sync.nonfinite(block):
            block.services.nonfinite.record(job.step, block.block.name)
            return [None] * len(job.parts)
        return [ready or None for ready in readies]

    def send_new_weights(self, state: GroupState, out: Optional[Tensor]) -> None:
        """Every rank's new weights of the group into each rank's `out` (the weight home asks: a sharded one's
        next fetch gathers them instead)."""
        assert out is not None
        self.sync.gather(state, out)

    def norms(self, block: BlockRecord, step: int) -> None:
        """This rank's share of the squared norm of the block's averaged gradients."""
        self.sync.reduce(block, step)
        block.shard_sumsq = self.sync.shard_sumsq(block)

    def global_norm(self, blocks: List[BlockRecord], slots: SlotTable, max_norm: float) -> Tuple[float, float]:
        """Each block's averaged gradient, reduced on the worker first, then the parts' squares summed across
        the ranks (the same total on every rank)."""
        for record in blocks:
            if record.states and record.shard_sumsq is None:
                record.park_grads(norms=True)
        self._worker.wait_all()
        local = sum(record.shard_sumsq or 0.0 for record in blocks)
        return clip_scale_of(math.sqrt(self.dp.sum_all(local)), max_norm)
