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
        self.over_budget_events = 0

    def allocate(self, numel: int, dtype: torch.dtype, what: str) -> torch.Tensor:
        """An uninitialised flat buffer; raises OffloadMemoryError instead of growing past the budget."""
        self.reserve(numel * torch.empty((), dtype=dtype).element_size(), what)
        return torch.empty(numel, dtype=dtype, device=self.device)

    def fits(self, nbytes: int) -> bool:
        return self.budget is None or self.in_use + nbytes <= self.budget

    def reserve(self, nbytes: int, what: str, *, over_budget_ok: bool = False) -> None:
        """Account `nbytes` about to be allocated. Past the budget this raises, unless `over_budget_ok`
        (weights that autograd still holds: correctness first), which is counted in `over_budget_events`."""
        if not self.fits(nbytes):
            if not over_budget_ok:
                raise OffloadMemoryError(
                    f"device budget exceeded allocating {what} ({nbytes} bytes): {self.in_use} of {self.budget} "
                    "bytes in use; raise device_memory or let more blocks stream from the host")
            self.over_budget_events += 1
        self.in_use += nbytes
        self.peak = max(self.peak, self.in_use)

    def unreserve(self, nbytes: int) -> None:
        """Account bytes freed; the caller frees the memory itself."""
        self.in_use -= nbytes
