"""The data-parallel side of one block's update, run on the step worker (distributed/data_parallel.py has the why).

`reduce` averages the block's gradients across the ranks into each rank's own part (`take_back` undoes it when
another micro-batch's gradient arrives after it); `nonfinite` decides
for all ranks together whether the block has an inf/NaN gradient; `shard_sumsq` is this rank's share of
the squared global norm; `gather` sends this rank's new weights to every rank. Every rank calls them for
the same blocks in the same order (the worker's queue, FIFO in data-parallel mode).
"""

from __future__ import annotations

import math
from typing import List, Optional

import torch
from torch import Tensor

from offload.distributed.data_parallel import DataParallel
from offload.optim.functional import sum_of_squares
from offload.scheduler.records.block_record import BlockRecord
from offload.scheduler.records.group import GroupState


class GradSync:
    """One engine's collectives per block, over `dp`'s process group."""

    def __init__(self, dp: DataParallel, num_threads: Optional[int]) -> None:
        self.dp = dp
        self.num_threads = num_threads

    def reduce(self, block: BlockRecord, step: int, ready: Optional[List[List[int]]] = None) -> List[List[int]]:
        """Average this step's gradients of the block into each rank's part (once per step). `ready`: per
        state, the parameters this rank has a gradient for (taken when the update was scheduled); a
        parameter only some ranks have one for counts as a zero gradient on the others, and is stepped on
        every rank. Returns, per state, the parameters to step (`state.reduced_ready`)."""
        states = block.states
        if block.reduced:
            return [state.reduced_ready or [] for state in states]
        self.dp.agree("gradient average", block.block.index, step)
        local = [state.grads.ready_indices() for state in states] if ready is None else ready
        flags = [i in set(mine) for state, mine in zip(states, local) for i in range(len(state.steps))]
        union = self.dp.union_of(flags)
        at = 0
        for state, mine in zip(states, local):
            count = len(state.steps)
            state.reduced_ready = [i for i in range(count) if union[at + i]]
            at += count
            if state.reduced_ready:
                self._reduce_group(state, set(mine))
        return [state.reduced_ready or [] for state in states]

    def _reduce_group(self, state: GroupState, mine: set) -> None:
        state.grads.finish_downloads()
        grad = state.grads.buffer(wait=False)
        for index, slot in enumerate(state.group.trainable_slots):
            if index not in mine:
                grad[slot.offset:slot.offset + slot.numel].zero_()  # stale, or never written
        shard = state.shard
        part = torch.empty(shard.size, dtype=grad.dtype, device=grad.device)
        self.dp.reduce_scatter_mean(grad[:shard.padded], shard, part)
        grad[shard.lo:shard.hi].copy_(part[:shard.numel])

    def take_back(self, block: BlockRecord) -> None:
        """A gradient arrives for a block whose gradients of this step were averaged already (with clipping a
        spilled gradient is averaged before it parks, at each micro-batch; or a clip before this backward): each
        rank turns its averaged part back into its share of the sum so far, `world` times the part in `[lo, hi)`
        and zeros elsewhere (the ranks' local sums are in the averages), and the block is no longer averaged; the
        next average of the sums (`reduce`: the mean of what every rank then holds) is the mean of every
        micro-batch's gradient, as if none had been averaged before. Every rank does it when the block's next
        gradient arrives (the same backward structure on every rank); a rank that got none would reduce again
        alone, which the next job's `agree` refuses on every rank."""
        taken = [state for state in block.states if state.reduced_ready]
        for state in taken:  # read back (a parked part) while the block still counts as averaged
            grads, shard = state.grads, state.shard
            grads.finish_downloads()
            grad = grads.buffer()
            mine = grad[shard.lo:shard.hi].mul(self.dp.world)
            grad.zero_()
            grad[shard.lo:shard.hi].copy_(mine)
            for index in state.reduced_ready or ():
                grads.has_grad[index] = True  # its share of the sum, even where this rank had no gradient
        block.forget_averages()
        block.shard_sumsq = None

    def nonfinite(self, block: BlockRecord) -> bool:
        """Whether any rank's part of the block's averaged gradient holds inf or NaN (the same answer on
        every rank)."""
        local = any(not _finite(self._part(state), self.num_threads) for state in block.states
                    if state.reduced_ready)
        return self.dp.any_rank(local)

    def shard_sumsq(self, block: BlockRecord) -> float:
        """Sum of squares of this rank's part of the block's averaged gradient (fp64 accumulated)."""
        total = 0.0
        for state in block.states:
            if state.reduced_ready:
                part = self._part(state)
                if part.numel():
                    total += float(torch.linalg.vector_norm(part, 2, dtype=torch.float32).double() ** 2)
        return total

    def gather(self, state: GroupState, out: Tensor) -> None:
        """Every rank's new weights of its part into `out` (the group's trainable range, compute dtype)."""
        shard = state.shard
        mine = torch.empty(shard.size, dtype=out.dtype, device=out.device)
        mine[:shard.numel].copy_(out[shard.lo:shard.hi])
        if shard.padded == shard.n and out.is_contiguous():
            self.dp.all_gather(out, mine)
            return
        full = torch.empty(shard.padded, dtype=out.dtype, device=out.device)
        self.dp.all_gather(full, mine)
        out.copy_(full[:shard.n])

    @staticmethod
    def _part(state: GroupState) -> Tensor:
        grad = state.grads.buffer(wait=False)
        return grad[state.shard.lo:state.shard.hi]


def _finite(part: Tensor, num_threads: Optional[int]) -> bool:
    if not part.numel():
        return True
    if part.device.type == "cpu" and part.dtype in (torch.float32, torch.bfloat16, torch.float16):
        return math.isfinite(sum_of_squares(part, num_threads=num_threads))
    return bool(torch.isfinite(part).all())
