"""Clipping, chosen once from `max_grad_norm`: what happens when a block's gradients are complete during a
backward, and what the step does before it schedules the updates; and the global norm, as
torch.nn.utils.clip_grad_norm_ computes it (one formula for `max_grad_norm`, `engine.clip_grad_norm_` and the
data-parallel norm). See docs/design.md [Note: clipping parity].

`NoClipping`: the block updates at once, during the declared last backward ([Note: when a block may update
early]), each update checking its own gradients for inf/NaN; the nvme ring reads the updates' state ahead from
the forward on. `NormClipping`: no update may start before the global norm is known, so a completed block only
has its gradient norms computed on the worker; `step()` waits for them, computes the norm (across the
ranks in data-parallel mode), skips the whole step on a non-finite norm, and scales every update. With either,
a block whose gradients park on disk when they wait parks them once complete (an earlier micro-batch's).
"""

from __future__ import annotations

import math
import warnings
from typing import List, Optional, Protocol, Tuple

import torch
from torch import nn

from offload.scheduler.records.block_record import BlockRecord
from offload.scheduler.records.slot_table import SlotTable
from offload.scheduler.state.hypers import StepHypers
from offload.scheduler.worker.step_worker import StepWorker


class Clipping(Protocol):
    updates_during_backward: bool  # blocks update as their gradients complete in the declared last backward
    checks_each_block: bool  # each update skips a group with inf/NaN gradients (no global norm decides)
    last_norm: float  # the last step's global gradient norm before clipping (nan: none was computed)

    def watches(self, block: BlockRecord, last: bool) -> bool:
        """Whether the backward should tell when the block's gradients are complete (`block_complete`)."""

    def block_complete(self, block: BlockRecord, hypers: StepHypers, last: bool) -> None:
        """A backward completed the block's gradients (`last`: the declared last one before step())."""

    def scale_for_step(self, blocks: List[BlockRecord], slots: SlotTable, step: int) -> Optional[float]:
        """The gradient scale of this step's updates, or None: skip the step."""


class NormSource(Protocol):
    """Where the global norm comes from: the reduction mode (reduction.py), across the ranks in data-parallel."""

    def global_norm(self, blocks: List[BlockRecord], slots: SlotTable, max_norm: float) -> Tuple[float, float]: ...


class NoClipping:
    updates_during_backward = True
    checks_each_block = True
    last_norm = math.nan

    def watches(self, block: BlockRecord, last: bool) -> bool:
        return last or block.spills

    def block_complete(self, block: BlockRecord, hypers: StepHypers, last: bool) -> None:
        if last:
            block.update_early(hypers.for_early_update())
        elif block.spills:
            block.park_grads(norms=False)

    def scale_for_step(self, blocks: List[BlockRecord], slots: SlotTable, step: int) -> Optional[float]:
        return 1.0


class NormClipping:
    """Clip to `max_norm` by the global L2 norm, as torch.nn.utils.clip_grad_norm_ (inf: measure only)."""

    updates_during_backward = False
    checks_each_block = False

    def __init__(self, max_norm: float, worker: StepWorker, reduction: NormSource) -> None:
        self.max_norm = max_norm
        self._worker = worker
        self._reduction = reduction
        self.last_norm = math.nan

    def watches(self, block: BlockRecord, last: bool) -> bool:
        return last or block.spills

    def block_complete(self, block: BlockRecord, hypers: StepHypers, last: bool) -> None:
        """The norms while the gradient is in memory (the last backward's are the step's; an earlier one's
        serve when the block gets no more), then the gradient parks."""
        block.park_grads(norms=True)

    def scale_for_step(self, blocks: List[BlockRecord], slots: SlotTable, step: int) -> Optional[float]:
        self._worker.wait_all()  # the norms computed during the backward
        total_norm, scale = self._reduction.global_norm(blocks, slots, self.max_norm)
        self.last_norm = total_norm
        if not math.isfinite(total_norm):
            warnings.warn(f"offload: optimizer step {step + 1} skipped: the gradient norm is {total_norm}",
                          RuntimeWarning, stacklevel=2)
            return None
        return scale


# ----- the global norm ------------------------------------------------------------------------------------
def clip_scale_of(total: float, max_norm: float) -> Tuple[float, float]:
    """(total, gradient scale) with torch's fp32 arithmetic: min(max_norm / (total + 1e-6), 1), the one formula
    of the clip coefficient."""
    coef = torch.clamp(max_norm / (torch.tensor(total, dtype=torch.float32) + 1e-6), max=1.0)
    return total, float(coef)


def global_norm(blocks: List[BlockRecord], slots: SlotTable, max_norm: float) -> Tuple[float, float]:
    """(total L2 norm, gradient scale), the per-parameter norms reduced in torch's order (`model.parameters()`)
    in fp32, as clip_grad_norm_ does; a block's norms computed on the worker during backward are used."""
    per_param = [n for b in blocks for n in _norms_of(b)]
    by_id = slots.by_id
    per_param.sort(key=lambda pn: by_id[id(pn[0])].position)
    return clip_scale([n for _p, n in per_param], max_norm)


def clip_scale(norms: List[float], max_norm: float) -> Tuple[float, float]:
    """(total, gradient scale) from the per-parameter norms: their fp32 L2 norm, as clip_grad_norm_ takes it."""
    total = torch.linalg.vector_norm(torch.tensor(norms, dtype=torch.float32), 2)
    return clip_scale_of(float(total), max_norm)


def clip_in_place(blocks: List[BlockRecord], norm: Tuple[float, float], error_if_nonfinite: bool) -> float:
    """torch.nn.utils.clip_grad_norm_ over the held gradients, given their (total norm, scale); returns the
    total norm before clipping."""
    total_norm, coef = norm
    if error_if_nonfinite and not math.isfinite(total_norm):
        raise RuntimeError(f"The total norm of order 2.0 for gradients is non-finite ({total_norm}), so it "
                           "cannot be clipped. To disable this error and scale the gradients by the "
                           "non-finite norm anyway, set `error_if_nonfinite=False`")
    for block in blocks:
        block.norms = None  # norms computed during backward are of the unclipped gradients
        block.shard_sumsq = None
        for state in block.states:
            state.grads.scale_(coef)
    return total_norm


def _norms_of(record: BlockRecord) -> List[Tuple[nn.Parameter, float]]:
    if record.norms is not None:
        return record.norms
    return [n for state in record.states for n in state.grads.norms()]
