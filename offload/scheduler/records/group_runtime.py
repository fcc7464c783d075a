"""`GroupRuntime`: one flat group during training (`group.runtime`): where its weights live (its weight home),
its optimizer state when it trains (group_state.py), and which of its parameters were written in place since
the engine last looked. See docs/design.md [Note: weights written after wrap()].
"""

from __future__ import annotations

from typing import TYPE_CHECKING, List, Optional

from torch import Tensor

from offload.scheduler.blocks.block import Block, FlatGroup, Residency
from offload.scheduler.records.group_state import GroupState
from offload.scheduler.state.state_store import overwrite_master
from offload.scheduler.torch_internals import version_of
from offload.scheduler.weights.weight_home import WeightHome

if TYPE_CHECKING:
    from offload.scheduler.records.block_runtime import BlockRuntime


class GroupRuntime:
    """One flat group during training (`group.runtime`): where its weights live, and its optimizer state
    when it trains."""

    def __init__(self, block: Block, group: FlatGroup, home: WeightHome, state: Optional[GroupState]) -> None:
        self.block = block
        self.group = group
        self.home = home
        self.state = state
        self.seen_versions: List[int] = []  # each parameter's `_version` when the engine last looked
        self.mark_seen()

    def replace_weights(self, flat: Tensor) -> None:
        """New compute weights for the whole group (a checkpoint load): into its home, and into the device
        buffer when the block is resident."""
        self.home.replace(flat, resident=self.block.residency is Residency.RESIDENT)
        self.mark_seen()  # what was written in place before the load is replaced by it

    def edited_slots(self) -> List[int]:
        """Trainable parameters written in place through the parameter since `mark_seen` (nn.init, a
        load_state_dict, a torch.no_grad() write: each bumps the parameter's version counter; the engine's own
        writes go through the flat buffer, whose counter is not the parameter's). Indices into
        `trainable_slots`, which are the group's first slots."""
        if self.state is None:
            return []
        return [i for i in range(len(self.group.trainable_slots)) if self._edited(i)]

    def edited_names(self) -> List[str]:
        """Every parameter of the group written in place since `mark_seen`, frozen ones included."""
        return [slot.name for i, slot in enumerate(self.group.slots) if self._edited(i)]

    def _edited(self, index: int) -> bool:
        return version_of(self.group.slots[index].param) != self.seen_versions[index]

    def mark_seen(self) -> None:
        self.seen_versions = [version_of(slot.param) for slot in self.group.slots]

    def keep_writes(self) -> None:
        """Weights written in place through the parameters (into the device buffer) become the group's: the
        trainable ones its master weights (moments kept, as torch.optim would train on from them), and the
        whole buffer its home's copy when the home is not the device buffer (a host mirror, the swap file).
        The caller has checked that no update of the block is pending."""
        edited = self.edited_slots()
        if not edited and not self.edited_names():
            return
        assert self.group.device_buffer is not None
        weights = self.group.device_buffer.detach()
        if edited:
            assert self.state is not None
            slots = [self.group.trainable_slots[i] for i in edited]
            overwrite_master(self.state.store, weights[:self.group.trainable_numel],
                             [(s.offset, s.offset + s.numel) for s in slots])
        if self.home.pushes:
            self.home.replace(weights.to("cpu"), resident=True)
        self.mark_seen()

    def note_writes_during_update(self, block: "BlockRuntime") -> None:
        """On the worker, after the group's update: a parameter written meanwhile (overlap_step: after step()
        returned) was overwritten by the update; the block's next use says so."""
        edited = self.edited_slots()
        if edited:
            block.lost_write = self.group.trainable_slots[edited[0]].name
            self.mark_seen()
