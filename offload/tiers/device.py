"""The device tier: the compute device's memory, as a budget the engine accounts for.

On a machine without a GPU the compute device is the CPU and this tier is only a budget: the same
allocation, release and accounting run, which is how CI tests the streaming paths. There each buffer is an
anonymous memory mapping of its own (tiers/mapped.py), so a streamed block's release gives its pages back
to the system at once (docs/design.md [Note: the nvme memory bound]). On CUDA the caching allocator keeps what it frees for the next fetch, as it should.
"""

from __future__ import annotations

from typing import Optional

import torch

from offload.errors import OffloadMemoryError
from offload.tiers.mapped import mapped_storage


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
        self.reserve(numel * dtype.itemsize, what)
        if self.device.type != "cpu":
            return torch.empty(numel, dtype=dtype, device=self.device)
        buffer = torch.empty(0, dtype=dtype)
        self.regrow(buffer, numel)
        return buffer

    def regrow(self, buffer: torch.Tensor, numel: int) -> None:
        """Give a released flat buffer (the same tensor object) memory for `numel` elements again."""
        if self.device.type != "cpu":
            buffer.untyped_storage().resize_(numel * buffer.element_size())
            return
        buffer.set_(mapped_storage(numel * buffer.element_size()), 0, (numel,), (1,))

    def shrink(self, buffer: torch.Tensor) -> None:
        """Free a flat buffer's memory, keeping the tensor object (its views must be gone)."""
        if self.device.type != "cpu":
            buffer.untyped_storage().resize_(0)
            return
        buffer.set_(torch.UntypedStorage(0), 0, (0,), (1,))

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
