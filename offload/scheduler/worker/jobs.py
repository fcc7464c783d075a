"""The named jobs the update worker runs: one block's AdamW update, or its gradient norms for clipping.

A job is made on the training thread when the block's update is scheduled (it captures what must not
change before it runs: which parameters have gradients, the hyperparameters, where new weights go) and
run on the worker by `BlockJobs.run_block_update` / `run_block_norms` (block_jobs.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, List, Optional

from torch import Tensor

from offload.scheduler.records.runtime import BlockRuntime, GroupRuntime
from offload.scheduler.state.adamw import AdamHyper


@dataclass(frozen=True)
class GroupUpdate:
    """One flat group's part of a block update: ready slots, their hyperparameters, the weights' target."""

    runtime: GroupRuntime
    ready: List[int]
    hypers: List[AdamHyper]
    out: Optional[Tensor]


@dataclass(frozen=True)
class UpdateJob:
    """A block's AdamW update. `check_finite`: skip groups with inf/NaN gradients (no clipping);
    `step`: the optimizer step it belongs to (for the non-finite warning)."""

    block: BlockRuntime
    parts: List[GroupUpdate]
    grad_scale: float
    check_finite: bool
    step: int
    run: Callable[["UpdateJob"], None]

    def __call__(self) -> None:
        self.run(self)


@dataclass(frozen=True)
class NormJob:
    """The gradient norms of a block's parameters, computed on the worker during backward (clipping)."""

    block: BlockRuntime
    run: Callable[["NormJob"], None]

    def __call__(self) -> None:
        self.run(self)
