"""The named jobs the update worker runs: one block's AdamW update, or, once its gradients are complete for a
backward, their norms (clipping) and their parking (gradients that wait go to disk).

A job is made on the training thread when the block's update is scheduled (records/block_runtime.py: it
captures what must not change before it runs: which parameters have gradients, the hyperparameters, where
new weights go) and run on the worker by its body, `BlockJobs` (block_jobs.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, List, Optional, Protocol

from torch import Tensor

from offload.scheduler.state.adamw import AdamHyper

if TYPE_CHECKING:
    from offload.scheduler.records.block_runtime import BlockRuntime
    from offload.scheduler.records.group_runtime import GroupRuntime


class JobBodies(Protocol):
    """What runs a job on the worker (block_jobs.BlockJobs)."""

    def run_update(self, job: "UpdateJob") -> None: ...

    def run_park(self, job: "ParkJob") -> None: ...


@dataclass(frozen=True)
class GroupUpdate:
    """One flat group's part of a block update: ready slots, their hyperparameters, the weights' target."""

    runtime: "GroupRuntime"
    ready: List[int]
    hypers: List[AdamHyper]
    out: Optional[Tensor]
    out_base: int = 0  # the group element `out[0]` is (sharded weights: the rank's part starts there)


@dataclass(frozen=True)
class UpdateJob:
    """A block's AdamW update. `check_finite`: skip groups with inf/NaN gradients (no clipping);
    `step`: the optimizer step it belongs to (for the non-finite warning)."""

    block: "BlockRuntime"
    parts: List[GroupUpdate]
    grad_scale: float
    check_finite: bool
    step: int
    bodies: JobBodies

    def __call__(self) -> None:
        self.bodies.run_update(self)


@dataclass(frozen=True)
class ParkJob:
    """A block's gradients are complete for this backward and wait for later: on the worker, their norms when
    `norms` (clipping: taken before they leave memory), then each group's gradient home parks them (a spilling
    home writes them to disk; the others keep them)."""

    block: "BlockRuntime"
    norms: bool
    bodies: JobBodies

    def __call__(self) -> None:
        self.bodies.run_park(self)
