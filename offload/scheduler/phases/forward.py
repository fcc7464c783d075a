"""The forward phase: the hooks call it around the root's forward and around each module owning a block.

`begin_root_forward` / `end_root_forward` enclose everything (when streaming, autograd saves streamed
weights as handles, fetched again in backward); `pre_forward(blocks)` gets each block ready (its record
does the work: a write kept, its pending update waited for, its new weights pushed, a streamed block made
resident and the next one prefetched), `post_forward(blocks)` lets them go. See docs/design.md, "Map".
"""

from __future__ import annotations

from typing import ContextManager, List, Optional

import torch
from torch import nn

from offload._system import KeptHeap
from offload.distributed.guard import refuse_outer_data_parallel
from offload.scheduler.activations.meter import RootSavedTensors
from offload.scheduler.blocks.block import Block
from offload.scheduler.modes.selection import Modes
from offload.scheduler.phases.backward_tracker import BackwardTracker
from offload.scheduler.phases.phase_clock import PhaseClock
from offload.scheduler.records.block_record import BlockRecord
from offload.scheduler.records.forward_order import ForwardOrder
from offload.scheduler.torch_internals import is_backward
from offload.scheduler.weights.streamer import WeightStreamer


class ForwardPhase:
    def __init__(self, records: List[BlockRecord], module: nn.Module, tracker: BackwardTracker, clock: PhaseClock,
                 order: ForwardOrder, streamer: WeightStreamer, modes: Modes, saved_tensors: RootSavedTensors,
                 heap: Optional[KeptHeap] = None) -> None:
        self._records = records  # by block index
        # trimmed as each block's forward begins and as gradients come (_system.FreedHeapTrim), or left to glibc
        self.heap = heap if heap is not None else KeptHeap()
        self._module = module
        self._tracker = tracker
        self._clock = clock
        self._order = order
        self._streamer = streamer
        self._modes = modes
        self._saved_tensor_hooks: List[ContextManager[object]] = []
        # the root forward's saved-tensor hooks: streamed weights as handles, (activations="offload") the rest to
        # the swap directory (activations/spill.py), and what is saved measured for the plan (activations/meter.py)
        self.saved_tensors = saved_tensors
        self._root_grad_enabled = False  # whether the root forward in progress records a graph

    def begin_root_forward(self, tokens: Optional[int] = None) -> None:
        """Time the forward; when streaming, autograd saves streamed weights as handles (fetched again in
        backward); `tokens`: the size of the batch's token input, for the plan's activations per token."""
        self._modes.reduction.refuse_unknown_ranks()  # a process group started after wrap()
        refuse_outer_data_parallel(self._module)  # DDP / FSDP around the engine's module
        self._root_grad_enabled = torch.is_grad_enabled()
        self._clock.forward_begins()
        context = self.saved_tensors.context(self._root_grad_enabled, tokens)
        context.__enter__()
        self._saved_tensor_hooks.append(context)

    def end_root_forward(self) -> None:
        if self._saved_tensor_hooks:
            self._saved_tensor_hooks.pop().__exit__(None, None, None)
        self.saved_tensors.meter.end()
        self._clock.forward_ends()

    def pre_forward(self, blocks: List[Block]) -> None:
        """Get each block ready for its module's forward. Runs in forward, under no_grad, and for checkpoint
        recompute during backward (there a streamed block stays pinned until the backward ends)."""
        in_backward = is_backward()
        if in_backward:
            self.saved_tensors.meter.saw_recompute()
        elif blocks:
            self.saved_tensors.meter.enter_block(blocks[-1].index)
            self.heap.enter_block(blocks[-1].index)
        for block in blocks:
            record = self._records[block.index]
            following = self._next_in_forward_order(block) if self._order.known and not in_backward else None
            record.enter_forward(following, in_backward)
            if not in_backward and self._tracker.profile is None and self._root_grad_enabled:
                self._tracker.predict_from_forward(record.trainable_ids, torch.is_grad_enabled())
            if self._order.use(block.index) and not in_backward \
                    and self._modes.clipping.updates_in(self._tracker.next_backward):
                self.read_ahead_for_backward()  # the disk is otherwise idle during the forward

    def post_forward(self, blocks: List[Block]) -> None:
        """The module no longer needs these blocks (also after an exception)."""
        for block in blocks:
            self._records[block.index].leave_forward()

    def read_ahead_for_backward(self) -> None:
        """Blocks update as their gradients complete, roughly in reverse forward order: the disk reads their
        state as soon as slots allow (from the forward on), not when each block's gradients are in."""
        if self._order.known:
            self._modes.disk.read_ahead_for_backward([self._records[i] for i in self._order.reversed()])

    def _next_in_forward_order(self, block: Block) -> Optional[BlockRecord]:
        following = self._order.after(block.index)
        return None if following is None else self._records[following]
