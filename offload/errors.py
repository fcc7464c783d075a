"""The exceptions offload raises. Each message names the thing that is wrong and the fix."""

from __future__ import annotations

import errno as _errno
import os
from typing import Optional


class OffloadError(Exception):
    """Base class of every error offload raises on purpose."""


class OffloadConfigError(OffloadError, ValueError):
    """A bad option or input, found before any work is done (a bad path, a budget too small, a bad tensor)."""


class OffloadMemoryError(OffloadError, MemoryError):
    """A memory budget would be exceeded: offload never grows past a budget silently."""


class OffloadIOError(OffloadError, OSError):
    """A file operation failed. Carries the path, offset, size and errno of the failing request."""

    def __init__(self, err: int, message: str, path: str, offset: int, size: int, op: str = "") -> None:
        self.path = path
        self.offset = offset
        self.size = size
        self.op = op
        name = _errno.errorcode.get(err, str(err)) if err else "no errno"
        detail = f"{op} {path!r} offset={offset} size={size}: {message} [{name}]".strip()
        super().__init__(err, detail)
        self.filename = path

    def __str__(self) -> str:
        return self.strerror or super().__str__()

    @staticmethod
    def from_errno(err: int, path: str, offset: int, size: int, op: str = "") -> "OffloadIOError":
        return OffloadIOError(err, os.strerror(err) if err else "I/O error", path, offset, size, op)

    def if_disk_full(self, message: str) -> "OffloadIOError":
        """This error, or for a full disk (ENOSPC, EDQUOT) the same one saying `message` (what is intact and
        what to do) instead of the bare errno text."""
        if self.errno not in (_errno.ENOSPC, _errno.EDQUOT):
            return self
        return OffloadIOError(self.errno, message, self.path, self.offset, self.size, self.op)


class OffloadIntegrityError(OffloadError):
    """Data read back is not what was written (checksum or size mismatch): never returned as garbage."""

    def __init__(self, message: str, path: Optional[str] = None) -> None:
        super().__init__(message)
        self.path = path
