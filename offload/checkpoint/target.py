"""What the checkpoint code needs of an engine: the `CheckpointTarget` protocol `offload.Engine` implements.

The reader and writer reach an engine only through these names, so the engine's inside can change without
touching checkpoints, and a test can hand them any object that keeps the promises.
"""

from __future__ import annotations

from typing import Dict, Iterator, Optional, Protocol, Tuple

import torch
from torch import nn

from offload.policy import OffloadPolicy
from offload.scheduler.blocks.block import Block, FlatGroup
from offload.scheduler.records.runtime import GroupState


class CheckpointTarget(Protocol):
    module: nn.Module
    policy: OffloadPolicy
    optimizer: torch.optim.Optimizer

    def checkpoint_groups(self) -> Iterator[Tuple[Block, FlatGroup, Optional[GroupState]]]:
        """Every block's flat groups with their optimizer state (None: nothing trainable), all updates
        applied first."""
        ...

    def group_weights(self, group: FlatGroup) -> torch.Tensor:
        """The group's current compute weights on the host, in its flat layout."""
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
