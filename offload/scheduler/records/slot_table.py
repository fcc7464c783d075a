"""`SlotTable`: trainable parameter -> where it lives (its `SlotRef`: block record, group state, slot, position)."""

from __future__ import annotations

from typing import Dict, Iterator, List, Sequence, Tuple

from torch import nn

from offload.scheduler.records.block_record import BlockRecord, SlotRef


class SlotTable:
    """Trainable parameter -> its `SlotRef`: the one map from what autograd hands a hook to the engine's
    records. Keyed by `id(param)` inside (the parameters are alive as long as the table: the blocks hold
    them): a lookup runs per gradient, and `Tensor.__hash__` is a Python call several times slower."""

    def __init__(self, records: Sequence[BlockRecord], module: nn.Module) -> None:
        position = {p: i for i, p in enumerate(module.parameters())}
        self.by_id: Dict[int, SlotRef] = {}  # `id(param)` -> its ref: what the hot paths look up (no call)
        self._refs = self.by_id
        for record in records:
            for group in record.groups:
                if group.state is not None:
                    for index, slot in enumerate(group.group.trainable_slots):
                        self._refs[id(slot.param)] = SlotRef(record, group.state, index, position[slot.param],
                                                             slot.param)
        # each record's refs, in its groups' slot order: the records' own loops over their parameters
        self.per_record: List[Tuple[BlockRecord, List[SlotRef]]] = [
            (record, [ref for ref in self._refs.values() if ref.block is record]) for record in records]

    def __getitem__(self, param: nn.Parameter) -> SlotRef:
        return self._refs[id(param)]

    def clear(self) -> None:
        """Drop every reference to the records (the engine is closing: the optimizer state is freed)."""
        self._refs.clear()
        self.per_record.clear()

    def __iter__(self) -> Iterator[nn.Parameter]:
        return (ref.param for ref in self._refs.values())
