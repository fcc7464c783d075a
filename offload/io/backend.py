"""Which engine moves the bytes: parsed once from the user's string into an enum."""

from __future__ import annotations

import enum
from typing import Optional, Union

from offload.errors import OffloadConfigError


class IOBackend(enum.Enum):
    """An async I/O engine. The native three need no library beyond libc (no liburing, no libaio)."""

    IO_URING = "io_uring"
    KERNEL_AIO = "aio"
    THREADS = "threads"
    AIOFILES = "aiofiles"

    @property
    def native(self) -> bool:
        """Whether the engine lives in offload._C (everything but the pure-Python aiofiles fallback)."""
        return self is not IOBackend.AIOFILES


# Preference when two native engines measure within a few percent of each other: io_uring is asynchronous
# for buffered files too, kernel AIO only with O_DIRECT (it does buffered I/O inside io_submit).
NATIVE_PREFERENCE = (IOBackend.IO_URING, IOBackend.THREADS, IOBackend.KERNEL_AIO)


def parse_backend(backend: Union[str, IOBackend]) -> Optional[IOBackend]:
    """Parse "auto" (-> None: measure), "io_uring", "aio", "threads", "aiofiles" or an IOBackend."""
    if isinstance(backend, IOBackend):
        return backend
    if isinstance(backend, str):
        name = backend.strip().lower()
        if name == "auto":
            return None
        for member in IOBackend:
            if name in (member.value, member.name.lower()):
                return member
    choices = ", ".join(["auto"] + [m.value for m in IOBackend])
    raise OffloadConfigError(f"backend={backend!r} is not an I/O backend: use one of {choices}")
