"""`Tiers`: the memory tiers one engine opened (setup/placement.py), closed together at the end."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from offload.scheduler.grads.grad_window import GradPool
from offload.scheduler.ring.disk_ring import DiskRing
from offload.scheduler.weights.streamer import WeightStreamer
from offload.tiers.copies import CopyContext
from offload.tiers.device import DeviceTier
from offload.tiers.disk import SwapStore
from offload.tiers.host import StagingPool


@dataclass
class Tiers:
    """The memory tiers one engine uses; `swap`, `staging` and `ring` exist on the nvme tier only."""

    device: DeviceTier
    copies: CopyContext
    streamer: WeightStreamer  # the device budget's LRU of streamed blocks
    swap: Optional[SwapStore] = None
    staging: Optional[StagingPool] = None
    ring: Optional[DiskRing] = None
    grad_pool: Optional[GradPool] = None  # the nvme tier's gradient window (grad_pool.py)

    def close(self) -> None:
        """Delete the swap file and free the ring's slots and the staging pool (after the ring has drained)."""
        if self.ring is not None:
            self.ring.close()
        if self.swap is not None:
            self.swap.close()
        if self.staging is not None:
            self.staging.close()
