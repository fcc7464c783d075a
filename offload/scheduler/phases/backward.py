"""The backward phase: the first gradient of the module's outputs (`begin_backward`), then each parameter's
gradient as autograd completes it (`on_grad`, the post-accumulate-grad hook).

`on_grad` hands the gradient to its block's record, which moves it into the group's gradient home; when the
declared last backward completes a block, the clipping mode says what happens now (an update at once, or,
with clipping, its norms). See docs/design.md [Note: when a block may update early].
"""

from __future__ import annotations

from torch import nn

from offload.scheduler.modes.clipping import Clipping
from offload.scheduler.phases.backward_tracker import BackwardTracker
from offload.scheduler.phases.forward import ForwardPhase
from offload.scheduler.phases.phase_clock import PhaseClock
from offload.scheduler.records.slot_table import SlotTable
from offload.scheduler.state.hypers import StepHypers
from offload.scheduler.torch_internals import graph_task_id


class BackwardPhase:
    def __init__(self, slots: SlotTable, tracker: BackwardTracker, clock: PhaseClock, forward: ForwardPhase,
                 clipping: Clipping, hypers: StepHypers) -> None:
        self._slots = slots
        self._tracker = tracker
        self._clock = clock
        self._forward = forward
        self._clipping = clipping
        self._hypers = hypers

    def begin_backward(self) -> None:
        """The first gradient of the module's outputs in a graph task. The task counts as a backward only at
        its first accumulated gradient (`on_grad`): `torch.autograd.grad` (a gradient penalty) passes here
        too but writes no `.grad`, and torch would not count it."""
        task = graph_task_id()
        self._clock.backward_begins(task)
        if self._tracker.is_new(task):
            self._tracker.announce(task)
            if self._clipping.updates_in(self._tracker.next_backward):
                self._forward.read_ahead_for_backward()

    def on_grad(self, param: nn.Parameter) -> None:
        """A parameter's gradient is complete for this backward."""
        ref = self._slots.by_id[id(param)]
        tracker = self._tracker
        tracker.accumulating(graph_task_id())
        tracker.fire(id(param))
        if tracker.keeps_grads_on_device:
            return
        if tracker.is_last_backward:
            tracker.watch_completion()  # blocks update during it: a failure partway must be told apart
        block = ref.block
        block.receive_grad(ref, param)
        backward = tracker.this_backward
        if self._clipping.watches(block, backward) and tracker.completes(block.trainable_ids):
            self._clipping.block_complete(block, self._hypers, backward)
        self._forward.heap.after_grad()  # the activations this gradient's backward consumed

    def collect_grads(self) -> None:
        """Before the step reads the gradients: take those still in `.grad` (fewer backward calls than
        declared, or a `.grad` the user set), and forget those cleared outside the engine (model.zero_grad())."""
        for record, refs in self._slots.per_record:
            record.take_leftover_grads(refs)
