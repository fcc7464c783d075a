"""`PendingGuard`: resident parameters read through while their block's update is pending.

`step()` may return once the updates are scheduled (docs/design.md [Note: step returns early]): the next
forward waits for each block's update when it reaches it, so the updates overlap it. Code between `step()`
and that forward that reads or writes a resident block's parameters (an EMA, a metric, `nn.init`) must still
see what torch would show. So `step()` guards every resident block whose update is pending: its parameters
read through (weights/read_through.py) until the block settles (its forward's pre-hook, a read,
`synchronize()`), which waits for the update, pushes the new weights and releases the guard (the block's
record guards and releases it: the pending update is the record's). Streamed blocks read through
outside their forward anyway. The guard keeps, per guarded block, the device buffers' storage addresses, so a
read-through parameter finds its block.
"""

from __future__ import annotations

from typing import Dict, List, Optional

from torch import Tensor

from offload.scheduler.blocks.block import Block
from offload.scheduler.weights.read_through import ReadThrough


class PendingGuard:
    def __init__(self, read_through: ReadThrough) -> None:
        self._read_through = read_through
        self._by_storage: Dict[int, Block] = {}  # a guarded block's device buffer storage address -> the block
        self._addresses: Dict[int, List[int]] = {}  # a guarded block's index -> those addresses

    def guard(self, block: Block) -> None:
        """Its parameters read through until `release` (its update is pending)."""
        if block.index in self._addresses:
            return
        addresses = [g.device_buffer.untyped_storage().data_ptr() for g in block.groups if g.device_buffer is not None]
        for address in addresses:
            self._by_storage[address] = block
        self._addresses[block.index] = addresses
        for slot in block.slots:
            self._read_through.mark(slot.param)

    def release(self, block: Block) -> None:
        """The block settled: its parameters are plain again."""
        addresses = self._addresses.pop(block.index, None)
        if addresses is None:
            return
        for address in addresses:
            self._by_storage.pop(address, None)
        for slot in block.slots:
            self._read_through.unmark(slot.param)

    def release_all(self) -> None:
        for block in list(self._by_storage.values()):
            self.release(block)

    def block_of(self, param: Tensor) -> Optional[Block]:
        """The guarded block whose device buffer `param` points into, if any."""
        return self._by_storage.get(param.untyped_storage().data_ptr())
