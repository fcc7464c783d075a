"""`BlockServices`: what every block's record works with, made once per engine (setup/placement.py), and
`GradReduction`, what a record asks of the reduction mode (modes/reduction.py implements it).

A block's record (block_record.py) does its own work: it waits for its update, pushes its new weights,
takes its gradients, schedules and runs its update. These are the shared parts it does them with, as FSDP2's
`FSDPParamGroup` holds its communication context: one object, handed to every record.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, List, Optional, Protocol, Tuple

from torch import Tensor

from offload.scheduler.records.forward_order import ForwardOrder
from offload.scheduler.records.nonfinite import NonFiniteSkips
from offload.scheduler.weights.pending_guard import PendingGuard
from offload.scheduler.weights.streamer import WeightStreamer
from offload.scheduler.worker.counters import StepCounters
from offload.scheduler.worker.step_worker import StepWorker
from offload.trace import Tracer

if TYPE_CHECKING:  # this package's own types: the protocol's arguments
    from offload.scheduler.records.block_record import BlockRecord, UpdateJob
    from offload.scheduler.records.group import GroupState
    from offload.scheduler.records.slot_table import SlotTable


class GradReduction(Protocol):
    """How a block's gradients become the ones it steps on: as they are (one process), or averaged across the
    data-parallel ranks into this rank's part (modes/reduction.py). The record runs its update's loop itself;
    the reduction answers what steps and how the new weights reach the other ranks."""

    zero_waits: bool  # zero_grad() waits for each block's pending job (it reads the gradients)

    def refuse_unknown_ranks(self) -> None:
        """At forward and step(): a process group that is not the one the engine was made for is refused."""

    def priority(self, forward_position: int) -> int:
        """The worker's priority of a block's job, from its position in the forward."""

    def runs_every_update(self, has_trainable: bool) -> bool:
        """Whether a block's update runs even when no parameter of it has a gradient here."""

    def check_arrival(self, block: "BlockRecord") -> None:
        """A gradient of the block arrives (its step's average, if taken, is taken back or refused)."""

    def check_torch_reads(self, block: "BlockRecord") -> None:
        """Torch code reads the block's held gradients (a clip): refused where they are not what it expects."""

    def ready_to_step(self, block: "BlockRecord", job: "UpdateJob") -> List[Optional[List[int]]]:
        """On the worker, before the update: per group of the job, the parameters to step (None: skip the group;
        a skip for non-finite gradients is counted here)."""

    def send_new_weights(self, state: "GroupState", out: Optional[Tensor]) -> None:
        """On the worker, after a group stepped: its new weights to every rank (nothing in one process)."""

    def norms(self, block: "BlockRecord", step: int) -> None:
        """On the worker: what clipping needs of the block's gradients."""

    def global_norm(self, blocks: List["BlockRecord"], slots: "SlotTable", max_norm: float) -> Tuple[float, float]:
        """(total norm, gradient scale) over every rank's gradients (the worker is idle)."""


@dataclass(frozen=True)
class BlockServices:
    worker: StepWorker  # runs the updates (and, with clipping, the norms) in the background
    streamer: WeightStreamer  # the device budget's LRU of streamed blocks
    tracer: Tracer
    counters: StepCounters
    order: ForwardOrder  # the forward's block order: prefetch, update priority
    reduction: GradReduction  # local, or averaged across data-parallel ranks (modes/reduction.py)
    guard: PendingGuard  # resident parameters read through while their update is pending (step() returned)
    nonfinite: NonFiniteSkips  # blocks skipped for non-finite gradients (no clipping)
    num_threads: Optional[int]  # the CPU Adam's threads
