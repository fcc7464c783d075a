"""Every device<->host copy goes through here, so streams and events live in one place.

On a CPU compute device these are plain synchronous copies (a no-op scheduling layer). On CUDA this phase
also copies synchronously, on the current stream: correct first; the side streams with (tensor, event)
handoffs will be added here without changing the callers.
"""

from __future__ import annotations

import torch
from torch import Tensor


class CopyContext:
    """Copies between the compute device and the host for one engine; counts the bytes on each link."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.bytes_to_host = 0
        self.bytes_to_device = 0

    def to_device(self, dst: Tensor, src: Tensor) -> None:
        """Upload `src` (host) into `dst` (device)."""
        with torch.profiler.record_function("offload::h2d"):
            dst.copy_(src)
        if self.device.type != "cpu" or dst.data_ptr() != src.data_ptr():
            self.bytes_to_device += src.numel() * src.element_size()

    def count_to_host(self, nbytes: int) -> None:
        """Account a download done by a caller that reduces while copying (gradient accumulation)."""
        self.bytes_to_host += nbytes
