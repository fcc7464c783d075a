"""The modes of one engine, chosen once from its policy and placement (setup/assemble.py)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from offload.distributed.data_parallel import DataParallel
from offload.scheduler.modes.clipping import Clipping, NoClipping, NormClipping, Speculation
from offload.scheduler.modes.disk_traffic import DiskTraffic, NoDiskTraffic, RingTraffic
from offload.scheduler.modes.reduction import DataParallelReduction, LocalReduction, Reduction
from offload.scheduler.ring.disk_ring import DiskRing
from offload.scheduler.worker.step_worker import StepWorker


@dataclass(frozen=True)
class Modes:
    disk: DiskTraffic  # none, or the nvme ring's reads ahead and writes
    reduction: Reduction  # local, or across the data-parallel ranks
    clipping: Clipping  # none, or by the global norm


def disk_traffic_for(ring: Optional[DiskRing]) -> DiskTraffic:
    return NoDiskTraffic() if ring is None else RingTraffic(ring)


def reduction_for(dp: Optional[DataParallel], worker: StepWorker, num_threads: int) -> Reduction:
    return LocalReduction() if dp is None else DataParallelReduction(dp, worker, num_threads)


def clipping_for(max_grad_norm: Optional[float], worker: StepWorker, reduction: Reduction,
                 speculative: bool = False) -> Clipping:
    """No clipping, or by the global norm (`speculative`: blocks with shadows update during the last backward)."""
    if max_grad_norm is None:
        return NoClipping()
    return NormClipping(max_grad_norm, worker, reduction, Speculation() if speculative else None)
