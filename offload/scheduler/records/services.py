"""`BlockServices`: what every block's record works with, made once per engine (setup/placement.py).

A block's record (block_runtime.py) does its own work: it waits for its update, pushes its new weights,
takes its gradients, schedules its update on the worker. These are the shared parts it does them with,
as FSDP2's `FSDPParamGroup` holds its communication context: one object, handed to every record.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from offload.scheduler.blocks.forward_order import ForwardOrder
from offload.scheduler.worker.step_worker import StepWorker
from offload.trace import Tracer

if TYPE_CHECKING:
    from offload.scheduler.modes.reduction import GradReduction
    from offload.scheduler.phases.step_stats import StepCounters
    from offload.scheduler.weights.pending_guard import PendingGuard
    from offload.scheduler.weights.streamer import WeightStreamer
    from offload.scheduler.worker.block_jobs import BlockJobs


@dataclass(frozen=True)
class BlockServices:
    worker: StepWorker  # runs the updates (and, with clipping, the norms) in the background
    streamer: "WeightStreamer"  # the device budget's LRU of streamed blocks
    tracer: Tracer
    counters: "StepCounters"
    order: ForwardOrder  # the forward's block order: prefetch, update priority
    reduction: "GradReduction"  # local, or averaged across data-parallel ranks (modes/reduction.py)
    jobs: "BlockJobs"  # what the worker runs for a block (worker/block_jobs.py)
    guard: "PendingGuard"  # resident parameters read through while their update is pending (step() returned)
