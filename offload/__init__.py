"""offload: train models far larger than your GPU on one workstation.

Parameters, gradients and optimizer states move between GPU memory, pinned CPU memory and NVMe disks
while compute runs. The native core (`offload._C`) provides the fused CPU Adam, the aligned staging
buffers and the async file I/O; every part has a pure-PyTorch fallback.
"""

from offload._native import native_available, warn_if_unavailable
from offload.errors import OffloadConfigError, OffloadError, OffloadIntegrityError, OffloadIOError, OffloadMemoryError
from offload.io import AsyncIO
from offload.optim import CPUAdam
from offload.tiers.host import HostBuffer, StagingPool

warn_if_unavailable()

from offload.api import wrap  # noqa: E402  (after the native import warning)
from offload.engine.engine import Engine  # noqa: E402
from offload.parity import VerifyReport, verify  # noqa: E402
from offload.policy import OffloadPolicy, Tier  # noqa: E402

__version__ = "0.1.0"

__all__ = [
    "AsyncIO",
    "CPUAdam",
    "Engine",
    "HostBuffer",
    "OffloadConfigError",
    "OffloadError",
    "OffloadIOError",
    "OffloadIntegrityError",
    "OffloadMemoryError",
    "OffloadPolicy",
    "StagingPool",
    "Tier",
    "VerifyReport",
    "native_available",
    "verify",
    "wrap",
    "__version__",
]
