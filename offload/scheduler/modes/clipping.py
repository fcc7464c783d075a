"""Clipping, chosen once from `max_grad_norm`: what happens when a block's gradients are complete during the
declared last backward, and what the step does before it schedules the updates.

`NoClipping`: the block updates at once, during the backward ([Note: when a block may update early]), each
update checking its own gradients for inf/NaN; the nvme ring reads the updates' state ahead from the
forward on. `NormClipping`: no update may start before the global norm is known, so a completed block only
has its gradient norms computed on the worker; `step()` waits for them, computes the norm (across the
ranks in data-parallel mode), skips the whole step on a non-finite norm, and scales every update.
"""

from __future__ import annotations

import math
import warnings
from typing import TYPE_CHECKING, List, Optional, Protocol

from offload.scheduler.worker.step_worker import StepWorker

if TYPE_CHECKING:
    from offload.scheduler.modes.reduction import GradReduction
    from offload.scheduler.records.block_runtime import BlockRuntime
    from offload.scheduler.records.slot_table import SlotTable
    from offload.scheduler.state.hypers import StepHypers


class Clipping(Protocol):
    updates_during_backward: bool  # blocks update as their gradients complete in the declared last backward
    checks_each_block: bool  # each update skips a group with inf/NaN gradients (no global norm decides)
    last_norm: float  # the last step's global gradient norm before clipping (nan: none was computed)

    def block_complete(self, block: "BlockRuntime", hypers: "StepHypers", last: bool) -> None:
        """A backward completed the block's gradients (`last`: the declared last one before step())."""

    def scale_for_step(self, blocks: List["BlockRuntime"], slots: "SlotTable", step: int) -> Optional[float]:
        """The gradient scale of this step's updates, or None: skip the step."""


class NoClipping:
    updates_during_backward = True
    checks_each_block = True
    last_norm = math.nan

    def block_complete(self, block: "BlockRuntime", hypers: "StepHypers", last: bool) -> None:
        if last:
            block.update_early(hypers.for_early_update())
        elif block.spills:
            block.park_grads(norms=False)

    def scale_for_step(self, blocks: List["BlockRuntime"], slots: "SlotTable", step: int) -> Optional[float]:
        return 1.0


class NormClipping:
    """Clip to `max_norm` by the global L2 norm, as torch.nn.utils.clip_grad_norm_ (inf: measure only)."""

    updates_during_backward = False
    checks_each_block = False

    def __init__(self, max_norm: float, worker: StepWorker, reduction: "GradReduction") -> None:
        self.max_norm = max_norm
        self._worker = worker
        self._reduction = reduction
        self.last_norm = math.nan

    def block_complete(self, block: "BlockRuntime", hypers: "StepHypers", last: bool) -> None:
        """The norms while the gradient is in memory (the last backward's are the step's; an earlier one's
        serve when the block gets no more), then the gradient parks."""
        if last or block.spills:
            block.park_grads(norms=True)

    def scale_for_step(self, blocks: List["BlockRuntime"], slots: "SlotTable", step: int) -> Optional[float]:
        self._worker.wait_all()  # the norms computed during the backward
        total_norm, scale = self._reduction.global_norm(blocks, slots, self.max_norm)
        self.last_norm = total_norm
        if not math.isfinite(total_norm):
            warnings.warn(f"offload: optimizer step {step + 1} skipped: the gradient norm is {total_norm}",
                          RuntimeWarning, stacklevel=2)
            return None
        return scale
