"""The order in which the forward first uses the blocks, recorded on the first step.

Prefetch follows it (the block after the one starting), the update worker runs queued updates by it (the
next forward needs the first blocks first), and the nvme ring reads state ahead in its reverse (the order
gradients complete). A changed order later (a branch, a second forward) only makes these guesses worse:
nothing correct depends on it. See docs/design.md [Note: changed order and torch.compile].
"""

from __future__ import annotations

from typing import Dict, List, Optional


class ForwardOrder:
    """Block indices in first-use order; `known` once an update has been scheduled (a whole step seen)."""

    def __init__(self, num_blocks: int) -> None:
        self._num_blocks = num_blocks
        self._order: List[int] = []
        self._position: Dict[int, int] = {}
        self.known = False

    def record(self, index: int) -> bool:
        """Note a block's use; True when this is its first use."""
        if index in self._position:
            return False
        self._position[index] = len(self._order)
        self._order.append(index)
        return True

    def use(self, index: int) -> bool:
        """Note a block's use (`record`); True when a forward over the recorded order starts again: the order's
        first block, used before."""
        return not self.record(index) and index == self.first

    @property
    def first(self) -> Optional[int]:
        return self._order[0] if self._order else None

    def after(self, index: int) -> Optional[int]:
        """The block used right after `index` on the first step, if any."""
        position = self._position.get(index)
        if position is None or position + 1 >= len(self._order):
            return None
        return self._order[position + 1]

    def priority(self, index: int) -> int:
        """Position in the forward; blocks never seen in a forward come after all seen ones."""
        return self._position.get(index, self._num_blocks + index)

    def update_order(self) -> List[int]:
        """Every block index: the forward's order, then those never seen in a forward."""
        return self._order + [i for i in range(self._num_blocks) if i not in self._position]

    def reversed(self) -> List[int]:
        return self._order[::-1]
