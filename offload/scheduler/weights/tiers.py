"""`Tiers`: the memory tiers one engine opened (setup/placement.py), closed together at the end."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, Optional

from offload.optim.functional import TorchNorm
from offload.scheduler.activations.spill import ActivationSpill
from offload.scheduler.ring.disk_ring import DiskRing
from offload.scheduler.weights.streamer import WeightStreamer
from offload.tiers.copies import CopyContext
from offload.tiers.device import DeviceTier
from offload.tiers.disk import SwapStore
from offload.tiers.grad_window import GradPool
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
    grad_pool: Optional[GradPool] = None  # the nvme tier's gradient window (tiers/grad_window.py)
    activations: Optional[ActivationSpill] = None  # activations="offload": saved tensors to the swap directory
    torch_norm: TorchNorm = field(default_factory=TorchNorm)  # gradients' norms as torch takes them (clipping)

    def stats(self) -> Dict[str, float]:
        """Each tier's own counters, for `engine.stats()`."""
        copies, device, swap, pool, counts = self.copies, self.device, self.swap, self.grad_pool, self.streamer.counts
        out: Dict[str, float] = dict(
            bytes_device_to_host=copies.bytes_to_host, bytes_host_to_device=copies.bytes_to_device,
            copies_on_side_streams=copies.async_copies,
            device_bytes=device.in_use, device_peak_bytes=device.peak,
            device_over_budget_events=device.over_budget_events,
            block_fetches=counts.fetches, block_evictions=counts.evictions, block_prefetches=counts.prefetches,
            host_grad_bytes_peak=0 if pool is None else pool.peak,
            host_grad_over_budget_events=0 if pool is None else pool.over_budget_events,
            bytes_disk_read=0 if swap is None else swap.bytes_read,
            bytes_disk_written=0 if swap is None else swap.bytes_written)
        if self.ring is not None:
            out.update(self.ring.stats())
        if self.staging is not None:
            out["nvme_staging_bytes"] = self.staging.budget_bytes
        if self.activations is not None:
            out.update(self.activations.stats())
        return out

    def close(self) -> None:
        """Delete the swap file and free the ring's slots and the staging pool (after the ring has drained)."""
        try:
            if self.activations is not None:
                self.activations.close()
        finally:
            self._close_storage()

    def _close_storage(self) -> None:
        self.torch_norm.release()
        if self.ring is not None:
            self.ring.close()
        if self.swap is not None:
            self.swap.close()
        if self.staging is not None:
            self.staging.close()
