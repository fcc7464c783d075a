"""How a checkpoint cuts a flat group's optimizer state into parameters.

The state itself is read and written through the group's `StateStore` (scheduler/state/state_store.py:
`reading()`, `write(fill)`, `swap_sections()`), which knows how its tier keeps it; this module only maps a
chunk of the group's trainable range onto the parameters it covers.
"""

from __future__ import annotations

from typing import List, Tuple

from torch import Tensor

from offload.scheduler.blocks.block import FlatGroup
from offload.scheduler.state.state_store import Views

STATE_KINDS = ("master", "exp_avg", "exp_avg_sq")  # a group's optimizer state, in a record's section order

__all__ = ["Views", "pieces"]


def pieces(group: FlatGroup, start: int, stop: int, view: Tensor) -> List[Tuple[int, int, int, Tensor]]:
    """The parameters a chunk [start, stop) of one section covers: (trainable slot index, first element of
    the piece within the parameter, first element within the group, the piece's view of `view`)."""
    out = []
    for index, slot in enumerate(group.trainable_slots):
        lo, hi = max(start, slot.offset), min(stop, slot.offset + slot.numel)
        if lo < hi:
            out.append((index, lo - slot.offset, lo, view[lo - start:hi - start]))
    return out
