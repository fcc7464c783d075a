"""What the checkpoint code needs of an engine: the `CheckpointTarget` protocol, and of each trainable flat
group, the `GroupStateView` protocol.

The reader and writer reach an engine only through these names (offload/engine/checkpoints.py adapts an
Engine to them), so the engine's inside can change without touching checkpoints, and a test can hand them
any object that keeps the promises.
"""

from __future__ import annotations

import contextlib
from typing import Any, Dict, Iterator, List, Optional, Protocol, Sequence, Tuple

import torch
from torch import nn

from offload.optim.moment_format import MomentFormat
from offload.policy import OffloadPolicy
from offload.scheduler.blocks.block import Block, FlatGroup
from offload.scheduler.state.state_store import Cloned, Fill, SwapSections, Views


class CheckpointStore(Protocol):
    """A group's optimizer state store, as a checkpoint streams it (state/state_store.py): `encoded`, the moments
    as the store keeps them ([Note: compressed moments])."""

    moments: MomentFormat

    @property
    def group(self) -> Any:
        """The group as the store sees it: a data-parallel rank's part, whose segments start its int8 blocks."""
        ...

    def reading(self, encoded: bool = False) -> "contextlib.AbstractContextManager[Iterator[Tuple[int, int, Views]]]":
        ...

    def write(self, fill: Fill, cloned: Cloned = (0, 0, 0), encoded: bool = False) -> None: ...

    def swap_sections(self) -> Optional[SwapSections]: ...


class GroupStateView(Protocol):
    """What a checkpoint reads and replaces of one trainable flat group's optimizer state."""

    @property
    def steps(self) -> List[int]:
        """Each trainable parameter's Adam step count."""
        ...

    def restore_steps(self, steps: Sequence[int]) -> None: ...

    @property
    def has_pending_grads(self) -> bool:
        """Gradients not yet stepped on (a checkpoint taken now would lose them)."""
        ...

    @property
    def state_store(self) -> CheckpointStore: ...

    @property
    def part(self) -> Tuple[int, int]:
        """[lo, hi): the elements of the group's trainable range this rank keeps (all of it in one process)."""
        ...


class CheckpointTarget(Protocol):
    module: nn.Module
    policy: OffloadPolicy
    optimizer: torch.optim.Optimizer

    def checkpoint_groups(self) -> Iterator[Tuple[Block, FlatGroup, Optional[GroupStateView]]]:
        """Every block's flat groups with their optimizer state (None: nothing trainable), all updates
        applied first."""
        ...

    def group_weights(self, group: FlatGroup) -> torch.Tensor:
        """The group's current compute weights on the host, in its flat layout."""
        ...

    @property
    def weights_gathered(self) -> bool:
        """Whether `group_weights` is a collective (sharded weights): every rank reads the groups in one order."""
        ...

    def set_group_weights(self, group: FlatGroup, flat: torch.Tensor) -> None:
        """Replace the group's compute weights (all its parameters, in its flat layout)."""
        ...

    def prepare_for_load(self) -> None:
        """The checkpoint was verified and is about to replace the state: drop gradients and the step in
        progress."""
        ...

    def mark_inconsistent(self, exc: BaseException) -> None:
        """A load failed after it began changing the state: refuse to train or save until a load succeeds."""
        ...

    def checkpoint_counters(self) -> Dict[str, int]:
        """`steps` and `skipped_steps`, as a checkpoint keeps them."""
        ...

    def restore_counters(self, counters: Dict[str, int]) -> None:
        ...


def pieces(group: FlatGroup, start: int, stop: int, view: torch.Tensor) -> List[Tuple[int, int, int, torch.Tensor]]:
    """How a checkpoint cuts a flat group's optimizer state into parameters: the parameters a chunk [start, stop)
    of one section covers, as (trainable slot index, first element of the piece within the parameter, first
    element within the group, the piece's view of `view`)."""
    out = []
    for index, slot in enumerate(group.trainable_slots):
        lo, hi = max(start, slot.offset), min(stop, slot.offset + slot.numel)
        if lo < hi:
            out.append((index, lo - slot.offset, lo, view[lo - start:hi - start]))
    return out
