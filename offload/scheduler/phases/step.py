"""The step phase: `engine.optimizer.step()`, `zero_grad()` and `clip_grad_norm_()`.

`step()` schedules the update of every block not updated during the backward, in forward order, with the
scale the clipping mode decides (or skips the step on a non-finite norm), then waits until every block's
new weights are in its parameters, as torch's step leaves them, unless `overlap_step` ([Note: step returns
early]). Ctrl-C waits until the step is fully scheduled (offload/_interrupts.py).
"""

from __future__ import annotations

import time
import warnings
from typing import List

from offload._interrupts import deferred_keyboard_interrupt
from offload._system import HEAP_SLACK_BYTES, return_freed_memory
from offload.errors import OffloadError
from offload.policy import OffloadPolicy
from offload.scheduler.modes.clipping import clip_in_place
from offload.scheduler.modes.selection import Modes
from offload.scheduler.phases.backward import BackwardPhase
from offload.scheduler.phases.backward_tracker import BackwardTracker
from offload.scheduler.phases.sync import Synchronizer
from offload.scheduler.records.block_record import BlockRecord, BlockServices, zeroed_after_early_update
from offload.scheduler.records.module_weights import ModuleWeights
from offload.scheduler.records.slot_table import SlotTable
from offload.scheduler.state.hypers import StepHypers


class StepPhase:
    def __init__(self, records: List[BlockRecord], slots: SlotTable, services: BlockServices, tracker: BackwardTracker,
                 hypers: StepHypers, modes: Modes, backward: BackwardPhase, writes: ModuleWeights,
                 sync: Synchronizer, policy: OffloadPolicy) -> None:
        self._records = records  # by block index
        self._slots = slots
        self._services = services
        self._tracker = tracker
        self._hypers = hypers
        self._clipping = modes.clipping
        self._reduction = modes.reduction
        self._backward = backward
        self._writes = writes
        self._sync = sync
        self._policy = policy

    def step(self) -> None:
        """engine.optimizer.step(): schedule the remaining block updates, then (unless `overlap_step`) wait
        until every block's new weights are in its parameters. Ctrl-C waits until the step is fully scheduled;
        in the wait after that, it reaches the user and the updates run on ([Note: Ctrl-C in a wait])."""
        self._sync.check_open()
        self._services.worker.raise_if_failed()
        self._reduction.refuse_unknown_ranks()  # a process group started after wrap(), e.g. for DDP
        early = self._policy.step_returns_early
        with self._services.tracer.span("step()"), deferred_keyboard_interrupt():
            self.schedule_step()
            if early:
                self._sync.guard_pending()  # the updates overlap the next forward; reads meanwhile wait for them
        if not early:
            start = time.perf_counter()
            with self._services.tracer.span("wait for updates", "step()"):
                self._sync.settle_weights()
            self._services.counters.wait_seconds += time.perf_counter() - start
        if self._policy.bounds_host_memory:
            # autograd's temporaries of this step, kept freed by glibc: RSS stays near the budgets asked for
            return_freed_memory(if_over=HEAP_SLACK_BYTES)

    def schedule_step(self) -> None:
        """Take the gradients still on the device, let the clipping mode decide the scale, and schedule every
        block's update in forward order."""
        self._writes.refuse_unfrozen()
        if self._tracker.failed_last_backward:
            warnings.warn("offload: step() after the last declared backward raised partway: the blocks updated "
                          "during it stepped on their complete gradients, the others now step on what they "
                          "received (engine.load(checkpoint) instead goes on exactly)", RuntimeWarning, stacklevel=2)
        self._tracker.end_step()
        hyper = self._hypers.read()
        self._backward.collect_grads()
        in_order = self._in_update_order()
        counters = self._services.counters
        scale = self._clipping.scale_for_step(in_order, self._slots, counters.steps, hyper)
        counters.grad_norm = self._clipping.last_norm
        if scale is None:
            counters.skipped_steps += 1
        else:
            for record in in_order:
                if not record.updated_early:
                    record.schedule_update(hyper, scale, self._clipping.checks_each_block)
        self.finish_step()

    def finish_step(self) -> None:
        self.reset_step()
        self._services.counters.steps += 1

    def reset_step(self) -> None:
        """Forget the step in progress: blocks updated early or speculatively, gradient norms, the early
        hyperparameters."""
        for record in self._records:
            record.end_step()
        self._clipping.drop_step()
        self._hypers.reset()

    def zero_grad(self, set_to_none: bool = True) -> None:
        """engine.optimizer.zero_grad(): drop the accumulated gradients (or zero them)."""
        self._sync.check_open()
        early = [r.block.name for r in self._records if r.updated_early]
        if early and self._tracker.failed_last_backward:
            raise self._tracker.failed_backward_error("zero_grad()", early[0])
        if early:  # torch would now step on no gradient at all; these blocks already stepped on the gradients
            raise zeroed_after_early_update(early[0])
        for record in self._records:
            record.zero_grads(set_to_none)
        self._clipping.drop_step()
        self._tracker.end_step()  # the backward passes counted toward the next step held those gradients

    def clip_grad_norm(self, max_norm: float, norm_type: float = 2.0, error_if_nonfinite: bool = False) -> float:
        """engine.clip_grad_norm_(): torch.nn.utils.clip_grad_norm_ over the gradients the engine holds (scaled
        in place, so the step and a later norm see them clipped); returns the total norm before clipping."""
        self._sync.check_open()
        self._services.worker.raise_if_failed()
        if float(norm_type) != 2.0:
            raise OffloadError(f"engine.clip_grad_norm_ computes the L2 norm only (norm_type=2), got {norm_type!r}")
        early = [r.block.name for r in self._records if r.updated_early]
        if early:
            raise OffloadError(
                f"engine.clip_grad_norm_() after blocks (first: {early[0]!r}) were updated during the last backward "
                "(grad_accumulation_steps declared, no max_grad_norm): pass max_grad_norm= to offload.wrap, which "
                "clips before any update, or leave grad_accumulation_steps unset")
        self._backward.collect_grads()
        self._services.worker.wait_all()  # norm jobs, and (overlap_step) updates that still read the gradients
        in_order = self._in_update_order()
        norm = self._reduction.global_norm(in_order, self._slots, max_norm)
        return clip_in_place(in_order, norm, error_if_nonfinite)

    def _in_update_order(self) -> List[BlockRecord]:
        return [self._records[i] for i in self._services.order.update_order()]
