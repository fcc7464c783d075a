"""The device tier: the compute device's memory, as a budget the engine accounts for.

On a machine without a GPU the compute device is the CPU and this tier is only a budget: the same
allocation, release and accounting run, which is how CI tests the streaming paths.
"""

from __future__ import annotations

from typing import Optional

import torch

from offload.errors import OffloadMemoryError


class DeviceTier:
    """Allocates flat buffers on the compute device within `budget` bytes and records the peak."""

    def __init__(self, device: torch.device, budget: Optional[int]) -> None:
        self.device = device
        self.budget = budget
        self.in_use = 0
        self.peak = 0

    def allocate(self, numel: int, dtype: torch.dtype, what: str) -> torch.Tensor:
        """An uninitialised flat buffer; raises OffloadMemoryError instead of growing past the budget."""
        nbytes = numel * torch.empty((), dtype=dtype).element_size()
        if self.budget is not None and self.in_use + nbytes > self.budget:
            raise OffloadMemoryError(
                f"device budget exceeded allocating {what} ({nbytes} bytes): {self.in_use} of {self.budget} "
                "bytes in use; raise device_memory or let more blocks stream from the host")
        buffer = torch.empty(numel, dtype=dtype, device=self.device)
        self.in_use += nbytes
        self.peak = max(self.peak, self.in_use)
        return buffer

    def free(self, buffer: torch.Tensor) -> None:
        """Account a buffer as freed; the caller drops its last reference."""
        self.in_use -= buffer.numel() * buffer.element_size()
